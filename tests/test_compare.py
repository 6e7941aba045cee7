"""The comparison command (hydrahead_jax.experiments.compare): variants refused before training, head maps derived
from one probe's scores, the Pareto front and group statistics against hand computations, stage times that survive a
SIGKILL, and the tiny recipe end to end in a subprocess (one CPU device): killed mid-run, resumed, then rerun with
every variant skipped."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from train_helpers import ROOT, single_device_env

from hydrahead_jax.config import ConfigError
from hydrahead_jax.experiments.compare import (
    StageTimings,
    derive_head_map,
    load_variants,
    run_comparison,
    select_variants,
)
from hydrahead_jax.experiments.report import pareto_front, render_markdown, summary_rows


def _tiny_comparison(*variants):
    from configs import compare_tiny

    c = compare_tiny.get_config()
    if variants:
        c.variants = list(variants)
    return c


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "variants, message",
    [
        (
            [{"name": "a", "overrides": {"hybrid.no_such_field": 1}}],
            "variant 'a': unknown config key 'hybrid.no_such_field'",
        ),
        ([{"name": "b", "overrides": {"nosection.x": 1}}], "variant 'b': unknown config key 'nosection.x'"),
        ([{"name": "c", "overrides": {"stage2.lr": -1.0}}], "variant 'c': config.stage2.lr=-1.0: must be a finite"),
        ([{"name": "d", "overrides": {"hybrid.fusion": "sideways"}}], "variant 'd': config.hybrid"),
        ([{"name": "e", "overrides": {}}, {"name": "e", "overrides": {}}], "variant name 'e' appears twice"),
        ([{"name": "f", "overrides": {"stage1.steps": 50}}], "variant 'f': the override 'stage1.steps' would change"),
        ([{"name": "g", "overrides": {"data.copy_repeats": 2}}], "variant 'g': the override 'data.copy_repeats'"),
        ([{"name": "h/x", "overrides": {}}], "variant name 'h/x'"),
    ],
)
def test_bad_variant_is_refused_with_its_name(variants, message):
    with pytest.raises(ConfigError) as err:
        load_variants(_tiny_comparison(*variants))
    assert message in str(err.value)


@pytest.mark.parametrize("name", ["compare_tiny", "compare_smollm2", "compare_recipe_smollm2", "compare_demo_smollm2"])
def test_every_shipped_comparison_resolves_before_any_work(name):
    """Each comparison recipe in configs/ validates as a new user's command would (every variant's overrides, the
    evaluation settings) without loading a teacher."""
    from hydrahead_jax.experiments.compare import eval_settings

    config = __import__(f"configs.{name}", fromlist=["get_config"]).get_config()
    variants = load_variants(config)
    assert len({v.name for v in variants}) == len(variants) >= 2
    eval_settings(config.get("eval"))


@pytest.mark.parametrize(
    "name, results",
    [
        ("compare_smollm2", "compare_smollm2"),
        ("compare_recipe_smollm2", "compare_recipe_smollm2"),
        ("compare_recipe_smollm2", "compare_recipe_smollm2_order0"),
        ("compare_recipe_smollm2", "compare_recipe_smollm2_order1"),
        ("compare_demo_smollm2", "compare_demo_smollm2"),
    ],
)
def test_each_committed_comparison_is_what_its_config_still_trains(name, results):
    """bench/results' comparisons stay reproducible by their documented command when the library's recipes move
    on: the base run each results.json recorded is the base its comparison config gives today."""
    from hydrahead_jax.experiments.compare import comparison_base
    from hydrahead_jax.training.checkpoint import _flat

    recorded = json.loads((ROOT / "bench" / "results" / results / "results.json").read_text())["base"]
    config = __import__(f"configs.{name}", fromlist=["get_config"]).get_config()
    config.base.seed = recorded["seed"]
    current = _flat(json.loads(json.dumps(comparison_base(config).to_dict())))
    # settings added since the file was written count as unchanged: it cannot have recorded them
    differ = {
        k: (v, current.get(k, "<no longer a setting>")) for k, v in _flat(recorded).items() if current.get(k) != v
    }
    assert differ == {}


def test_the_demo_comparisons_adopted_variant_is_exactly_what_make_demo_trains():
    """configs/compare_demo_smollm2.py decided what `make demo` adopted: its ADOPTED variant must be the Makefile's
    DEMO_CONFIG recipe at its own steps (budget_scale 1), differing only in the progress display; warm-up compared
    as the steps it resolves to (warmup_steps is unused once warmup_fraction is set)."""
    import dataclasses
    import re

    from configs import compare_demo_smollm2, smollm2_hydrahead
    from hydrahead_jax.run_config import STAGES, RunConfig

    def schedule(run):
        stages = {s.config_key: getattr(run, s.config_key) for s in STAGES}
        return dataclasses.replace(
            run, **{key: dataclasses.replace(st, warmup_steps=st.warmup) for key, st in stages.items()}
        )

    make_demo = re.search(
        r"^DEMO_CONFIG \?= configs/smollm2_hydrahead.py:(\w+)$", (ROOT / "Makefile").read_text(), re.M
    )
    recipe = smollm2_hydrahead.get_config(make_demo.group(1))
    recipe.logging.progress = False
    variants = {v.name: v for v in load_variants(compare_demo_smollm2.get_config())}
    assert schedule(variants[compare_demo_smollm2.ADOPTED].run) == schedule(RunConfig.from_recipe(recipe))
    assert schedule(variants["demo"].run) != schedule(RunConfig.from_recipe(recipe))


def test_bad_variant_is_refused_before_any_training(tmp_path):
    """A ratio the tiny teacher's 2 KV groups per layer cannot meet per layer needs the teacher to be found bad:
    it is still refused before the first variant trains (no variant directory is made)."""
    config = _tiny_comparison(
        {"name": "fine", "overrides": {}},
        {
            "name": "bad_per_layer",
            "overrides": {"selection.method": "random", "selection.ratio": "3:1", "selection.allocation": "per_layer"},
        },
    )
    with pytest.raises(ConfigError, match=r"variant 'bad_per_layer': .*per_layer allocation can only meet"):
        run_comparison(config, tmp_path / "cmp")
    assert not (tmp_path / "cmp" / "variants").exists()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"suite": "niah,efficiency"}, "['efficiency'] cannot be compared here"),
        ({"suite": "niah,nonsense"}, "unknown suite 'nonsense'"),
        ({"lengths": "512,abc"}, "cannot read length 'abc'"),
        ({"data_rows": 0}, "config.eval.data_rows=0: must be an integer >= 1"),
        ({"depths": (0.5, 1.5)}, "config.eval.depths"),
        ({"sample": 2}, "unknown config key 'eval.sample'"),
    ],
)
def test_bad_eval_settings_are_refused(settings, message):
    from hydrahead_jax.experiments.compare import eval_settings

    with pytest.raises(ConfigError) as err:
        eval_settings(settings)
    assert message in str(err.value)
    parsed = eval_settings({"suite": "niah,passkey,ppl,agreement,niah", "lengths": "512,1k"})
    assert parsed.suite == ("niah", "passkey", "ppl", "agreement") and parsed.lengths == (512, 1024)


def test_only_selects_named_variants_in_recipe_order_and_refuses_unknown_names():
    variants = load_variants(_tiny_comparison())
    assert [v.name for v in select_variants(variants, ["random_3to1_s1", "layerwise_1to1"])] == [
        "layerwise_1to1",
        "random_3to1_s1",
    ]
    assert select_variants(variants, []) == variants
    with pytest.raises(ConfigError, match=r"--only names \['nope'\], which the comparison recipe does not list"):
        select_variants(variants, ["layerwise_1to1", "nope"])


def test_second_comparison_on_a_busy_workdir_is_refused(tmp_path):
    from hydrahead_jax.training.checkpoint import WorkdirError, WorkdirLock

    held = WorkdirLock(tmp_path / "cmp")
    held.acquire()
    try:
        with pytest.raises(WorkdirError, match="cmp"):
            run_comparison(_tiny_comparison(), tmp_path / "cmp")
    finally:
        held.release()
    assert not (tmp_path / "cmp" / "variants").exists()


# ------------------------------------------------------------------------------------------------ probe once


def test_head_maps_derived_from_one_probe_match_hand_selection():
    """Scores of a 2-layer × 2-group model: the top-k rule by hand for each method, ratio and allocation."""
    from configs import tiny
    from hydrahead_jax.config import ModelConfig
    from hydrahead_jax.hybrid import HeadMap
    from hydrahead_jax.selection.select import combine_scores

    cfg = ModelConfig.from_dict(tiny.get_config().teacher.model.to_dict())
    retrieval = np.array([[0.9, 0.1], [0.2, 0.8]])
    ablation = np.array([[0.1, 0.3], [0.9, 0.2]])
    combined = combine_scores(retrieval, ablation)
    # ranks/3: retrieval [[1, 0], [1/3, 2/3]], ablation [[0, 2/3], [1, 1/3]] → combined [[1/2, 1/3], [2/3, 1/2]]
    np.testing.assert_allclose(combined, [[0.5, 1 / 3], [2 / 3, 0.5]])
    scores = {"retrieval": retrieval.tolist(), "ablation": ablation.tolist(), "combined": combined.tolist()}
    probed = HeadMap.from_fa_groups(cfg, [[0], [1]], method="combined", target_ratio="1:1", scores=scores)
    expected = {
        ("retrieval", "3:1", "global"): [[0], []],  # the largest of 4 scores: 0.9 at (0, 0)
        ("ablation", "3:1", "global"): [[], [0]],  # 0.9 at (1, 0)
        ("combined", "3:1", "global"): [[], [0]],  # 2/3 at (1, 0)
        ("retrieval", "1:1", "per_layer"): [[0], [1]],
        ("ablation", "1:1", "per_layer"): [[1], [0]],
        ("combined", "1:1", "global"): [[0], [0]],  # 2/3 at (1, 0), then 1/2 at (0, 0) before (1, 1) on the tie
    }
    for (method, ratio, allocation), groups in expected.items():
        derived = derive_head_map(probed, method, ratio, allocation)
        assert derived.fa_groups == groups, (method, ratio, allocation)
        assert (derived.method, derived.target_ratio, derived.allocation) == (method, ratio, allocation)
        assert derived.scores == probed.scores  # the evidence travels with every derived map


def test_the_probe_runs_the_base_recipe_whichever_variants_reach_it_first(tmp_path, monkeypatch):
    """The recipe comparison's variants differ in hybrid and stage settings: the probe's stage 0 runs with the
    base recipe (method combined) whichever of them ``--only`` names first, so a probe killed under one subset
    resumes under another (its directory's config guard holds one config). The stage itself is replaced by a
    recorder (no teacher is loaded): what is checked is the config it is handed."""
    import dataclasses

    from model_shapes import SMOLLM2_135M

    import hydrahead_jax.training.pipeline as pipeline
    from configs import compare_recipe_smollm2
    from hydrahead_jax.experiments.compare import comparison_base, probe_once
    from hydrahead_jax.hybrid import HeadMap

    config = compare_recipe_smollm2.get_config()
    variants = {v.name: v for v in load_variants(config)}
    a, b = variants["fusion_la_scale"], variants["combined"]
    base = comparison_base(config)
    assert a.run != base and b.run != base and a.run.hybrid != b.run.hybrid
    handed = []

    def record_stage0(run, workdir, until_stage):
        handed.append(run)
        cfg = SMOLLM2_135M  # its 30 layers x 3 KV groups
        scores = np.arange(90.0).reshape(cfg.num_layers, cfg.num_kv_heads).tolist()
        HeadMap.from_fa_groups(
            cfg,
            [[0]] * cfg.num_layers,
            method="combined",
            target_ratio="2:1",
            scores={"retrieval": scores, "ablation": scores, "combined": scores},
        ).save(workdir / "head_map.json")

    monkeypatch.setattr(pipeline, "run_pipeline", record_stage0)
    for subset, workdir in (([b, a], tmp_path / "ba"), ([a, b], tmp_path / "ab")):
        assert sorted(probe_once(subset, workdir, base)) == ["combined", "fusion_la_scale"]
    settings = dataclasses.replace(base.selection.settings, method="combined")
    expected = dataclasses.replace(base, selection=dataclasses.replace(base.selection, settings=settings))
    assert handed == [expected, expected]


# ------------------------------------------------------------------------------------------------ report


def test_pareto_front_matches_hand_computation():
    xs = [64, 128, 128, 256, 64]
    kl = [0.5, 0.3, 0.4, 0.1, 0.6]  # lower better: 4 is beaten by 0, 2 by 1
    assert pareto_front(xs, kl, maximize=False) == [0, 1, 3]
    top1 = [0.2, 0.5, 0.5, 0.4, 0.2]  # higher better: ties stay on the front, 3 is beaten by 1 and 2
    assert pareto_front(xs, top1, maximize=True) == [0, 4, 1, 2]
    assert pareto_front([64, None, 32], [0.1, 0.0, None], maximize=False) == [0]


def test_groups_are_reported_as_mean_and_sample_spread():
    def variant(name, group, kl, top1):
        final = {"data": {"kl": kl, "top1": top1, "ppl": 2.0}, "fa_groups": 1, "kv_groups": 4, "kv_bytes_per_token": 64}
        return {
            "name": name,
            "group": group,
            "final": final,
            "at_init": {"data": {"kl": 2 * kl}},
            "stage_seconds": {"align": 1.0, "distil": 2.0},
            "stage_tokens": {"align": 10, "distil": 20},
        }

    rows = summary_rows(
        {"variants": [variant("r0", "r", 0.2, 0.5), variant("r1", "r", 0.4, 0.7), variant("x", "x", 1.0, 0.1)]}
    )
    r, x = rows
    assert (r["group"], r["n"], r["members"]) == ("r", 2, ["r0", "r1"])
    assert r["kl"][0] == pytest.approx(0.3) and r["kl"][1] == pytest.approx(math.sqrt(0.02))  # (0.1² + 0.1²) / 1
    assert r["init_kl"][0] == pytest.approx(0.6) and r["top1"][1] == pytest.approx(math.sqrt(0.02))
    assert r["seconds"] == (3.0, 0.0) and r["tokens"] == (30.0, 0.0)
    assert x["kl"] == (1.0, 0.0) and x["n"] == 1


def test_prune_checkpoints_deletes_steps_and_markers_only(tmp_path):
    from hydrahead_jax.experiments.compare import prune_checkpoints

    vdir = tmp_path / "v"
    stage = vdir / "stage1_align"
    for step in ("1", "25"):
        (stage / step / "model").mkdir(parents=True)
        (stage / step / "model" / "data").write_bytes(b"x" * 1000)
    (stage / "30.orbax-checkpoint-tmp").mkdir()
    (stage / "30.orbax-checkpoint-tmp" / "part").write_bytes(b"y" * 24)
    for name in ("DONE", "heldout.json", "memory.json"):
        (stage / name).write_text("{}")
    (vdir / "final").mkdir()
    (vdir / "final" / "params").write_bytes(b"z")
    (vdir / "stage2_distil").mkdir()  # a stage without checkpoints, and stage 3 missing: nothing to do
    assert prune_checkpoints(vdir) == 2 * 1000 + 24
    assert sorted(p.name for p in stage.iterdir()) == ["heldout.json", "memory.json"]
    assert (vdir / "final" / "params").read_bytes() == b"z"
    assert prune_checkpoints(vdir) == 0


# ------------------------------------------------------------------------------------------------ stage timings


def test_a_killed_stage_keeps_its_time_up_to_its_last_metrics_row(tmp_path):
    """A stage killed outright (SIGKILL: no way out) still counts: the next run adds its time from its start to the
    last row its process wrote, and a later run of the stage adds to that."""
    vdir = tmp_path / "variant"
    killed_run = f"""
import os, signal
from pathlib import Path
from hydrahead_jax.experiments.compare import StageTimings
timings = StageTimings(Path({str(vdir)!r}))
with timings.stage("stage1_align"):
    pass
with timings.stage("stage2_distil"):
    (Path({str(vdir)!r}) / "metrics.jsonl").write_text("{{}}\\n")
    os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", killed_run], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    recorded = json.loads((vdir / "timings.json").read_text())
    assert set(recorded) == {"stage1_align"}  # the killed stage wrote nothing on its way out
    marker = json.loads((vdir / "stage_running.json").read_text())
    assert marker["stage"] == "stage2_distil" and marker["seconds_before"] == 0.0
    # its last metrics row written 100 s after the stage started (set by hand): 100 s recovered, once
    os.utime(vdir / "metrics.jsonl", (marker["since"] + 100.0, marker["since"] + 100.0))
    timings = StageTimings(vdir)
    assert timings.seconds == {**recorded, "stage2_distil": 100.0}
    assert json.loads((vdir / "timings.json").read_text()) == timings.seconds
    assert not (vdir / "stage_running.json").exists()
    with timings.stage("stage2_distil"):
        pass
    assert 100.0 <= StageTimings(vdir).seconds["stage2_distil"] <= 100.1  # an empty stage: < 0.05 s, kept to 0.1 s


def test_a_stage_killed_after_writing_its_time_is_not_counted_twice(tmp_path):
    """Killed between adding its time and removing its marker: the stage holds more than the marker says it had
    before, so the marker adds nothing."""
    vdir = tmp_path / "variant"
    vdir.mkdir()
    (vdir / "timings.json").write_text(json.dumps({"stage2_distil": 12.0}))
    (vdir / "stage_running.json").write_text(
        json.dumps({"stage": "stage2_distil", "since": 1_000.0, "seconds_before": 5.0})
    )
    (vdir / "metrics.jsonl").write_text("{}\n")
    os.utime(vdir / "metrics.jsonl", (1_100.0, 1_100.0))
    assert StageTimings(vdir).seconds == {"stage2_distil": 12.0}
    assert not (vdir / "stage_running.json").exists()


# ------------------------------------------------------------------------------------------------ end to end


def _command(workdir, *extra):
    return [
        sys.executable,
        "-m",
        "hydrahead_jax.experiments.compare",
        "--config",
        str(ROOT / "configs" / "compare_tiny.py"),
        "--workdir",
        str(workdir),
        *extra,
    ]


def _run(workdir, kill_at=None, extra=()):
    """The comparison in a subprocess (``extra``: more command-line flags); with ``kill_at``, SIGKILLed as soon as
    a line containing it is printed. Returns (return code, output)."""
    env = dict(single_device_env(), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        _command(workdir, *extra),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if kill_at and kill_at in line:
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, "".join(lines)


def _mtimes(directory):
    return {str(p): p.stat().st_mtime_ns for p in directory.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """The tiny comparison killed in its second variant's distillation, resumed to the end, then run again."""
    workdir = tmp_path_factory.mktemp("compare") / "cmp"
    killed = _run(workdir, kill_at="2/3 random_3to1_s0: stage distil")
    resumed = _run(workdir)
    before = _mtimes(workdir / "variants")
    again = _run(workdir)
    return {"workdir": workdir, "killed": killed, "resumed": resumed, "again": again, "before": before}


@pytest.mark.slow
def test_killed_comparison_resumes_where_it_stopped(compared):
    code, out = compared["killed"]
    assert code == -signal.SIGKILL and "1/3 layerwise_1to1: done" in out, out[-2000:]
    code, out = compared["resumed"]
    assert code == 0, out[-3000:]
    assert "1/3 layerwise_1to1: finished earlier (eval.json matches), skipped" in out
    # the killed variant continues: its finished stages are not run again, the killed one and the rest are
    assert "random_3to1_s0: stage select" not in out and "random_3to1_s0: stage align" not in out
    assert "2/3 random_3to1_s0: stage distil" in out and "3/3 random_3to1_s1: stage align" in out


@pytest.mark.slow
def test_second_run_skips_every_finished_variant(compared):
    code, out = compared["again"]
    assert code == 0, out[-3000:]
    for k, name in enumerate(("layerwise_1to1", "random_3to1_s0", "random_3to1_s1"), 1):
        assert f"{k}/3 {name}: finished earlier (eval.json matches), skipped" in out
    assert ": stage " not in out
    assert _mtimes(compared["workdir"] / "variants") == compared["before"]  # nothing under variants/ rewritten


@pytest.mark.slow
def test_comparison_outputs(compared):
    workdir = compared["workdir"]
    for name in ("results.json", "report.md", "pareto.png", "loss_curves.png"):
        assert (workdir / name).stat().st_size > 0, name
    results = json.loads((workdir / "results.json").read_text())
    by_name = {v["name"]: v for v in results["variants"]}
    # KV bytes per token by hand: FA groups × 2 (K, V) × head_dim 8 × 4 bytes (f32), summed over layers.
    # layerwise 1:1 keeps one whole layer (2 groups); random 3:1 global keeps round(4 / 4) = 1 group.
    assert by_name["layerwise_1to1"]["final"]["fa_groups"] == 2
    assert by_name["layerwise_1to1"]["final"]["kv_bytes_per_token"] == 2 * 2 * 8 * 4
    for name in ("random_3to1_s0", "random_3to1_s1"):
        assert by_name[name]["final"]["fa_groups"] == 1
        assert by_name[name]["final"]["kv_bytes_per_token"] == 1 * 2 * 8 * 4
    assert results["teacher"]["kv_bytes_per_token"] == 4 * 2 * 8 * 4
    for v in results["variants"]:
        assert set(v["stage_seconds"]) == {"select", "align", "distil", "long"}
        assert v["stage_tokens"] == {"align": 2 * 4 * 32, "distil": 2 * 4 * 32, "long": 2 * 4 * 64}
        for when in ("at_init", "final"):
            data = v[when]["data"]
            assert 0 <= data["top1"] <= 1 and data["kl"] >= 0 and data["positions"] == 2 * 32
        assert set(v["curves"]) == {"stage1_align", "stage2_distil", "stage3_long"}
        # each stage's held-out start and end are its first and last held-out rows in metrics.jsonl
        rows = [json.loads(line) for line in (workdir / "variants" / v["name"] / "metrics.jsonl").open()]
        for stage, ends in v["heldout"].items():
            held = [r for r in rows if r["stage"] == stage and r.get("split") == "heldout"]
            assert ends["start"]["step"] == 0 and ends["end"]["step"] == max(r["step"] for r in held) == 2
            for end, row in (("start", held[0]), ("end", held[-1])):
                assert ends[end]["kl"] == row["kl"] and ends[end]["top1"] == row["top1"], (v["name"], stage, end)
        assert set(v["heldout"]) == set(v["curves"])
        # the finished variant's stage checkpoints are gone (keep_checkpoints=False); the rest stays
        vdir = workdir / "variants" / v["name"]
        for stage in v["heldout"]:
            assert sorted(p.name for p in (vdir / stage).iterdir()) == ["heldout.json", "memory.json"], stage
        assert (vdir / "final" / "MANIFEST.json").is_file() and (vdir / "eval.json").is_file()
    assert results["teacher"]["data"]["ppl"] > 1 and "kl" not in results["teacher"]["data"]
    # the random seeds are one row, mean ± sample spread of their two members
    row = next(r for r in results["summary"] if r["group"] == "random_3to1")
    kls = [by_name[n]["final"]["data"]["kl"] for n in ("random_3to1_s0", "random_3to1_s1")]
    assert row["n"] == 2 and row["kl"][0] == pytest.approx(np.mean(kls))
    assert row["kl"][1] == pytest.approx(np.std(kls, ddof=1))
    report = (workdir / "report.md").read_text()
    assert "| random_3to1 | 2 | 1 of 4 | 64 |" in report and "| layerwise_1to1 | 1 | 2 of 4 | 128 |" in report
    assert "the teacher has no tokenizer" in report  # what was skipped is said
    assert "## Held-out batch of each stage" in report


def _check_record_against_its_files(record, vdir):
    """A results.json record against what the variant's own files hold, read here: eval.json (final; its config
    hash), eval_init.json, head_map.json, the held-out rows of metrics.jsonl (the curves, in tokens) and each
    stage's heldout.json (first and last held-out row)."""
    final = json.loads((vdir / "eval.json").read_text())
    assert record["config_hash"] == final.pop("config_hash")
    assert record["final"] == final and record["at_init"] == json.loads((vdir / "eval_init.json").read_text())
    head_map = json.loads((vdir / "head_map.json").read_text())
    want = {"method": head_map["method"], "ratio": head_map["target_ratio"], "allocation": head_map["allocation"]}
    assert record["selection"] == want and want["method"] == record["name"].split("_")[0]
    rows = [json.loads(line) for line in (vdir / "metrics.jsonl").read_text().splitlines()]
    held = [r for r in rows if r.get("split") == "heldout"]
    assert record["curve_source"] == "heldout"
    assert record["curves"] == {
        stage: sorted([r["tokens_seen"], r["loss"]] for r in held if r["stage"] == stage)
        for stage in {r["stage"] for r in held}
    }
    for stage, ends in record["heldout"].items():
        stage_rows = [{k: v for k, v in r.items() if k not in ("stage", "split")} for r in held if r["stage"] == stage]
        assert ends == {"start": stage_rows[0], "end": stage_rows[-1]}, stage


@pytest.mark.slow
def test_report_only_reports_the_finished_variants_and_lists_the_rest(compared, tmp_path):
    from configs import compare_tiny
    from hydrahead_jax.experiments.compare import report_finished

    workdir = tmp_path / "cmp"
    shutil.copytree(compared["workdir"], workdir)
    (workdir / "variants" / "random_3to1_s1" / "eval.json").unlink()  # as if it were still training
    full = json.loads((compared["workdir"] / "results.json").read_text())
    before = _mtimes(workdir / "variants")
    results = report_finished(compare_tiny.get_config(), workdir)
    assert results["unfinished"] == ["random_3to1_s1"]
    assert [v["name"] for v in results["variants"]] == ["layerwise_1to1", "random_3to1_s0"]
    by_name = {v["name"]: v for v in full["variants"]}
    for v in results["variants"]:  # the same records the full comparison wrote, but the timings (one more run)
        _check_record_against_its_files(v, workdir / "variants" / v["name"])
        same = {k: x for k, x in by_name[v["name"]].items() if k != "stage_seconds"}
        assert json.loads(json.dumps({k: x for k, x in v.items() if k != "stage_seconds"})) == same
    assert "not finished yet, so not in this report: random_3to1_s1" in (workdir / "report.md").read_text()
    assert _mtimes(workdir / "variants") == before  # nothing trained or evaluated
    with pytest.raises(ConfigError, match="no teacher/eval.json"):
        report_finished(compare_tiny.get_config(), tmp_path / "empty")


@pytest.mark.slow
def test_only_runs_the_named_variants_and_reports_the_whole_recipe(compared, tmp_path):
    """``--only`` on a finished workdir: only the named variant is visited (and skipped, being finished), the
    report still covers every variant finished there; ``--merge`` without ``--report_only`` is refused."""
    workdir = tmp_path / "cmp"
    shutil.copytree(compared["workdir"], workdir)
    before = _mtimes(workdir / "variants")
    code, out = _run(workdir, extra=("--only", "random_3to1_s1"))
    assert code == 0, out
    assert "1 variants in" in out and ": random_3to1_s1" in out and "layerwise_1to1: finished earlier" not in out
    assert "1/1 random_3to1_s1: finished earlier" in out
    results = json.loads((workdir / "results.json").read_text())
    assert [v["name"] for v in results["variants"]] == ["layerwise_1to1", "random_3to1_s0", "random_3to1_s1"]
    assert results["unfinished"] == []
    assert _mtimes(workdir / "variants") == before
    code, out = _run(workdir, extra=("--merge", str(workdir / "results.json")))
    assert code == 2 and "--merge reports finished results; use it with --report_only" in out


def _split(compared, tmp_path):
    """A copy of the finished tiny comparison in which random_3to1_s1 never finished, and the full results.json of
    the original as the other half of the split."""
    from hydrahead_jax.experiments.compare import report_finished

    workdir = tmp_path / "cmp"
    shutil.copytree(compared["workdir"], workdir)
    (workdir / "variants" / "random_3to1_s1" / "eval.json").unlink()
    full = json.loads((compared["workdir"] / "results.json").read_text())
    return workdir, full, report_finished


@pytest.mark.slow
def test_merge_reports_another_runs_records_of_the_same_recipe(compared, tmp_path):
    from configs import compare_tiny

    workdir, full, report_finished = _split(compared, tmp_path)
    other = compared["workdir"] / "results.json"
    results = report_finished(compare_tiny.get_config(), workdir, merge=[other])
    assert results["unfinished"] == []
    assert [v["name"] for v in results["variants"]] == ["layerwise_1to1", "random_3to1_s0", "random_3to1_s1"]
    by_name = {v["name"]: v for v in full["variants"]}
    merged = results["variants"][2]
    assert merged["merged_from"] == str(other)
    _check_record_against_its_files(merged, compared["workdir"] / "variants" / "random_3to1_s1")
    assert {k: v for k, v in merged.items() if k != "merged_from"} == by_name["random_3to1_s1"]
    assert all("merged_from" not in v for v in results["variants"][:2])  # finished here: this workdir's own
    assert f"merged from `{other}`" in (workdir / "report.md").read_text()
    # the group statistics are those of the unsplit comparison
    assert json.loads((workdir / "results.json").read_text())["summary"] == full["summary"]


def _with(results, path, change):
    changed = json.loads(json.dumps(results))
    change(changed)
    path.write_text(json.dumps(changed))
    return path


@pytest.mark.slow
def test_merge_refuses_results_of_another_recipe(compared, tmp_path):
    from configs import compare_tiny

    workdir, full, report_finished = _split(compared, tmp_path)
    config = compare_tiny.get_config()

    def refused(change, message):
        path = _with(full, tmp_path / "other.json", change)
        with pytest.raises(ConfigError, match=message):
            report_finished(config, workdir, merge=[path])

    refused(lambda r: r["base"].update(seed=1), r"ran a different base recipe \(differs in \['seed'\]\)")
    refused(lambda r: r["eval"].update(data_rows=99), "its evaluation settings differ")
    refused(lambda r: r["teacher"].update(config_hash="0" * 16), "its teacher was evaluated on other settings")
    refused(
        lambda r: r["variants"][2]["overrides"].update({"selection.seed": 7}),
        "variant 'random_3to1_s1' ran with overrides",
    )
    refused(lambda r: r.pop("variants"), "not a comparison's results.json")
    twice = _with(full, tmp_path / "twice.json", lambda r: None)
    with pytest.raises(ConfigError, match="variant 'random_3to1_s1' is in both"):
        report_finished(config, workdir, merge=[compared["workdir"] / "results.json", twice])


def test_report_gives_each_single_run_retrieval_cell_its_wilson_interval():
    """NIAH at 2 depths × 50 samples is 100 prompts: 0.5 → 50 of 100, Wilson 95 % [40.4, 59.6] %; passkey is 50
    prompts: 0.0 → [0, 7.1] % (z²/(n+z²) = 3.84 / 53.84); the teacher's line the same way."""
    final = {"data": {"kl": 0.5, "top1": 0.4, "ppl": 3.0}, "suite": {"niah@512": 0.5, "passkey@512": 0.0}}
    results = {
        "workdir": "w",
        "eval": {"samples": 50, "depths": [0.1, 0.9]},
        "teacher": {"suite": {"niah@512": 1.0, "passkey@512": 0.7}},
        "variants": [
            {"name": "a", "group": "a", "final": final, "overrides": {}, "curve_source": "train"},
        ],
    }
    text = render_markdown(results, summary_rows(results), [])
    assert "| 50 % [40, 60] | 0 % [0, 7] |" in text
    assert "Teacher retrieval: niah@512 100 % [96, 100], passkey@512 70 % [56, 81]" in text
    assert "Answer NLL" not in text  # evaluated before answers were scored: no table


def test_report_tables_the_answer_nll_of_each_group_and_the_teacher():
    """Answer NLL cells ("answer_nll:niah@512") are not retrieval accuracies: they get their own table, a group's
    mean ± sample spread (2.2 and 2.6: 2.4 ± 0.283), the teacher's row first."""
    runs = [
        {"name": f"r{i}", "group": "r", "overrides": {}, "curve_source": "train", "final": {"data": {}, "suite": s}}
        for i, s in enumerate(
            ({"niah@512": 0.0, "answer_nll:niah@512": 2.2}, {"niah@512": 0.0, "answer_nll:niah@512": 2.6})
        )
    ]
    results = {
        "workdir": "w",
        "eval": {"samples": 50, "depths": [0.1, 0.9]},
        "teacher": {"suite": {"niah@512": 1.0, "answer_nll:niah@512": 0.05}},
        "variants": runs,
    }
    rows = summary_rows(results)
    text = render_markdown(results, rows, [])
    assert "| variant | niah@512 |\n|---|---|\n| teacher | 0.05 |\n| r | 2.4 ± 0.283 |" in text
    assert "answer_nll" not in text.split("Answer NLL")[0]  # not a column of the accuracy table


def test_report_tables_held_out_text_with_intervals_and_paired_differences():
    """KL and top-1 per window ("windows:kl/news"): each variant's mean with its bootstrap interval over windows, and
    its difference from the first variant paired window by window. Differences equal on every window leave no
    spread: the interval is that difference itself, worked out by hand."""
    base = {"kl/news": 2.0, "windows:kl/news": [1.0, 2.0, 3.0], "windows:top1/news": [0.25, 0.25, 0.25]}
    better = {"kl/news": 1.5, "windows:kl/news": [0.5, 1.5, 2.5], "windows:top1/news": [0.5, 0.5, 0.5]}
    runs = [
        {"name": n, "group": n, "overrides": {}, "curve_source": "train", "final": {"data": {}, "suite": s}}
        for n, s in (("base", base), ("better", better), ("one_window", {"kl/news": 1.0}))
    ]
    results = {"workdir": "w", "eval": {}, "teacher": {}, "variants": runs}
    text = render_markdown(results, summary_rows(results), [])
    table = text.split("## Held-out text with intervals")[1]
    assert "| variant | kl/news | Δ kl/news | top1/news | Δ top1/news |" in table
    assert (
        "| better | 1.500 [" in table
        and "| -0.500 [-0.500, -0.500] | 50.0 [50.0, 50.0] | +25.0 [+25.0, +25.0] |" in table
    )
    assert "| base | 2.000 [" in table and "| one_window | — | — | — | — |" in table
    # the base's own interval over its three windows lies within their range and around their mean
    lo, hi = (float(x) for x in table.split("| base | 2.000 [")[1].split("]")[0].split(", "))
    assert 1.0 <= lo < 2.0 < hi <= 3.0
