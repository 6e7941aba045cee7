"""The reproduction study (experiments/reproduce.py): --quick end to end, killed part-way and resumed, and the
refusals that keep a workdir's study from changing under it."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hydrahead_jax.config import ConfigError
from hydrahead_jax.experiments import reproduce

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    # one device (the study's batches are sized for it) and the suite's fast-compiling XLA level
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "xla")  # shared by the killed run and its resumption
    return env


def _start(workdir, tmp_path):
    cmd = [sys.executable, "-m", "hydrahead_jax.experiments.reproduce", f"--workdir={workdir}", "--quick"]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
def test_quick_study_killed_mid_run_resumes_and_reports(tmp_path, gensim_wheel):
    """Every part of the study at tiny sizes; SIGKILL once the first arm has finished and the second has begun,
    then the same command finishes it: the teacher, the probe and the finished run are not redone."""
    workdir = tmp_path / "study"
    first = _start(workdir, tmp_path)
    lines, deadline = [], time.time() + 1800  # a guard against a hang, not a speed test
    for line in first.stdout:
        lines.append(line)
        if re.search(r"\[reproduce\] 2/6 \S+: stage", line):
            first.send_signal(signal.SIGKILL)
            break
        assert time.time() < deadline, "".join(lines[-20:])
    first.wait()
    assert first.returncode == -signal.SIGKILL, "".join(lines[-30:])
    teacher_log = (workdir / "teacher" / "train_log.jsonl").read_text()
    assert (workdir / "runs" / "x1" / "seed0" / "variants" / "head_7to1" / "eval.json").exists()

    second = subprocess.run(
        [sys.executable, "-m", "hydrahead_jax.experiments.reproduce", f"--workdir={workdir}", "--quick"],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "1/6 head_7to1/seed0/x1: finished earlier, skipped" in out
    assert "teacher: training" not in out and "probing the teacher" not in out  # neither is redone
    assert (workdir / "teacher" / "train_log.jsonl").read_text() == teacher_log

    results = json.loads((workdir / "results" / "results.json").read_text())
    assert [c["id"] for c in results["claims"]] == ["H1", "H2", "H3", "H4"]
    for c in results["claims"]:
        assert c["decision"] in ("supported", "contradicted", "undecided")
        assert {"statement", "estimate", "ci_low", "ci_high", "n_seeds"} <= set(c)
    assert results["claims"][0]["n_seeds"] == 2  # both primary arms under both seeds, paired
    teacher = results["teacher"]
    assert teacher["accepted"] is False  # four steps of training: recorded, not hidden
    assert {"recall", "ablated_recall", "random_ablated_recall"} <= set(teacher["acceptance"])
    runs = {(r["run"]["arm"], r["run"]["seed"], r["run"]["scale"]) for r in results["runs"]}
    assert runs == {
        ("head_7to1", 0, 1.0),
        ("head_7to1", 1, 1.0),
        ("layer_3to1", 0, 1.0),
        ("layer_3to1", 1, 1.0),
        ("head_7to1", 0, 2.0),
        ("layer_3to1", 0, 2.0),
    }
    assert results["unfinished"] == []
    assert results["convergence"]["converged"] in (True, False)
    study = reproduce.quick_study()
    cfg_teacher = study.teacher
    per_group = 2 * cfg_teacher.head_dim * 4  # K and V of one KV group, float32, per token
    for r in results["runs"]:
        vdir = workdir / "runs" / f"x{r['run']['scale']:g}" / f"seed{r['run']['seed']}" / "variants" / r["run"]["arm"]
        head_map = json.loads((vdir / "head_map.json").read_text())
        fa = sum(len(g) for g in head_map["fa_groups"])
        assert r["kv_bytes_per_token"] == fa * per_group
        for cell in r["mqar_by_pairs"].values():
            assert cell["queries"] >= study.eval.min_queries and 0 <= cell["recall"] <= 1
        assert set(r["mqar_by_length"]) == {str(n) for n in study.eval.lengths}
        assert r["niah"]["prompts"] == study.eval.niah_prompts and r["kl"] >= 0
    assert (workdir / "results" / "recall_by_length.png").stat().st_size > 0
    assert "H1" in (workdir / "results" / "report.md").read_text()


def test_a_workdir_refuses_another_study_or_changed_claims(tmp_path, monkeypatch):
    study = reproduce.quick_study()
    reproduce._claim_workdir(study, tmp_path)
    reproduce._claim_workdir(study, tmp_path)  # the same study continues
    import dataclasses

    with pytest.raises(ConfigError, match="other settings"):
        reproduce._claim_workdir(dataclasses.replace(study, seeds=3), tmp_path)
    from hydrahead_jax.experiments import claims

    changed = [dict(c, alpha=0.1) for c in claims.claims_spec()]
    monkeypatch.setattr(claims, "claims_spec", lambda: changed)
    with pytest.raises(ConfigError, match="claims were fixed before"):
        reproduce._claim_workdir(study, tmp_path)


def test_only_names_parts_and_runs_are_seed_major():
    with pytest.raises(ConfigError, match="parts are"):
        reproduce.parts_of(["head_7to1", "nope"])
    study = reproduce.Study()
    specs = reproduce.run_specs(study, reproduce.parts_of([]))
    base = [s for s in specs if s.scale == 1.0]
    assert len([s for s in base if s.arm == "head_7to1"]) == 5 and len([s for s in base if s.arm == "all_la"]) == 3
    assert len(base) == 2 * 5 + 5 * 3 and len(specs) == len(base) + 2 * 3
    assert [s.seed for s in base] == sorted(s.seed for s in base)  # every arm's first seeds come first
    assert {s.arm for s in reproduce.run_specs(study, ["convergence"])} == set(reproduce.PRIMARY)
