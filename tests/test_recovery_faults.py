"""Continuing a finished run with more steps, and fault injection (issue 18): the tiny recipe, SIGKILLed at a
step of every training stage (each rerun resumes, then is killed in the next stage), must export parameters
bit-identical to an uninterrupted run. Each run costs four train.py processes, hence slow."""

import json
import os
import shutil
import signal
import time

import jax
import numpy as np
import pytest
from flax import nnx
from train_helpers import run_train

from hydrahead_jax.export import load_hydrahead

STAGES = ("stage1_align", "stage2_distil", "stage3_long")
STEPS = 6  # configs/tiny.py: every stage


def _params(final):
    model, _ = load_hydrahead(final)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(model))}


def _logged_step(workdir, stage):
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row["stage"] == stage:
            steps.append(row["step"])
    return max(steps)


def _run_and_kill(workdir, stage, step):
    """train.py on workdir, SIGKILLed as soon as ``stage`` has logged ``step``; True when the kill landed inside
    that stage (before its DONE marker)."""
    proc = run_train(workdir, wait=False)
    deadline = time.time() + 500
    try:
        while proc.poll() is None and time.time() < deadline:
            if _logged_step(workdir, stage) >= step:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.stdout.read()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, out
    return not (workdir / stage / "DONE").exists()


@pytest.fixture(scope="module")
def uninterrupted(tiny_train_py_run):
    """The plain run of the tiny recipe (shared, conftest): its workdir and exported parameters."""
    return tiny_train_py_run, _params(tiny_train_py_run / "final")


# Kill points: run r kills stage s once it has logged step KILL_STEPS[(r + s) % 4]. Over the four runs every stage
# is killed after each of its steps 1..STEPS-2 once (before and after a checkpoint at an even step, and right after
# the resume point of the previous kill), each run with a different combination; steps STEPS-1 and STEPS would let
# the stage finish before the kill lands.
KILL_STEPS = tuple(range(1, STEPS - 1))


@pytest.mark.slow
@pytest.mark.parametrize("run", range(len(KILL_STEPS)))
def test_kill_at_every_step_of_every_stage_then_the_export_is_bit_exact(uninterrupted, tmp_path, run):
    _, want = uninterrupted
    workdir = tmp_path / "run"
    for s, stage in enumerate(STAGES):
        step = KILL_STEPS[(run + s) % len(KILL_STEPS)]
        assert _run_and_kill(workdir, stage, step), f"{stage}: the kill came after it finished"
    proc = run_train(workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = _params(workdir / "final")
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "split" not in r]
    assert sorted((r["stage"], r["step"]) for r in train) == [(s, n) for s in STAGES for n in range(1, STEPS + 1)]
    heldout = [(r["stage"], r["step"]) for r in rows if r.get("split") == "heldout"]
    assert sorted(heldout) == [(s, n) for s in STAGES for n in (0, STEPS)]  # one per (stage, step) after the kills


@pytest.mark.slow  # train.py runs on the uninterrupted run's workdir
def test_more_steps_for_a_finished_stage_continue_it_and_rerun_the_stages_after_it(uninterrupted, tmp_path):
    # README: a plain run on runs/demo, then the same command with --config.stage2.steps raised.
    src, before = uninterrupted
    workdir = tmp_path / "run"
    shutil.copytree(src, workdir)
    proc = run_train(workdir, "--config.stage2.steps=8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "with changed settings: stage2.steps: 6 -> 8" in proc.stdout
    assert "[stage1_align] finished earlier; using its final checkpoint." in proc.stdout
    assert "[stage2_distil] finished earlier at step 6; continuing to step 8" in proc.stdout
    assert "resuming from step 6/8" in proc.stdout
    assert len(list(workdir.glob("stage3_long.superseded-*"))) == 1  # its input changed: moved aside, rerun
    logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in logged if "split" not in r]  # training rows
    assert [r["step"] for r in rows if r["stage"] == "stage2_distil"] == list(range(1, 9))
    assert [r["step"] for r in rows if r["stage"] == "stage3_long"] == list(range(1, STEPS + 1))
    heldout = [(r["stage"], r["step"]) for r in logged if r.get("split") == "heldout"]
    assert [n for s, n in heldout if s == "stage2_distil"] == [0, STEPS, 8]  # continued: its old rows are kept
    assert [n for s, n in heldout if s == "stage3_long"] == [0, STEPS]  # rerun: the old run's rows are dropped
    assert json.loads((workdir / "run_config.json").read_text())["config"]["stage2"]["steps"] == 8
    after = _params(workdir / "final")
    assert any(not np.array_equal(after[k], before[k]) for k in before)  # the export was replaced
