"""Helpers for the training tests: the recipe configs (configs/ lives at the repo root, outside the package)."""

import os
import subprocess
import sys
import tempfile
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
    import json

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
        make_iterator=lambda: make_stage_iterator(
            run.data, seq_len=32, batch_size=4, seed=1, vocab_size=cfg.vocab_size, synthetic_rate=0.0
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
