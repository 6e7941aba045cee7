"""A run whose workdir is an object-store URL (gs://), against a real GCS JSON API on 127.0.0.1 (gcs_emulator.py):
the path layer (hydrahead_jax.storage), the workdir lease, the metrics log, the head map, and the whole tiny
recipe written to and read back from gs://bucket/run with a kill and a resume, nothing created on the local disk.
"""

import json
import os
import signal
import socket
import time

import numpy as np
import pytest
from gcs_emulator import BUCKET, emulator_env, gcs_emulator
from train_helpers import ROOT, run_train

from hydrahead_jax.config import ConfigError
from hydrahead_jax.storage import files_under, local_mirror, move, run_path
from hydrahead_jax.training.checkpoint import LeaseLock, WorkdirError, WorkdirLock
from hydrahead_jax.training.metrics import JsonlAppender


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator's variables, set in this process too (its own clients: epath, TensorStore)."""
    with gcs_emulator(tmp_path_factory.mktemp("gcs")) as variables, emulator_env(variables):
        yield variables


# ------------------------------------------------------------------------------------------------ paths
def test_run_path_keeps_urls_and_makes_local_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert os.fspath(run_path("runs/a")) == str(tmp_path / "runs" / "a")
    assert os.fspath(run_path("gs://bucket/run/x")) == "gs://bucket/run/x"
    assert os.fspath(run_path("gs://bucket/run") / "stage1_align") == "gs://bucket/run/stage1_align"
    assert not (tmp_path / "gs:").exists()


@pytest.mark.parametrize(
    ("given", "named"),
    [("hdfs://nn/run", "hdfs:// scheme is not supported"), ("gs:/bucket/run", "not a complete URL"), ("gs://", "")],
)
def test_run_path_refuses_a_url_it_cannot_serve(given, named):
    with pytest.raises(ConfigError, match="--workdir") as err:
        run_path(given, what="--workdir")
    assert named in str(err.value)


def test_files_under_lists_nested_objects(gcs):
    root = run_path(f"gs://{BUCKET}/listing")
    for name in ("a.json", "d/b.json", "d/e/c.bin"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    got = [os.fspath(p)[len(os.fspath(root)) + 1 :] for p in files_under(root)]
    assert got == ["a.json", "d/b.json", "d/e/c.bin"]


def test_move_puts_a_folder_under_a_parent_that_holds_no_object_yet(gcs):
    """A quarantined step goes to <stage>/corrupt/<step>-<time>, a replaced run to <workdir>.replaced-<time>/…:
    on an object store that parent is only a prefix until the move writes into it."""
    root = run_path(f"gs://{BUCKET}/moving")
    for name in ("4/model/a.bin", "4/meta/m.json"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    move(root / "4", root / "corrupt" / "4-late")
    assert not (root / "4").exists()
    moved = root / "corrupt" / "4-late"
    assert [os.fspath(p)[len(os.fspath(moved)) + 1 :] for p in files_under(moved)] == ["meta/m.json", "model/a.bin"]
    assert (moved / "model" / "a.bin").read_text() == "4/model/a.bin"


# ------------------------------------------------------------------------------------------------ lease
@pytest.fixture
def quick_lease(monkeypatch):
    monkeypatch.setattr(LeaseLock, "SETTLE_S", 0.05)


def _lease_object(path, **fields):
    lease = {"holder": "pid 1 on host elsewhere", "host": "elsewhere", "pid": 1, "token": "t", "expires": 0}
    lease.update(fields)
    path.write_text(json.dumps(lease))


def test_workdir_lease_refuses_a_second_run_and_is_released(gcs, quick_lease):
    workdir = run_path(f"gs://{BUCKET}/leased")
    first = WorkdirLock(workdir)
    first.acquire()
    try:
        held = json.loads((workdir / ".lock").read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
        assert held["expires"] > time.time() + LeaseLock.LEASE_S / 2
        with pytest.raises(WorkdirError, match=f"in use by another run \\(pid {os.getpid()}"):
            WorkdirLock(workdir).acquire()
    finally:
        first.release()
    assert not (workdir / ".lock").exists()
    second = WorkdirLock(workdir)
    second.acquire()
    second.release()


def test_workdir_lease_of_a_gone_holder_is_taken_over(gcs, quick_lease):
    workdir = run_path(f"gs://{BUCKET}/stale")
    workdir.mkdir(parents=True, exist_ok=True)
    _lease_object(workdir / ".lock", host="elsewhere", expires=time.time() + 600)  # alive on another host
    with pytest.raises(WorkdirError, match="pid 1 on host elsewhere.*lease expires at"):
        WorkdirLock(workdir).acquire()
    _lease_object(workdir / ".lock", host="elsewhere", expires=time.time() - 1)  # expired
    lock = WorkdirLock(workdir)
    lock.acquire()
    lock.release()
    dead = 2**22 + 12345  # above Linux's default pid_max (2^22): no process has it
    _lease_object(workdir / ".lock", host=socket.gethostname(), pid=dead, expires=time.time() + 600)
    lock = WorkdirLock(workdir)
    lock.acquire()  # killed here: its pid is gone, so the lease is stale before it expires
    assert json.loads((workdir / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


# ------------------------------------------------------------------------------------------------ metrics
def test_metrics_log_on_an_object_store_is_rewritten_whole_at_each_flush(gcs):
    path = run_path(f"gs://{BUCKET}/log/metrics.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"step": 1}\n')
    log = JsonlAppender(path, flush_every_s=3600)
    log.write('{"step": 2}\n')
    assert path.read_text() == '{"step": 1}\n'  # not yet flushed: objects cannot be appended to
    log.flush()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    log.write('{"step": 3}\n')
    log.close()
    assert path.read_text().splitlines() == ['{"step": 1}', '{"step": 2}', '{"step": 3}']


# ------------------------------------------------------------------------------------------------ a whole run
def _train_losses(text: str) -> dict[tuple[str, int], float]:
    rows = [json.loads(line) for line in text.splitlines()]
    return {(r["stage"], r["step"]): r["loss"] for r in rows if "split" not in r}


@pytest.mark.slow
def test_a_run_on_gs_is_killed_resumed_exported_and_read_back(gcs, tmp_path):
    """The tiny recipe's three stages with --workdir gs://bucket/run, run from an empty folder: SIGKILL once the
    distillation stage has a checkpoint, a rerun that resumes it and exports, a third run that finds the finished
    run; every logged loss equals an uninterrupted run's on a local workdir, the export read back from the bucket
    holds the same parameters, and the empty folder stays empty."""
    from hydrahead_jax.export import load_hydrahead

    local = tmp_path / "local"
    reference = run_train(local)
    assert reference.returncode == 0, reference.stdout + reference.stderr

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    url = f"gs://{BUCKET}/run"
    run = run_path(url)
    proc = run_train(url, wait=False, cwd=cwd, extra_env=gcs)
    deadline = time.time() + 400
    try:
        while proc.poll() is None and time.time() < deadline:
            if (run / "stage2_distil" / "2" / "commit_success.txt").exists():  # Orbax's mark of a finished save
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    assert proc.returncode == -signal.SIGKILL, out
    assert not (run / "stage2_distil" / "DONE").exists()
    assert (run / "stage1_align" / "DONE").exists()

    resumed = run_train(url, cwd=cwd, extra_env=gcs)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "[stage1_align] finished earlier" in resumed.stdout
    assert "[stage2_distil] resuming from step" in resumed.stdout
    assert f"exported the HydraHead model to {url}/final" in resumed.stdout
    assert not (run / ".lock").exists()  # the lease is released with the run

    again = run_train(url, cwd=cwd, extra_env=gcs)
    assert again.returncode == 0, again.stdout + again.stderr
    assert all(f"[{s}] finished earlier" in again.stdout for s in ("stage1_align", "stage2_distil", "stage3_long"))

    want = _train_losses((local / "metrics.jsonl").read_text())
    got = _train_losses((run / "metrics.jsonl").read_text())
    assert sorted(got) == sorted(want)
    for key, loss in want.items():  # a resumed step on CPU repeats the uninterrupted one (test_train_resume.py)
        assert got[key] == pytest.approx(loss, rel=1e-6, abs=1e-9), key
    assert (run / "head_map.json").read_text() == (local / "head_map.json").read_text()
    assert list((run / "tensorboard" / "stage3_long").iterdir()), "no TensorBoard events in the bucket"

    from flax import nnx

    ours, _ = load_hydrahead(f"{url}/final")
    theirs, _ = load_hydrahead(local / "final")
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(ours)), nnx.to_flat_state(nnx.state(theirs)), strict=True):
        np.testing.assert_allclose(
            np.asarray(a.get_value()), np.asarray(b.get_value()), rtol=1e-6, atol=1e-9, err_msg=str(path)
        )
    assert list(cwd.iterdir()) == []  # nothing of the run on the local disk
    assert not (ROOT / "gs:").exists()


def test_an_evaluation_folder_on_gs_is_mirrored_locally_and_written_back(gcs):
    """eval.py --out gs://…: the journal a previous run left in the bucket is there to resume from, and what the
    run appends and adds is in the bucket afterwards, also when the run fails."""
    url = f"gs://{BUCKET}/eval"
    (run_path(url) / "journal.jsonl").write_text('{"unit": 1}\n')
    with pytest.raises(RuntimeError, match="stopped"), local_mirror(url) as local:
        assert (local / "journal.jsonl").read_text() == '{"unit": 1}\n'
        with open(local / "journal.jsonl", "a") as journal:
            journal.write('{"unit": 2}\n')
        (local / "plots").mkdir()
        (local / "plots" / "a.png").write_bytes(b"\x89PNG")
        raise RuntimeError("stopped")
    assert (run_path(url) / "journal.jsonl").read_text() == '{"unit": 1}\n{"unit": 2}\n'
    assert (run_path(url) / "plots" / "a.png").read_bytes() == b"\x89PNG"
