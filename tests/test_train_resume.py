"""Exact resume of train.py after SIGKILL (also in the middle of an async save), fallback past a corrupted
checkpoint, and the NaN stop — all in subprocesses on configs/tiny.py."""

import json
import math
import os
import shutil
import signal
import time

import pytest
from train_helpers import run_train

pytestmark = pytest.mark.slow  # train.py runs killed and resumed: the end-to-end tier

STAGE1 = [
    "--until_stage=align",
    "--config.stage1.steps=10",
    "--config.stage1.checkpoint_every=2",
    "--config.stage1.keep_checkpoints=3",
]


def _losses(workdir, stage="stage1_align"):
    """Training loss per step; a step logged twice (before a kill and after the resume) keeps its last value."""
    out = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["stage"] == stage and "split" not in r:
            out[r["step"]] = r["loss"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    proc = run_train(workdir, *STAGE1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = _losses(workdir)
    assert sorted(losses) == list(range(1, 11))
    return workdir, losses


def test_sigkill_during_async_save_then_resume_matches(reference, tmp_path):
    _, want = reference
    workdir = tmp_path / "killed"
    stage_dir = workdir / "stage1_align"
    proc = run_train(workdir, *STAGE1, wait=False)
    killed_during_save = False
    deadline = time.time() + 400
    try:
        while proc.poll() is None and time.time() < deadline:
            if stage_dir.exists():
                tmp = [p.name for p in stage_dir.iterdir() if "tmp" in p.name]
                # Kill while a step >= 4 is still being written (Orbax's temporary directory is present).
                if any(name.split(".")[0].isdigit() and int(name.split(".")[0]) >= 4 for name in tmp):
                    os.kill(proc.pid, signal.SIGKILL)
                    killed_during_save = True
                    break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert killed_during_save, "the run finished before a save of step >= 4 could be interrupted"
    assert not (stage_dir / "DONE").exists()
    done_before = _losses(workdir)
    assert 4 <= max(done_before) < 10

    rerun = run_train(workdir, *STAGE1)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resuming from step" in rerun.stdout
    start = int(rerun.stdout.split("resuming from step ")[1].split("/")[0])
    assert 2 <= start < 10 and start % 2 == 0
    got = _losses(workdir)
    assert sorted(got) == list(range(1, 11))
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train, heldout = [r for r in rows if "split" not in r], [r for r in rows if r.get("split") == "heldout"]
    assert [r["step"] for r in train] == list(range(1, 11))  # steps redone after the kill are not logged twice
    assert [r["step"] for r in heldout] == [0, 10]  # step 0 is not evaluated again by the resumed run
    want_heldout = [json.loads(line) for line in (reference[0] / "metrics.jsonl").read_text().splitlines()]
    want_heldout = [r for r in want_heldout if r.get("split") == "heldout"]
    for got_row, want_row in zip(heldout, want_heldout, strict=True):
        assert got_row["loss"] == pytest.approx(want_row["loss"], rel=1e-6, abs=1e-9), got_row["step"]
    for step in range(start + 1, 11):  # computed by the resumed process from the restored state
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-9), step
    for step in range(1, start + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-9), step


def test_corrupted_latest_checkpoint_falls_back(reference, tmp_path):
    src, want = reference
    workdir = tmp_path / "corrupt"
    shutil.copytree(src, workdir)
    stage_dir = workdir / "stage1_align"
    (stage_dir / "DONE").unlink()
    # Corrupt every data file of step 10's model (keeping sizes): the step exists but cannot be restored.
    files = [p for p in (stage_dir / "10" / "model").rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert files
    for p in files:
        p.write_bytes(b"\x00garbage" * (p.stat().st_size // 8 + 1))
    (workdir / "metrics.jsonl").write_text("")
    proc = run_train(workdir, *STAGE1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checkpoint step 10" in proc.stdout and "is damaged" in proc.stdout
    assert "resuming from step 8/10" in proc.stdout
    assert list((stage_dir / "corrupt").glob("10-*"))
    got = _losses(workdir)
    assert sorted(got) == [9, 10]
    assert got[9] == pytest.approx(want[9], rel=1e-6) and got[10] == pytest.approx(want[10], rel=1e-6)
    assert (stage_dir / "DONE").exists()


def test_nan_loss_stops_the_stage_and_keeps_last_good_checkpoint(tmp_path):
    # An absurd learning rate: step 1 runs at lr 0 (warmup), then the parameters explode to inf/NaN.
    proc = run_train(
        tmp_path,
        "--until_stage=align",
        "--config.stage1.lr=1e30",
        "--config.stage1.train=all",
        "--config.stage1.checkpoint_every=1",
        "--config.stage1.steps=8",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "non-finite" in proc.stderr and "config.stage1.lr" in proc.stderr
    logged = _losses(tmp_path)
    stage_dir = tmp_path / "stage1_align"
    steps = sorted(int(p.name) for p in stage_dir.iterdir() if p.name.isdigit())
    assert not (stage_dir / "DONE").exists()
    # Every logged step was finite; the state of the last one produced the non-finite step, so it is not kept.
    bad_step = int(proc.stderr.split(" at step ")[1].split(";")[0])
    assert sorted(logged) == list(range(1, bad_step)) and bad_step < 8
    assert steps and steps[-1] == bad_step - 2
    assert f"last good checkpoint (step {steps[-1]})" in proc.stderr


def test_a_non_finite_step_is_never_checkpointed_although_metrics_are_read_one_step_late(tmp_path):
    # Metrics are read back one step after dispatch; a saved state is kept only once the step computed from it
    # was read and found finite. Saves every 2 steps: whichever step first goes non-finite, no state from it or
    # the one before it is kept.
    proc = run_train(
        tmp_path,
        "--until_stage=align",
        "--config.stage1.lr=1e30",
        "--config.stage1.train=all",
        "--config.stage1.checkpoint_every=2",
        "--config.stage1.steps=8",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    bad_step = int(proc.stderr.split(" at step ")[1].split(";")[0])
    logged = _losses(tmp_path)
    stage_dir = tmp_path / "stage1_align"
    saved = sorted(int(p.name) for p in stage_dir.iterdir() if p.name.isdigit())
    assert sorted(logged) == list(range(1, bad_step))  # every step before the bad one was logged, in order
    assert all(math.isfinite(v) for v in logged.values())
    # Kept: the saved states whose own loss (the next step's) was read and finite, i.e. steps <= bad_step - 2
    # (Orbax also saves the first step, whatever the interval).
    assert all(s <= bad_step - 2 for s in saved)
    assert {s for s in range(2, 9, 2) if s <= bad_step - 2} <= set(saved)
    if saved:
        assert f"last good checkpoint (step {saved[-1]})" in proc.stderr
    else:
        assert "no checkpoint of this stage was written yet" in proc.stderr
    assert not (stage_dir / "DONE").exists()
