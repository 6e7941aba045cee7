"""Recovery as users meet it (issue 18): train.py in subprocesses on configs/tiny.py, real kills and files.

The NaN stop keeps only states whose own loss was finite and the advised fix (a lower lr) resumes without
--force_new; a negative or non-finite lr is refused before any work."""

import json
import math
import os
import shutil
import signal
import socket
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_helpers import run_train, tiny_config

from hydrahead_jax.config import ConfigError
from hydrahead_jax.run_config import RunConfig
from hydrahead_jax.training.checkpoint import WorkdirLock


def _logged(workdir, stage="stage1_align"):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["stage"] == stage and "split" not in r]  # training rows


def _saved_steps(stage_dir):
    return sorted(int(p.name) for p in stage_dir.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_nan_stop_keeps_a_finite_state_and_a_lower_lr_resumes_without_force_new(tmp_path):
    explode = ["--until_stage=align", "--config.stage1.train=all", "--config.stage1.checkpoint_every=1"]
    proc = run_train(tmp_path, *explode, "--config.stage1.lr=1e30", "--config.stage1.steps=8")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr  # no Orbax noise
    bad_step = int(proc.stderr.split(" at step ")[1].split(";")[0])
    stage_dir = tmp_path / "stage1_align"
    kept = _saved_steps(stage_dir)
    assert kept and kept[-1] == bad_step - 2
    losses = {r["step"]: r["loss"] for r in _logged(tmp_path)}
    # The kept state is the input of step kept[-1] + 1, whose loss and gradient norm were read and finite.
    assert math.isfinite(losses[kept[-1] + 1])
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(stage_dir / str(kept[-1]) / "model")
    leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
    assert leaves and all(np.isfinite(x).all() for x in leaves)
    assert max(float(np.abs(x).max()) for x in leaves) < 1e3  # not the exploded state of the next update

    fixed = run_train(tmp_path, *explode, "--config.stage1.lr=1e-3", "--config.stage1.steps=8")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "stage1.lr: 1e+30 -> 0.001" in fixed.stdout
    assert f"resuming from step {kept[-1]}/8" in fixed.stdout
    assert (stage_dir / "DONE").exists()
    assert all(math.isfinite(r["loss"]) for r in _logged(tmp_path) if r["step"] > kept[-1])


@pytest.mark.parametrize("lr", [-1e-3, float("nan"), float("inf"), 0.0])
def test_a_negative_or_non_finite_lr_is_refused_with_the_key(lr):
    recipe = tiny_config()
    recipe.stage2.lr = lr
    with pytest.raises(ConfigError, match=r"config\.stage2\.lr=.*must be a finite number > 0"):
        RunConfig.from_recipe(recipe)


# ------------------------------------------------------------------------------------------------ preemption etc.
STAGE1 = ["--until_stage=align", "--config.stage1.steps=40", "--config.stage1.checkpoint_every=8"]


def _wait_for(predicate, proc, what, timeout=400):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {proc.stdout.read()}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _rows_after(workdir, step):
    path = workdir / "metrics.jsonl"
    return lambda: path.exists() and any(r["step"] >= step for r in _logged(workdir))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    proc = run_train(workdir, *STAGE1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = {r["step"]: r["loss"] for r in _logged(workdir)}
    assert sorted(losses) == list(range(1, 41))
    return workdir, losses


@pytest.mark.slow
def test_sigterm_checkpoints_the_last_finished_step_and_the_rerun_continues_bit_exact(reference, tmp_path):
    _, want = reference
    proc = run_train(tmp_path, *STAGE1, wait=False)
    try:
        _wait_for(_rows_after(tmp_path, 3), proc, "step 3 was logged")
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    assert "preempted: stage stage1 stopped by SIGTERM after step" in out
    stopped = int(out.split("after step ")[1].split("/")[0])
    logged = _logged(tmp_path)
    assert [r["step"] for r in logged] == list(range(1, stopped + 1))  # every finished step, once
    assert _saved_steps(tmp_path / "stage1_align")[-1] == stopped  # saved although not on the 8-step interval

    rerun = run_train(tmp_path, *STAGE1)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"resuming from step {stopped}/40" in rerun.stdout
    rows = _logged(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 41))  # resumed steps are not logged twice
    assert {r["step"]: r["loss"] for r in rows} == want  # bit-exact


@pytest.mark.slow
def test_a_second_run_on_a_busy_workdir_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
    first = run_train(tmp_path, "--until_stage=align", "--config.stage1.steps=5000", wait=False)
    try:
        _wait_for(_rows_after(tmp_path, 1), first, "the first run trained")
        second = run_train(tmp_path, "--until_stage=align", "--config.stage1.steps=5000", timeout=300)
        assert second.returncode == 2, second.stdout + second.stderr
        assert second.stderr.strip().count("\n") == 0, second.stderr  # one line
        assert f"is in use by another run (pid {first.pid} on host {socket.gethostname()}" in second.stderr
        assert not (tmp_path / "stage1_align.superseded").exists()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with WorkdirLock(tmp_path):  # the kernel dropped the killed holder's lock
        pass


@pytest.mark.slow
def test_a_stage_whose_checkpoints_all_fail_restarts_on_the_data_of_a_fresh_run(reference, tmp_path):
    src, want = reference
    shutil.copytree(src, tmp_path / "w")
    workdir, stage_dir = tmp_path / "w", tmp_path / "w" / "stage1_align"
    (stage_dir / "DONE").unlink()
    steps = _saved_steps(stage_dir)
    assert len(steps) >= 2
    for step in steps:  # every data file of every step's model is garbage (sizes kept)
        for p in (stage_dir / str(step) / "model").rglob("*"):
            if p.is_file() and p.stat().st_size > 0:
                p.write_bytes(b"\x00garbage" * (p.stat().st_size // 8 + 1))
    (workdir / "metrics.jsonl").write_text("")
    proc = run_train(workdir, *STAGE1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every checkpoint of this stage is damaged" in proc.stdout, proc.stdout
    assert "starting the stage over from step 0" in proc.stdout
    assert len(list((stage_dir / "corrupt").iterdir())) == len(steps)
    got = {r["step"]: r["loss"] for r in _logged(workdir)}
    assert got == want  # the same batches as a fresh run, from the first one
