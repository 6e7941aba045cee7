"""Helpers for the training tests: the recipe configs (configs/ lives at the repo root, outside the package)."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def tiny_config():
    from configs import tiny

    return tiny.get_config()


FINISHED_RUN_STEPS = 3


def finished_run_config():
    """The tiny recipe of the finished run that the tests which only read one share (conftest's
    ``tiny_finished_run``): all 8 simulated devices (4 held-out rows are padded to 8), batches of 8, 3 steps per
    stage with one checkpoint at the end, stage 1's held-out evaluation every 2 steps (points 0, 2 and 3), and 12
    held-out rows in stage 2 (more than a micro-batch of 8: evaluated in 2 groups of 8, 4 rows padding)."""
    c = tiny_config()
    c.mesh.data = -1
    for key in ("stage1", "stage2", "stage3"):
        c[key].batch_size = 8
        c[key].steps = FINISHED_RUN_STEPS
        c[key].checkpoint_every = FINISHED_RUN_STEPS
    c.stage1.heldout_every = 2
    c.stage2.heldout_rows = 12
    return c


def single_device_env() -> dict:
    """The environment of a subprocess with ONE CPU device (the tests' 8-device flag removed) and the tests'
    persistent compilation cache."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
    )
    env["JAX_PLATFORMS"] = "cpu"
    return with_test_compilation_cache(env)


def with_test_compilation_cache(env: dict) -> dict:
    """``env`` with the persistent compilation cache the tests' subprocesses share (unless set already): reruns of
    the same stage (resume tests) and the processes of one run reuse compiled steps instead of compiling again.
    Every program is kept, however quick its compile: the tiny recipe's steps each compile in well under a second,
    and keeping them all took the killed-and-resumed comparison's fixture from 133 to 110 CPU-seconds and the quick
    study's test from 262 to 200 (measured 2026-12-05 against a 0.5 s floor and jax's default of 1 s). One folder
    per pytest worker: jax writes an entry in place, so a process of one worker could otherwise read an entry
    another worker is still writing."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "hydrahead_test_jax_cache" / worker))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return env


def run_train(workdir, *overrides, timeout=600, wait=True, config="tiny.py", cwd=ROOT, extra_env=None):
    """train.py on configs/<config> (tiny.py; an absolute path is used as it is) in a subprocess with ONE CPU
    device (the tests' 8-device flag removed), run in ``cwd`` with ``extra_env`` added to its environment."""
    env = dict(single_device_env(), **(extra_env or {}))
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        str(ROOT / "configs" / config),
        "--workdir",
        str(workdir),
        *overrides,
    ]
    if not wait:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def cluster_env(devices: int) -> dict[str, str]:
    """The environment of one process of a multi-process run: ``devices`` CPU devices, this worktree importable
    (the processes' own sys.path[0] is train.py's folder, set here as well for any other entry point) and the
    tests' compilation cache."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return with_test_compilation_cache(env)


def train_command(workdir, *extra: str) -> list[str]:
    """``python train.py --config configs/tiny.py --workdir WORKDIR *extra``."""
    config = str(ROOT / "configs" / "tiny.py")
    return [sys.executable, str(ROOT / "train.py"), "--config", config, "--workdir", str(workdir), *extra]


class Cluster:
    """The processes of one multi-process train.py run on this machine (``processes`` of ``devices`` CPU devices
    each, a local coordinator, gloo collectives), their output in files (no pipe to fill)."""

    def __init__(self, workdir: Path, logs: Path, *extra: str, processes: int = 2, devices: int = 4):
        port = free_port()
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"process{p}.log" for p in range(processes)]
        self.procs = []
        for p, log in enumerate(self.logs):
            cluster = ("--config.distributed=True", f"--coordinator_address=localhost:{port}")
            cluster += (f"--num_processes={processes}", f"--process_id={p}")
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        train_command(workdir, *extra, *cluster),
                        env=cluster_env(devices),
                        cwd=ROOT,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )

    def tails(self) -> str:
        return "\n".join(
            f"--- process {p} (last lines) ---\n" + log.read_text()[-3000:] for p, log in enumerate(self.logs)
        )

    def wait(self, timeout: float, expect: int = 0) -> None:
        """Wait for every process to exit (killing them all past ``timeout``) and check each exit status."""
        import pytest

        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the {len(self.procs)}-process run did not finish in {timeout:.0f} s\n{self.tails()}")
        codes = [proc.returncode for proc in self.procs]
        assert codes == [expect] * len(self.procs), f"exit statuses {codes}, expected {expect}\n{self.tails()}"

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()  # SIGKILL: no checkpoint on the way out
        for proc in self.procs:
            proc.wait(timeout=60)


def logged_losses(workdir: Path) -> dict[tuple[str, str, int], float]:
    """{(stage, "train" or "heldout", step): loss} of a workdir's metrics.jsonl."""
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    losses = {(r["stage"], r.get("split", "train"), r["step"]): r["loss"] for r in rows}
    assert len(losses) == len(rows), "one row per (step, split)"
    return losses


def tiny_models(c, **hybrid_changes):
    """(model cfg, random teacher, head map with one FA group per layer, HybridConfig) of the tiny recipe ``c``;
    ``hybrid_changes`` override fields of its HybridConfig (e.g. gdn_implementation="pallas")."""
    from flax import nnx

    from hydrahead_jax.config import ModelConfig
    from hydrahead_jax.hybrid import HeadMap, HybridConfig
    from hydrahead_jax.models import Transformer

    cfg = ModelConfig.from_dict(dict(c.teacher.model))
    teacher = Transformer(cfg, rngs=nnx.Rngs(0))
    head_map = HeadMap.from_fa_groups(cfg, [[0], [1]], method="test")
    hybrid = HybridConfig.from_dict(dict(c.hybrid)).replace(**hybrid_changes)
    return cfg, teacher, head_map, hybrid


def run_tiny_distil(workdir, mesh, *, steps=5, checkpoint_every=None, model_changes=None, **hybrid_changes):
    """Stage 2 (distillation) of the tiny recipe for ``steps`` steps on ``mesh`` through the real trainer
    (``run_stage``); returns (the logged losses, the student's final full pure state). A ``workdir`` that exists
    is resumed (the trainer's own resume); ``model_changes`` override fields of the teacher's model config;
    ``checkpoint_every`` defaults to ``steps``."""
    import jax
    from flax import nnx

    from hydrahead_jax.hybrid import build_model, build_student
    from hydrahead_jax.run_config import STAGES, RunConfig
    from hydrahead_jax.training.data import make_stage_iterator
    from hydrahead_jax.training.trainer import StageSpec, TeacherHandle, run_stage

    c = tiny_config()
    c.stage2.steps = steps
    c.stage2.checkpoint_every = checkpoint_every or steps
    c.teacher.model.update(model_changes or {})
    cfg, teacher, head_map, hybrid = tiny_models(c, **hybrid_changes)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build_model(cfg, head_map, hybrid, nnx.Rngs(0))))

    def init():
        student = build_student(teacher, head_map, hybrid, rngs=nnx.Rngs(0))
        return jax.tree.map(lambda x: x.copy(), nnx.as_pure(nnx.state(student)))

    workdir.mkdir(exist_ok=True)
    run = RunConfig.from_recipe(c)
    spec = StageSpec(
        stage=STAGES[1],
        config=run.stage2,
        directory=workdir / "stage2_distil",
        trainable=nnx.Param,
        meta={},
        make_iterator=lambda start_batch: make_stage_iterator(
            run.data,
            seq_len=32,
            batch_size=4,
            seed=1,
            vocab_size=cfg.vocab_size,
            synthetic_rate=0.0,
            start_batch=start_batch,
        ),
    )
    final = run_stage(
        spec,
        student_graphdef=graphdef,
        abstract_student=abstract,
        initial_student=init,
        teacher=TeacherHandle(teacher, mesh),
        mesh=mesh,
        workdir=workdir,
        logging_cfg=run.logging,
    )
    losses = [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return losses, final
