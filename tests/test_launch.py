"""The launchers of scripts/launch/ and train.py's --local_device_ids: what JAX's cluster detection decides under
SLURM, the SLURM batch script run end to end by a stand-in srun (tests/fake_cluster/srun: two processes of one
simulated node, found by JAX's own SLURM detection), and the commands the TPU pod script gives gcloud."""

import os
import socket
import subprocess
import sys

import pytest
from train_helpers import ROOT, single_device_env

from hydrahead_jax.config import ConfigError

FAKE = ROOT / "tests" / "fake_cluster"


def _slurm_env(local_id: int) -> dict:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": str(local_id),
        "SLURM_LOCALID": str(local_id),
    }


def test_local_device_ids_flag_values():
    from train import local_device_ids

    assert local_device_ids(None) is None
    assert local_device_ids("all") == []
    assert local_device_ids("0,1,2,3") == [0, 1, 2, 3]
    for bad in ("", "x", "0,0", "-1", "1,,2"):
        with pytest.raises(ConfigError, match="--local_device_ids"):
            local_device_ids(bad)


def test_jax_under_slurm_gives_one_gpu_per_process_unless_told_all(monkeypatch):
    """JAX's own detection (the code jax.distributed.initialize runs): SLURM_LOCALID's device alone by default,
    nothing restricted with the [] that --local_device_ids=all passes."""
    from jax._src.clusters import ClusterEnv

    for key, value in _slurm_env(local_id=3).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
    default = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 10)
    assert default == (f"localhost:{4242 % 4096 + 61440}", 8, 3, [3])
    told_all = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, [], None, 10)
    assert told_all[3] == []


def _free_slurm_job_id() -> int:
    """A job id whose coordinator port (JAX: 61440 + id mod 4096) is free here."""
    for job in range(100, 4096, 37):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + job))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port in JAX's SLURM range")


@pytest.mark.slow
def test_slurm_script_runs_two_tasks_that_join_one_mesh(tmp_path):
    env = single_device_env()
    env.update(
        PATH=f"{FAKE}:{env['PATH']}",
        SLURM_JOB_ID=str(_free_slurm_job_id()),
        SLURM_NTASKS="2",
        SLURM_SUBMIT_DIR=str(ROOT),
        SRUN_LOG_DIR=str(tmp_path),
        PYTHON=sys.executable,
    )
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "launch" / "slurm.sbatch"),
            str(ROOT / "configs" / "tiny.py"),
            str(tmp_path / "run"),
            "--until_stage=align",
            "--config.stage1.steps=2",
            "--config.stage1.heldout_rows=0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = [(tmp_path / f"task{i}.log").read_text() for i in range(2)]
    assert proc.returncode == 0, proc.stderr + "\n".join(logs)
    for log in logs:
        assert "over 2 device(s) of 2 process(es)" in log  # JAX found both tasks from SLURM's variables alone
    assert "[stage1_align] done: 2 steps" in logs[0]
    assert (tmp_path / "run" / "stage1_align" / "DONE").exists()


def test_slurm_script_refuses_missing_arguments():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "launch" / "slurm.sbatch")], capture_output=True, text=True)
    assert proc.returncode == 64 and "usage: sbatch scripts/launch/slurm.sbatch CONFIG WORKDIR" in proc.stderr


def _tpu_pod(tmp_path, *args):
    log = tmp_path / "gcloud.log"
    env = dict(os.environ, PATH=f"{FAKE}:{os.environ['PATH']}", GCLOUD_LOG=str(log), REPO="https://example.invalid/r")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "launch" / "tpu_pod.sh"), *args], env=env, capture_output=True, text=True
    )
    calls = log.read_text().split("\n--\n") if log.exists() else []
    return proc, [c.splitlines() for c in calls if c.strip()]


def test_tpu_pod_script_installs_then_trains_on_every_worker(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    proc, calls = _tpu_pod(
        tmp_path,
        "my-v5p-64",
        "us-east5-a",
        "configs/qwen3_1p7b_hydrahead.py:7to1",
        "gs://b/run",
        "--until_stage=distil",
    )
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == 2
    for call in calls:
        assert call[:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-v5p-64"]
        assert "--zone=us-east5-a" in call and "--worker=all" in call
    install, train = calls[0][-1], calls[1][-1]
    assert f"git checkout -q {head}" in install and "pip install -q -e '.[tpu]'" in install
    assert train == (
        "--command=cd hydrahead-jax && .venv/bin/python train.py --config configs/qwen3_1p7b_hydrahead.py:7to1 "
        "--workdir gs://b/run --config.distributed=True --until_stage=distil"
    )


def test_tpu_pod_script_refuses_a_local_workdir(tmp_path):
    proc, calls = _tpu_pod(tmp_path, "tpu", "zone", "configs/tiny.py", "runs/local")
    assert proc.returncode == 64 and "must be gs://BUCKET/PATH" in proc.stderr and calls == []
