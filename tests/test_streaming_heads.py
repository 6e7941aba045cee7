"""Streaming LA heads (``HybridConfig.la_window``, hybrid/window.py): the blocked window attention against a
numpy loop over its definition, packed documents included; a window that covers the whole sequence gives the
teacher back; the fusion fit of the GDN heads to what the window leaves; cache sizes; refusals. (Prefill + decode
through the ring buffer against the full forward pass is tests/test_hybrid_model.py's ``streaming`` variant.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_hybrid_model import CFG, forward, ids_of, random_teacher

from hydrahead_jax.config import ConfigError
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_student
from hydrahead_jax.hybrid.cache import cache_bytes
from hydrahead_jax.hybrid.window import streaming_attention


def reference(q, k, v, *, window, sinks, scale, positions, segments):
    """The module docstring's definition, one query at a time, in float64."""
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros((b, t, hq, d))
    for r in range(b):
        for i in range(t):
            start = i - positions[r, i]
            seen = [
                j
                for j in range(i + 1)
                if segments[r, j] == segments[r, i]
                and ((start <= j < start + sinks) or (i - j < window and positions[r, j] >= sinks))
            ]
            for h in range(hq):
                s = np.array([q[r, i, h] @ k[r, j, h // g] for j in seen]) * scale
                p = np.exp(s - s.max())
                out[r, i, h] = (p / p.sum()) @ v[r, seen, h // g]
    return out


@pytest.mark.parametrize("window, sinks", [(4, 2), (5, 0), (3, 1), (64, 4)])
def test_window_attention_matches_its_definition_on_packed_documents(window, sinks):
    """Two rows of 23 tokens (not a multiple of any window: the padded last block): one document, and three
    packed documents with positions restarting at each (each document has its own sinks)."""
    rng = np.random.default_rng(window * 10 + sinks)
    b, t, hq, hkv, d = 2, 23, 4, 2, 8
    q, k, v = (rng.standard_normal((b, t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    segments = np.array([[1] * t, [1] * 7 + [2] * 9 + [3] * 7])
    positions = np.array([np.arange(t), np.r_[np.arange(7), np.arange(9), np.arange(7)]])
    got = streaming_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window=window, sinks=sinks, scale=0.3,
        positions=jnp.asarray(positions), segment_ids=jnp.asarray(segments),
    )  # fmt: skip
    want = reference(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), window=window, sinks=sinks, scale=0.3,
        positions=positions, segments=segments,
    )  # fmt: skip
    # measured (2026-12-03): at most 3.7e-7 apart (float32 against float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6)


def test_a_window_over_the_whole_sequence_is_the_teacher():
    """With the window and sinks covering every token and the fused GDN part switched off (γ = μ = 0), each LA head
    is its teacher head: the student's logits are the teacher's."""
    teacher = random_teacher()
    head_map = HeadMap.from_fa_groups(CFG, [[1], [], [0, 1]], method="test")
    student = build_student(teacher, head_map, HybridConfig(la_window=32, la_sinks=2, fusion_init="fit"))
    fusion = student.layers.self_attn.fusion
    fusion.gamma.set_value(jnp.zeros_like(fusion.gamma[...]))
    ids = ids_of((2, 30), seed=3)
    # measured (2026-12-03): logits at most 1.3e-6 apart
    np.testing.assert_allclose(forward(student, ids), forward(teacher, ids), rtol=0, atol=1e-5)
    # a short window is a real restriction: the same student with 4 recent tokens differs
    short = build_student(teacher, head_map, HybridConfig(la_window=4, la_sinks=1, fusion_init="fit"))
    short.layers.self_attn.fusion.gamma.set_value(jnp.zeros_like(fusion.gamma[...]))
    assert np.abs(forward(short, ids) - forward(teacher, ids)).max() > 1e-2


def test_the_fusion_fit_adds_the_gdn_heads_to_what_the_window_leaves():
    """calibrate_fusion with la_window fits γ, μ of the GDN heads to the teacher head minus the window part: on
    the calibration batch the LA heads' outputs end closer to the teacher's heads than the window alone (γ = 0)
    — the least-squares fit can only lower that error."""
    from hydrahead_jax.models.attention import Attention

    teacher = random_teacher()
    head_map = HeadMap.from_fa_groups(CFG, [[0], [], [1]], method="test")
    hc = HybridConfig(la_window=4, la_sinks=1, fusion_init="fit", fusion_bias=True)
    ids = ids_of((2, 24), seed=4)
    fitted = build_student(teacher, head_map, hc, calibration_ids=ids)
    window_only = build_student(teacher, head_map, hc)
    window_only.layers.self_attn.fusion.gamma.set_value(jnp.zeros_like(fitted.layers.self_attn.fusion.gamma[...]))
    inter: dict = {}
    teacher.hidden_states(jnp.asarray(ids), intermediates=inter)
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))

    def error(student):
        def layer(block, kind, carry, x, slot):
            attn = block.self_attn
            mine, _ = attn.head_outputs(x, positions, kind=kind)
            target, _ = Attention.head_outputs(attn, x, positions)
            la = attn.fused_heads(kind)
            return carry, jnp.mean(jnp.square(mine[:, :, -la:] - target[:, :, -la:])) if la else jnp.zeros(())

        return np.asarray(student.scan_layers(layer, None, inter["attn_inputs"])[1])

    e_fit, e_window = error(fitted), error(window_only)
    assert (e_fit <= e_window + 1e-9).all() and (e_fit < 0.99 * e_window).any(), (e_fit, e_window)


def test_cache_bytes_count_the_window_and_match_the_cache_arrays():
    teacher = random_teacher()
    head_map = HeadMap.from_fa_groups(CFG, [[0, 1], [], [1]], method="test")
    hc = HybridConfig(la_window=8, la_sinks=2, fusion_init="fit")
    student = build_student(teacher, head_map, hc)
    cache = jax.eval_shape(lambda: student.init_cache(1, 100))
    arrays = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache["layers"]))
    sizes = cache_bytes(student, context_len=100)
    assert sizes["total_bytes"] == arrays
    # by hand: the window adds 2 · (2 + 8) slots · n_LA groups · 16 dims · 4 bytes over layers 1 (2 groups), 2 (1)
    plain = cache_bytes(CFG, head_map, context_len=100, hybrid_cfg=HybridConfig())
    assert sizes["state_bytes"] - plain["state_bytes"] == 2 * 10 * (2 + 1) * 16 * 4


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(la_window=8), "fusion_init='fit'"),
        (dict(la_window=8, fusion="both", fusion_init="fit"), "fusion='la_scale'"),
        (dict(la_window=-1), "la_window must be an integer >= 0"),
        (dict(la_sinks=1.5), "la_sinks must be an integer >= 0"),
    ],
)
def test_bad_window_settings_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        HybridConfig(**changes)


def test_window_attention_under_a_sequence_mesh_is_refused_with_the_fix():
    from hydrahead_jax.training.sharding import make_mesh

    teacher = random_teacher()
    hc = HybridConfig(la_window=4, la_sinks=1, fusion_init="fit")
    student = build_student(teacher, HeadMap.from_fa_groups(CFG, [[0], [], [1]], method="test"), hc)
    graphdef, state = nnx.split(student)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:2], sequence=2)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="mesh.sequence=1, or la_window=0"):
        jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))(state, jnp.asarray(ids_of((1, 16))))


def test_a_run_with_window_heads_under_a_sequence_mesh_is_refused_before_any_work():
    from configs import tiny
    from hydrahead_jax.run_config import RunConfig

    recipe = tiny.get_config()
    recipe.hybrid.la_window, recipe.hybrid.fusion_init = 8, "fit"
    run = RunConfig.from_recipe(recipe)
    run.check_sequence_split(1)  # one device along the sequence: fine
    with pytest.raises(ConfigError, match="--config.mesh.sequence=1, or --config.hybrid.la_window=0"):
        run.check_sequence_split(2)


def test_the_option_off_leaves_the_recorded_config_as_before_it_existed():
    """A config without the window (the default) records no la_window / la_sinks, so runs, fingerprints and
    comparison hashes made before the option existed still match; with it on, both are recorded and read back."""
    off = HybridConfig().to_dict()
    assert "la_window" not in off and "la_sinks" not in off and HybridConfig.from_dict(off) == HybridConfig()
    on = HybridConfig(la_window=64, la_sinks=4, fusion_init="fit")
    assert on.to_dict()["la_window"] == 64 and HybridConfig.from_dict(on.to_dict()) == on
