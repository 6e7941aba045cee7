"""The typed run config, as a user meets it: recipes and --config overrides converted once into validated frozen
dataclasses, refused with the key and the fix before any work; the stage table; presets and list overrides;
probe lengths and the tokenizer checked against the model; the resume fingerprint; the cluster defaults."""

import ast
import dataclasses
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
from train_helpers import ROOT, run_train, tiny_config

from hydrahead_jax.config import ConfigError, ModelConfig
from hydrahead_jax.run_config import STAGE_NAMES, STAGES, RunConfig, section_fields
from hydrahead_jax.selection import SelectionConfig, SelectionError
from hydrahead_jax.selection.select import check_probe_scores, combine_scores, validate_config
from hydrahead_jax.training import checkpoint, steps


def _recipe(name, arg=None):
    module = __import__(f"configs.{name}", fromlist=["get_config"])
    return module.get_config(arg)


# ------------------------------------------------------------------------------------------------ conversion


@pytest.mark.parametrize(
    "name, arg",
    [
        ("tiny", None),
        ("smollm2_hydrahead", None),
        ("smollm2_hydrahead", "layerwise_3to1"),
        ("smollm2_hydrahead", "streaming64"),
        ("smollm2_hydrahead", "streaming64+yarn4"),
        ("qwen3_1p7b_hydrahead", "7to1"),
    ],
)
def test_every_recipe_converts_to_a_frozen_validated_run_config(name, arg):
    run = RunConfig.from_recipe(_recipe(name, arg))
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.stage1.lr = 1.0
    # to_dict keeps the recipe's shape (the export's train_config.json is read by the evaluation)
    resolved = run.to_dict()
    assert set(resolved) == set(section_fields(()))
    for stage in STAGES:
        assert set(resolved[stage.config_key]) == set(section_fields((stage.config_key,)))
    json.dumps(resolved)  # plain data


def test_joined_variants_apply_each_part():
    joined, streaming = _recipe("smollm2_hydrahead", "streaming64+yarn4"), _recipe("smollm2_hydrahead", "streaming64")
    assert joined.stage3.rope_scaling == "yarn:4" and streaming.stage3.rope_scaling != "yarn:4"
    joined.stage3.rope_scaling = streaming.stage3.rope_scaling
    assert joined.to_dict() == streaming.to_dict()
    with pytest.raises(ValueError, match="unknown variant 'yarn5'"):
        _recipe("smollm2_hydrahead", "streaming64+yarn5")


def test_recipe_values_survive_the_conversion_unchanged():
    c = _recipe("smollm2_hydrahead")
    run = RunConfig.from_recipe(c)
    for stage in STAGES:
        assert dataclasses.asdict(run.stage(stage)) == c[stage.config_key].to_dict()
    assert run.selection.settings == SelectionConfig(method="combined", ratio="7:1", allocation="global")
    assert run.data.source == "enwiki" and run.teacher.source == "smollm2-135m" and run.teacher.model is None


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: setattr(c.stage2, "lr", -1.0),
            "config.stage2.lr=-1.0: must be a finite number > 0. Fix: --config.stage2.lr=1e-4.",
        ),
        (
            lambda c: setattr(c.stage1, "train", "some"),
            "config.stage1.train='some': choose one of ('new', 'all', 'new+la_qkv', 'new+la_qkvo')",
        ),
        (lambda c: setattr(c.mesh, "fsdp", 0), "config.mesh.fsdp=0: must be -1 (fill) or >= 1"),
        (lambda c: setattr(c.data, "txt_split", "lines"), "config.data.txt_split='lines'"),
        (lambda c: setattr(c.hybrid, "gdn_chunk_size", 24), "config.hybrid: HybridConfig.gdn_chunk_size=24"),
        (lambda c: setattr(c.selection, "method", "best"), "config.selection.method='best'"),
        (lambda c: setattr(c.stage3, "synthetic_rate", 0.2), "config.stage3.synthetic_rate=0.2: synthetic retrieval"),
        (lambda c: setattr(c.stage3, "ce_weight", 0.0), "config.stage3: ce_weight and kl_weight are both 0"),
        (lambda c: setattr(c.data, "source", "enwiki"), "a random teacher has none. Fix: --config.data.source=copy"),
        (lambda c: setattr(c.teacher.model, "num_kv_heads", 3), "config.teacher.model: ModelConfig.num_heads=4"),
    ],
)
def test_bad_values_are_refused_naming_the_key_and_the_fix(edit, message):
    c = tiny_config()
    edit(c)
    with pytest.raises(ConfigError) as err:
        RunConfig.from_recipe(c)
    assert message in str(err.value)


def test_wrong_types_and_unknown_keys_are_refused():
    raw = tiny_config().to_dict()
    raw["stage1"]["remat"] = "yes"
    with pytest.raises(ConfigError, match=r"config\.stage1\.remat='yes': expected True or False"):
        RunConfig.from_recipe(raw)
    raw = tiny_config().to_dict()
    raw["stage2"]["learning_rate"] = 1.0
    with pytest.raises(ConfigError, match=r"unknown config key 'stage2\.learning_rate'.*'lr'"):
        RunConfig.from_recipe(raw)


def test_train_py_refuses_an_unknown_section_with_the_valid_keys(tmp_path):
    proc = run_train(tmp_path / "w", "--config.optimizer.lr=1")
    assert proc.returncode == 2
    assert "unknown config key 'optimizer.lr'" in proc.stderr and "'stage2'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------------------ stage table


def test_one_stage_table():
    assert STAGE_NAMES == ("select", "align", "distil", "long")
    assert [(s.config_key, s.directory) for s in STAGES] == [
        ("stage1", "stage1_align"),
        ("stage2", "stage2_distil"),
        ("stage3", "stage3_long"),
    ]
    assert steps.STAGE_KINDS == tuple(s.loss for s in STAGES)
    # the recipe's default trainable parameters come from the table
    c = tiny_config().to_dict()
    del c["stage2"]["train"]
    with pytest.raises(ConfigError, match=r"config\.stage2: .*train"):
        RunConfig.from_recipe(c)
    from configs.common import base

    assert [base()[s.config_key].train for s in STAGES] == [s.default_train for s in STAGES]


# ------------------------------------------------------------------------------------------------ presets


def test_paper_preset_gives_paper_settings_unless_a_field_is_set():
    paper = SelectionConfig.paper()
    run = RunConfig.from_recipe(_recipe("qwen3_1p7b_hydrahead", "7to1"))
    assert run.selection.preset == "paper"
    assert run.selection.settings == dataclasses.replace(paper, method="combined", ratio="7:1", allocation="per_layer")
    c = _recipe("qwen3_1p7b_hydrahead", "7to1")
    c.selection.niah_lengths = (256, 512)
    c.selection.ablation_length = 1024
    settings = RunConfig.from_recipe(c).selection.settings
    assert settings.niah_lengths == (256, 512) and settings.ablation_length == 1024
    assert (settings.niah_prompts, settings.ablation_scope) == (paper.niah_prompts, paper.ablation_scope)
    # the demo preset keeps the demo defaults
    assert RunConfig.from_recipe(_recipe("smollm2_hydrahead")).selection.settings.niah_lengths == (256, 512)


@pytest.mark.parametrize(
    "given, expected",
    [("1024,2048", (1024, 2048)), (("1024,2048",), (1024, 2048)), (4096, (4096,)), ([512, 1024], (512, 1024))],
)
def test_list_settings_take_comma_separated_values(given, expected):
    assert SelectionConfig.from_any({"niah_lengths": given}).niah_lengths == expected
    with pytest.raises(SelectionError, match=r"selection\.niah_lengths='1k,2k': expected a comma-separated list"):
        SelectionConfig.from_any({"niah_lengths": "1k,2k"})


def test_list_overrides_and_the_paper_preset_from_the_command_line(tmp_path):
    proc = run_train(
        tmp_path,
        "--until_stage=select",
        "--config.selection.preset=paper",
        "--config.selection.niah_lengths=256,1024",
        "--config.selection.niah_needle_types=number,uuid",
        "--config.selection.niah_depths=0.5",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recorded = json.loads((tmp_path / "run_config.json").read_text())["config"]["selection"]
    assert recorded["niah_lengths"] == [256, 1024]
    assert recorded["niah_needle_types"] == ["number", "uuid"] and recorded["niah_depths"] == [0.5]
    assert recorded["niah_prompts"] == SelectionConfig.paper().niah_prompts  # unset: the preset's value
    assert recorded["method"] == "layerwise"  # set by configs/tiny.py


# ------------------------------------------------------------------------------------------------ probes, tokenizer


@pytest.fixture(scope="module")
def smol_tokenizer():
    from hydrahead_jax.models.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _smol_cfg(**kw):
    return ModelConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    ).replace(max_position_embeddings=8192, **kw)


def test_probe_lengths_too_short_for_their_task_are_refused_at_validation(smol_tokenizer):
    short = SelectionConfig(method="combined", ratio="1:1", ablation_length=128)
    with pytest.raises(SelectionError, match=r"selection\.ablation_length=128: kv_retrieval: length=128 is too short"):
        validate_config(short, _smol_cfg(), smol_tokenizer)
    validate_config(dataclasses.replace(short, ablation_length=160), _smol_cfg(), smol_tokenizer)  # the demo value
    with pytest.raises(SelectionError, match=r"selection\.niah_lengths=64,512: niah_single: length=64 is too short"):
        validate_config(
            dataclasses.replace(short, method="retrieval", niah_lengths=(64, 512)), _smol_cfg(), smol_tokenizer
        )


@pytest.mark.slow
def test_train_py_refuses_a_too_short_probe_before_any_work(tmp_path):
    proc = run_train(tmp_path, "--config.selection.ablation_length=128", config="smollm2_hydrahead.py", timeout=900)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "kv_retrieval: length=128 is too short" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "selection").exists() and not (tmp_path / "head_map.json").exists()


def test_a_tokenizer_beyond_the_model_vocabulary_is_refused_before_any_work(tmp_path):
    from test_eval import random_model, tiny_cfg

    from hydrahead_jax.data import CorpusError, check_tokenizer
    from hydrahead_jax.data.protocol import TokenizerModelMismatchError
    from hydrahead_jax.data.tiny_tokenizer import train_bpe_tokenizer
    from hydrahead_jax.models.loaders import save_hf_folder
    from hydrahead_jax.training.pipeline import run_pipeline

    tok = train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog " * 40], vocab_size=300)
    assert tok.vocab_size > 257
    check_tokenizer(tok, tok.vocab_size)  # exactly enough rows
    with pytest.raises(TokenizerModelMismatchError, match=f"ids up to {tok.vocab_size - 1}.*only 257 embedding rows"):
        check_tokenizer(tok, 257)
    folder = save_hf_folder(random_model(tiny_cfg(257), 0), tok, tmp_path / "teacher" / "short-vocab")
    recipe = tiny_config().to_dict()
    recipe["teacher"].update(source=str(folder), model={})
    for stage in ("stage1", "stage2", "stage3"):
        recipe[stage]["batch_size"] = 8  # splits over the 8 simulated devices (checked before the teacher loads)
    with pytest.raises(TokenizerModelMismatchError, match="only 257 embedding rows"):
        run_pipeline(RunConfig.from_recipe(recipe), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before the head map, before the workdir was touched

    # a matching tokenizer passes; a corpus that is not there is the next thing refused, still before any work
    folder = save_hf_folder(random_model(tiny_cfg(tok.vocab_size), 0), tok, tmp_path / "teacher" / "full-vocab")
    recipe["teacher"]["source"] = str(folder)
    recipe["data"]["source"] = str(tmp_path / "no-such-corpus")
    with pytest.raises(CorpusError, match=r"config\.data\.source: corpus source .*no-such-corpus does not exist"):
        run_pipeline(RunConfig.from_recipe(recipe), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_nan_probe_scores_are_an_error_naming_the_probe():
    scores = np.arange(8.0).reshape(2, 4)
    np.testing.assert_array_equal(check_probe_scores("retrieval", scores), scores)
    broken = scores.copy()
    broken[1, 2] = np.nan
    # Without the check, rank normalisation turns the NaN into an ordinary rank: a plausible-looking selection.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert np.isfinite(combine_scores(scores, broken)).all()
    with pytest.raises(SelectionError, match=r"the ablation probe produced 1 non-finite score.*\[\(1, 2\)\]"):
        check_probe_scores("ablation", broken)


# ------------------------------------------------------------------------------------------------ resume keys


def test_resume_safe_keys_name_real_fields():
    resolved = RunConfig.from_recipe(tiny_config()).to_dict()
    assert set(checkpoint.RESUME_SAFE_KEYS) <= set(resolved)
    for section, keys in checkpoint.RESUME_SAFE_SECTION_KEYS.items():
        assert set(keys) <= set(resolved[section]), section


def test_fingerprint_ignores_mounts_and_loader_threads_but_not_the_math(tmp_path):
    def run(**edits):
        c = _recipe("qwen3_1p7b_hydrahead", "7to1")
        c.teacher.source = "/mnt/a/Qwen3-1.7B"
        for key, value in edits.items():
            section, field = key.split("__")
            c[section][field] = value
        return RunConfig.from_recipe(c)

    qwen = _smol_cfg(name="qwen3-like")
    checkpoint.check_workdir_config(tmp_path, run(), qwen, force_new=False)
    # a restart with the teacher mounted elsewhere, more loader threads, another mesh: the same run
    moved = run(teacher__source="/gcs/other/Qwen3-1.7B", data__num_threads=32, data__prefetch=4, mesh__fsdp=4)
    checkpoint.check_workdir_config(tmp_path, moved, qwen, force_new=False)
    # a stage's lr and budget continue the run (checkpoint.CONTINUABLE_STAGE_KEYS)
    checkpoint.check_workdir_config(tmp_path, run(stage3__lr=2e-5, stage2__tokens=10**9), qwen, force_new=False)
    for changed, model in [
        (run(stage3__weight_decay=0.5), qwen),  # optimizer
        (run(stage2__seq_len=512), qwen),  # data shape
        (run(data__source="/data/other"), qwen),  # data content
        (run(selection__ratio="3:1"), qwen),  # head map
        (run(), qwen.replace(num_layers=3)),  # the teacher itself
    ]:
        with pytest.raises(checkpoint.ConfigMismatchError):
            checkpoint.check_workdir_config(tmp_path, changed, model, force_new=False)


def test_fingerprint_identifies_the_corpus_by_content_not_by_its_mount(tmp_path):
    """The pipeline passes the token store's content address: the same corpus read from another path is the same
    run; other content under the same path is another run."""
    c = _recipe("smollm2_hydrahead", None)
    teacher = _smol_cfg()
    c.data.source = "/mnt/a/corpus.jsonl"
    first = RunConfig.from_recipe(c)
    checkpoint.check_workdir_config(tmp_path, first, teacher, force_new=False, data_digest="0123abcd-ffff")
    c.data.source = "/gcs/b/corpus.jsonl"
    moved = RunConfig.from_recipe(c)
    checkpoint.check_workdir_config(tmp_path, moved, teacher, force_new=False, data_digest="0123abcd-ffff")
    with pytest.raises(checkpoint.ConfigMismatchError, match="content:"):
        checkpoint.check_workdir_config(tmp_path, moved, teacher, force_new=False, data_digest="9999eeee-ffff")


# ------------------------------------------------------------------------------------------------ cluster defaults


def test_the_qwen3_recipe_fails_in_one_line_on_one_machine(tmp_path):
    proc = run_train(tmp_path / "a", config="qwen3_1p7b_hydrahead.py:7to1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "config.distributed=True, but no cluster to join was found" in proc.stderr
    assert "--config.distributed=False" in proc.stderr
    proc = run_train(tmp_path / "b", "--config.distributed=False", config="qwen3_1p7b_hydrahead.py:7to1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "config.mesh (data=-1 x fsdp=8 x tensor=1) needs a multiple of 8 devices, but 1 are visible" in proc.stderr
    assert not (tmp_path / "b").exists()  # before the (absent) teacher was looked for


# ------------------------------------------------------------------------------------------------ module layout


def test_loading_a_model_needs_no_training_code():
    code = (
        "import sys; import hydrahead_jax.export, hydrahead_jax.evaluation, hydrahead_jax.evaluation.models; "
        "from hydrahead_jax import load_hydrahead; "
        "bad = sorted(m for m in sys.modules if m.startswith('hydrahead_jax.training')); "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_the_data_modules_import_each_other_without_a_cycle():
    package = ROOT / "hydrahead_jax" / "data"
    graph = {}
    for path in package.glob("*.py"):
        imports = set()
        for node in ast.walk(ast.parse(path.read_text())):  # function-level imports count too
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hydrahead_jax.data."):
                imports.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = imports - {"__init__"}
    assert "rows" in graph["mixture"] and "mixture" in graph["pipeline"] and "rows" in graph["pipeline"]

    def reaches(start, target, seen=()):
        return any(n == target or (n not in seen and reaches(n, target, seen + (n,))) for n in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []


# ------------------------------------------------------------------------------------------------ schedules, groups
@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: setattr(c.stage1, "warmup_fraction", 1.0), "config.stage1.warmup_fraction=1.0: must be in [0, 1)"),
        (lambda c: setattr(c.stage2, "warmup_start_ratio", 2.0), "Fix: --config.stage2.warmup_start_ratio=0.1"),
        (lambda c: setattr(c.stage2, "lr_scale_other", -1.0), "(0 freezes). Fix: --config.stage2.lr_scale_other=1.0"),
        (lambda c: setattr(c.stage1, "align_target", "head"), "choose one of ('layer', 'heads')"),
    ],
)
def test_bad_schedule_and_group_settings_name_the_fix(edit, message):
    c = tiny_config()
    edit(c)
    with pytest.raises(ConfigError) as err:
        RunConfig.from_recipe(c)
    assert message in str(err.value)


def test_warmup_is_a_fraction_of_the_steps_and_starts_above_zero():
    c = tiny_config()
    c.stage2.steps, c.stage2.warmup_fraction, c.stage2.warmup_start_ratio, c.stage2.lr = 40, 0.1, 0.25, 1e-3
    scfg = RunConfig.from_recipe(c).stage(STAGES[1])
    assert scfg.warmup == 4  # 10 % of 40 steps, whatever warmup_steps says
    _, schedule = steps.stage_optimizer(scfg, scfg.total_steps)
    # linear from lr·0.25 at step 0 to lr at step 4: 2.5e-4, 4.375e-4, ..., 1e-3
    # (the schedule computes in float32: measured relative error 1.6e-7)
    np.testing.assert_allclose(
        [float(schedule(i)) for i in range(5)], [2.5e-4, 4.375e-4, 6.25e-4, 8.125e-4, 1e-3], rtol=1e-6
    )


def test_per_group_learning_rates_equal_one_adamw_per_group():
    import jax
    import jax.numpy as jnp
    import optax

    from hydrahead_jax.hybrid.build import param_group

    params = {
        "layers": {"0": {"self_attn": {"q_proj": {"kernel": jnp.ones((3, 2))}, "gdn": {"dt_bias": jnp.ones(2)}}}},
        "embed_tokens": {"embedding": jnp.ones((4, 2))},
    }
    grads = jax.tree.map(lambda p: jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape) - 1.5, params)
    scales = {"new": 1.0, "attention": 0.1, "other": 0.5}
    tx, schedule = steps.make_optimizer(
        lr=1e-2, warmup_steps=0, total_steps=10, clip_norm=0, weight_decay=0.1, lr_scales=scales
    )
    state = tx.init(params)
    for i in range(2):
        updates, state = tx.update(grads, state, params, learning_rate=schedule(i))
    got = dict(jax.tree_util.tree_leaves_with_path(updates))
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        group = param_group(path)
        # the reference: AdamW of that group alone at lr · scale (the cosine schedule, scaled)
        ref_schedule = optax.cosine_decay_schedule(1e-2 * scales[group], 10, alpha=0.1)
        ref = optax.adamw(ref_schedule, b1=0.9, b2=0.95, weight_decay=0.1)
        g = jax.tree_util.tree_leaves_with_path(grads)
        g = dict(g)[path]
        ref_state = ref.init(p)
        for _ in range(2):
            want, ref_state = ref.update(g, ref_state, p)
        np.testing.assert_allclose(got[path], want, rtol=1e-6)
    assert {param_group(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)} == {"new", "attention", "other"}


def test_the_step_takes_its_learning_rate_so_rates_and_budgets_share_one_program():
    """The learning rate is an argument of the compiled step: stages that differ in lr, warm-up and budget lower
    to the same program (the persistent compilation cache's key), while a change to Adam itself (β2) changes it.
    Three steps given schedule(i) land where optax.adamw with the schedule inside the step lands."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from hydrahead_jax.models import Transformer
    from hydrahead_jax.training.steps import LossSettings, compute_loss, make_train_step

    cfg = ModelConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
    )
    graphdef, params, frozen = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params, frozen = nnx.as_pure(params), nnx.as_pure(frozen)
    settings = LossSettings(kind="long", chunk=16)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.ones((2, 16), jnp.float32)}

    def program(**optimizer):
        tx, schedule = steps.make_optimizer(**optimizer)
        step = jax.jit(make_train_step(graphdef, None, tx, settings))
        state = {"params": params, "frozen": frozen, "opt_state": tx.init(params), "step": jnp.int32(0)}
        return step, state, schedule, step.lower(state, None, batch, schedule(0)).as_text()

    step, state, schedule, text = program(lr=1e-3, warmup_steps=2, total_steps=10)
    assert program(lr=5e-4, warmup_steps=5, total_steps=40)[3] == text
    assert program(lr=1e-3, warmup_steps=2, total_steps=10, b2=0.99)[3] != text

    reference = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95))
    theta, opt = params, reference.init(params)
    # the optimizer state has the reference's structure: states saved with the schedule inside the step restore
    assert jax.tree.structure(state["opt_state"]) == jax.tree.structure(opt)
    loss = jax.jit(jax.grad(lambda p: compute_loss(nnx.merge(graphdef, p, frozen), None, batch, settings)[0]))
    for i in range(3):
        state, metrics = step(state, None, batch, schedule(i))
        assert float(metrics["lr"]) == float(schedule(i))
        updates, opt = reference.update(loss(theta), opt, theta)
        theta = optax.apply_updates(theta, updates)
    # The two programs round the gradient differently: measured at most 4.7e-9 apart after three steps of ~1e-3
    # (one entry of 1,024, where Adam's 1/√v is largest); a step given the next step's rate moves entries by up to 1e-3.
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(theta), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-8)


def test_a_group_at_scale_zero_is_frozen():
    from flax import nnx

    from hydrahead_jax.hybrid import HeadMap, build_model
    from hydrahead_jax.hybrid.build import trainable_filter

    cfg = tiny_config()
    model_cfg = RunConfig.from_recipe(cfg).teacher.model
    model = build_model(model_cfg, HeadMap.from_fa_groups(model_cfg, [[0]] * model_cfg.num_layers, method="test"))
    trained = [p for p, _ in nnx.to_flat_state(nnx.state(model, trainable_filter("all", {"other": 0.0})))]
    assert trained and all("self_attn" in p for p in trained)  # attention and the new GDN/fusion parameters
    assert any("gdn" in p for p in trained) and any("q_proj" in p for p in trained)
    assert not any("mlp" in p or "embed_tokens" in p for p in trained)


@pytest.mark.parametrize("train", ["new+la_qkv", pytest.param("new+la_qkvo", marks=pytest.mark.slow)])
def test_la_slices_of_the_shared_projections_train_and_the_fa_groups_stay_the_teachers(train):
    """Stage 1 with the LA groups' q/k/v (and o) slices trainable, through the real train step with AdamW and
    weight decay (a mask on the gradient alone would let the decay move the FA slices): after three steps every
    kept FA group's q/k/v/o entries and biases are bit-identical to the teacher's — found through the head map's
    original group indices, not the stored order — while each LA group's entries of the trained projections moved;
    q/k norms and everything else not in the filter are untouched. Layers of every kind: f = 2, 1, 0 and 4 of 4."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_student
    from hydrahead_jax.hybrid.build import fa_slice_mask, trainable_filter
    from hydrahead_jax.models import Transformer
    from hydrahead_jax.training.steps import LossSettings, make_train_step

    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=8, num_kv_heads=4,
        head_dim=8, attention_bias=True,
    )  # fmt: skip
    teacher = Transformer(cfg, rngs=nnx.Rngs(0))
    head_map = HeadMap.from_fa_groups(cfg, [[0, 2], [3], [], [0, 1, 2, 3]], method="test")
    student = build_student(teacher, head_map, HybridConfig(gdn_chunk_size=16), rngs=nnx.Rngs(1))
    graphdef, params, frozen = nnx.split(student, trainable_filter(train), ...)
    tx, schedule = steps.make_optimizer(
        lr=1e-2, warmup_steps=0, total_steps=10, weight_decay=0.1,
        update_mask=fa_slice_mask(train, head_map.fa_counts(), cfg.num_kv_heads),
    )  # fmt: skip
    t_graphdef, t_state = nnx.split(teacher)
    step = jax.jit(make_train_step(graphdef, t_graphdef, tx, LossSettings(kind="align", chunk=16)))
    params = nnx.as_pure(params)
    state = {"params": params, "frozen": nnx.as_pure(frozen), "opt_state": tx.init(params), "step": 0}
    rng = np.random.default_rng(0)
    for i in range(3):
        ids = jnp.asarray(rng.integers(0, 64, (2, 32)), jnp.int32)
        batch = {"input_ids": ids, "targets": jnp.roll(ids, -1, axis=1), "loss_mask": jnp.ones((2, 32), jnp.float32)}
        state, _ = step(state, nnx.as_pure(t_state), batch, schedule(i))

    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.as_pure(nnx.state(student)))}
    after = dict(nnx.to_flat_state(nnx.as_pure(nnx.state(student))))
    after.update({k: v for k, v in nnx.to_flat_state(nnx.State(state["params"]))})
    after = {k: np.asarray(v) for k, v in after.items()}
    t_layers = nnx.as_pure(nnx.state(teacher))["layers"]["self_attn"]
    trained = {"q_proj", "k_proj", "v_proj"} | ({"o_proj"} if train.endswith("o") else set())
    G, D = cfg.group_size, cfg.head_dim
    for proj, width in [("q_proj", G * D), ("k_proj", D), ("v_proj", D), ("o_proj", G * D)]:
        for leaf in ("kernel", "bias") if proj != "o_proj" else ("kernel",):
            path = ("layers", "self_attn", proj, leaf)
            for layer, fa in enumerate(head_map.fa_groups):
                order = student.group_order[layer]
                for stored, group in enumerate(order):
                    block = slice(stored * width, (stored + 1) * width)
                    orig = slice(group * width, (group + 1) * width)
                    lead = (slice(None),) * (leaf == "kernel" and proj != "o_proj")  # q/k/v kernels: columns
                    got = after[path][layer][lead + (block,)]
                    teacher_block = np.asarray(t_layers[proj][leaf])[layer][lead + (orig,)]
                    if group in fa:
                        np.testing.assert_array_equal(got, teacher_block, err_msg=f"{path} layer {layer} FA {group}")
                    elif proj in trained:
                        assert np.abs(got - teacher_block).max() > 1e-5, (path, layer, group)
                    else:
                        np.testing.assert_array_equal(got, teacher_block)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed, "nothing trained"
    assert all(("gdn" in k or "fusion" in k or set(k) & trained) for k in changed), changed
    assert not any("q_norm" in k or "k_norm" in k or "mlp" in k for k in changed)
