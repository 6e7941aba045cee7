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
    the same stage (resume tests) and the processes of one run reuse compiled steps instead of compiling again."""
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "hydrahead_test_jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    return env


def run_train(workdir, *overrides, timeout=600, wait=True, config="tiny.py"):
    """train.py on configs/<config> (tiny.py; an absolute path is used as it is) in a subprocess with ONE CPU
    device (the tests' 8-device flag removed)."""
    env = single_device_env()
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
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


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
