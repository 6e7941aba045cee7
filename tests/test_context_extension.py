"""Context extension from stage 3 (``config.stage3.rope_scaling``): validated before any work, applied to the
student's FA heads from the long stage on, written into the export and back by ``load_hydrahead``."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_helpers import run_train, tiny_config

from hydrahead_jax.config import ConfigError, ModelConfig, RopeScaling, parse_rope_extension, with_rope_extension
from hydrahead_jax.run_config import RunConfig

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
    max_position_embeddings=2048,
)  # fmt: skip


def test_extension_specs():
    assert parse_rope_extension("yarn:4") == ("yarn", 4.0, None)
    assert parse_rope_extension("linear:2.5:1024") == ("linear", 2.5, 1024)
    ext = with_rope_extension(CFG, "yarn:4")
    assert ext.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=2048)
    assert ext.max_position_embeddings == 8192
    assert with_rope_extension(CFG, "yarn:4:512").max_position_embeddings == 2048
    dyn = with_rope_extension(CFG, "dynamic:2")
    assert dyn.rope_scaling.rope_type == "dynamic" and dyn.max_position_embeddings == 2048
    for bad in ("yarn", "yarn:x", "yarn:0.5", "llama3:8", "yarn:4:0"):
        with pytest.raises(ConfigError, match="TYPE:FACTOR"):
            parse_rope_extension(bad)
    with pytest.raises(ConfigError, match="already uses RoPE scaling 'llama3'"):
        with_rope_extension(
            CFG.replace(rope_scaling=RopeScaling("llama3", factor=8, low_freq_factor=1, high_freq_factor=4)), "yarn:4"
        )


def test_recipe_refuses_extension_outside_the_long_stage_and_bad_specs():
    c = tiny_config()
    c.stage2.rope_scaling = "yarn:4"
    with pytest.raises(ConfigError, match=r"config\.stage2\.rope_scaling='yarn:4'.*stage 3"):
        RunConfig.from_recipe(c)
    c = tiny_config()
    c.stage3.rope_scaling = "yarn:four"
    with pytest.raises(ConfigError, match=r"config\.stage3\.rope_scaling='yarn:four'"):
        RunConfig.from_recipe(c)


def test_pipeline_student_config_per_stage():
    """Stages 1-2 train the student under the teacher's RoPE, stage 3 (and the export) under the extension."""
    from hydrahead_jax.run_config import STAGES
    from hydrahead_jax.training.pipeline import student_config

    c = tiny_config()
    c.stage3.rope_scaling = "yarn:4:32"
    run = RunConfig.from_recipe(c)
    cfg = run.teacher.model
    assert [student_config(run, cfg, s).rope_scaling for s in STAGES[:2]] == [None, None]
    assert student_config(run, cfg, STAGES[2]) == with_rope_extension(cfg, "yarn:4:32")
    c.teacher.model.update(rope_scaling=dict(rope_type="linear", factor=2.0))
    run = RunConfig.from_recipe(c)
    with pytest.raises(ConfigError, match=r"config\.stage3\.rope_scaling: .*already uses RoPE scaling 'linear'"):
        student_config(run, run.teacher.model, STAGES[2])


def test_export_round_trip_keeps_the_scaling(tmp_path):
    """export_final + load_hydrahead of a student with yarn x4: the config comes back and so do the logits (at
    3x the original length, where the scaling matters: plain RoPE on the same weights gives others)."""
    from hydrahead_jax.export import export_final, load_hydrahead
    from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_model

    cfg = with_rope_extension(CFG.replace(num_layers=2, max_position_embeddings=32), "yarn:4")
    head_map = HeadMap.from_fa_groups(cfg, [[0], [1]], method="test")
    hybrid = HybridConfig(attention_implementation="xla", gdn_implementation="xla")
    student = build_model(cfg, head_map, hybrid, nnx.Rngs(3))
    graphdef, state = nnx.split(student)
    final = export_final(tmp_path / "final", graphdef, nnx.as_pure(state), cfg, head_map, hybrid)
    loaded, _ = load_hydrahead(final)
    assert loaded.cfg == cfg and loaded.cfg.rope_scaling.rope_type == "yarn"
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 96)), jnp.int32)
    got = _logits(loaded, ids)
    np.testing.assert_array_equal(got, _logits(student, ids))  # same weights, same program
    plain_cfg = cfg.replace(rope_scaling=None)
    plain = nnx.merge(
        nnx.split(nnx.eval_shape(lambda: build_model(plain_cfg, head_map, hybrid, nnx.Rngs(0))))[0], state
    )
    assert np.abs(got - _logits(plain, ids)).max() > 1e-3


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def _logits(model, ids) -> np.ndarray:
    return np.asarray(_forward(*nnx.split(model), ids))


@pytest.mark.slow
def test_stage3_extension_reaches_the_export(tmp_path):
    """train.py's tiny pipeline with stage 3 extended by yarn x4 from 32 tokens (stage 3 trains at 64): the export's
    config carries the scaling, every FA head's attention module uses it, and it changes the logits. The one test
    of the whole path (recipe → stage 3 → export); ~90 s of CPU, mostly compiling three stages."""
    from hydrahead_jax.export import load_hydrahead
    from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_model

    workdir = tmp_path / "run"
    steps = [f"--config.stage{i}.steps={n}" for i, n in ((1, 1), (2, 1), (3, 2))]
    proc = run_train(workdir, *steps, "--config.stage3.rope_scaling=yarn:4:32", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    model, _ = load_hydrahead(workdir / "final")
    expected = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=32)
    assert model.cfg.rope_scaling == expected and model.cfg.max_position_embeddings == 128
    fa_layers = [model.layer(i).self_attn for i, f in enumerate(model.layer_kinds) if f]
    assert fa_layers and all(a.cfg.rope_scaling == expected for a in fa_layers)
    # the same trained weights under the teacher's plain RoPE give other logits at 96 tokens (3 x 32)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (1, 96)), jnp.int32)
    plain_cfg = model.cfg.replace(rope_scaling=None, max_position_embeddings=32768)
    final = workdir / "final"
    head_map = HeadMap.load(final / "head_map.json", plain_cfg)
    hybrid = HybridConfig.from_dict(json.loads((final / "hybrid_config.json").read_text()))
    plain = nnx.eval_shape(lambda: build_model(plain_cfg, head_map, hybrid, nnx.Rngs(0)))
    plain = nnx.merge(nnx.split(plain)[0], nnx.split(model)[1])
    assert np.abs(_logits(model, ids) - _logits(plain, ids)).max() > 1e-3
