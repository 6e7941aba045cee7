"""One training stage: shard, restore or initialise, run the jitted step, log, checkpoint, finish.

State interchange between stages is the student's *full* pure state (every Variable, ``nnx.as_pure``) plus its
graphdef; inside a stage it is split into the trained Params and the rest by the stage's filter.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from hydrahead_jax.training import memory
from hydrahead_jax.training import sharding as shd
from hydrahead_jax.training.checkpoint import StageCheckpointer
from hydrahead_jax.training.metrics import StageLogger, check_finite
from hydrahead_jax.training.steps import (
    abstract_with_shardings,
    cast_like,
    f32_param_target,
    jit_train_step,
    make_train_step,
    stage_layout,
    stage_optimizer,
    stage_settings,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StageSpec:
    """Everything one stage needs, resolved from the config by the pipeline."""

    kind: str  # align | distil | long
    config_key: str  # stage1 | stage2 | stage3
    directory: Path
    stage_cfg: Any  # the ConfigDict of this stage
    trainable: Any  # nnx filter of the trained parameters
    make_iterator: Callable[[], Any]  # -> grain DatasetIterator of global batches
    meta: dict[str, Any]  # config hash and resolved config, stored in every checkpoint


def total_steps(stage_cfg) -> int:
    """``steps`` when > 0, else ⌈tokens / (batch · seq_len)⌉."""
    if int(stage_cfg.steps) > 0:
        return int(stage_cfg.steps)
    tokens = int(stage_cfg.tokens)
    if tokens <= 0:
        raise ValueError("a stage needs steps > 0 or tokens > 0 (config.stageN.steps / .tokens).")
    return max(1, math.ceil(tokens / (int(stage_cfg.batch_size) * int(stage_cfg.seq_len))))


class TeacherHandle:
    """The frozen teacher, split once and placed on the mesh once; passed to every step as an argument."""

    def __init__(self, teacher: nnx.Module, mesh):
        self.graphdef, state = nnx.split(teacher)
        shardings = shd.state_shardings(state, mesh)
        self.state = jax.device_put(nnx.as_pure(state), shardings)
        self.shardings = shardings


def run_stage(
    spec: StageSpec,
    *,
    student_graphdef,
    abstract_student,
    initial_student: Callable[[], Any],
    teacher: TeacherHandle | None,
    mesh,
    workdir: Path,
    logging_cfg,
) -> Any:
    """Train (or resume, or skip when finished) one stage; returns the student's final full pure state."""
    scfg = spec.stage_cfg
    full_shardings = shd.state_shardings(abstract_student, mesh)
    # Checkpoints hold trained parameters in their master dtype: restore every Param as f32 (exact for any stored
    # dtype); _train casts each half back to the dtype it trains or computes in.
    abs_full = abstract_with_shardings(nnx.as_pure(f32_param_target(abstract_student)), full_shardings)
    ckpt = StageCheckpointer(
        spec.directory,
        save_every=int(scfg.checkpoint_every),
        keep=int(scfg.keep_checkpoints),
        async_save=bool(logging_cfg.get("async_save", True)),
    )
    try:
        if ckpt.done:
            restored = ckpt.restore_model(abs_full)
            if restored is not None:
                print(f"[{spec.directory.name}] finished earlier; using its final checkpoint.", flush=True)
                return restored
            print(f"[{spec.directory.name}] final checkpoint unusable; resuming the stage.", flush=True)
        return _train(
            spec,
            ckpt,
            student_graphdef,
            abstract_student,
            abs_full,
            full_shardings,
            initial_student,
            teacher,
            mesh,
            workdir,
            logging_cfg,
        )
    finally:
        ckpt.close()


def _split(graphdef, full_state, trainable, layout):
    """(trained params in the master dtype, frozen Variables in the model's dtypes) of a full pure state."""
    _, params, frozen = nnx.split(nnx.merge(graphdef, full_state), trainable, ...)
    return cast_like(nnx.as_pure(params), layout.abstract_state["params"]), cast_like(
        nnx.as_pure(frozen), layout.abstract_state["frozen"]
    )


def _check_memory(compiled, spec, step_settings, data_parallel):
    usage = memory.StepMemory.from_compiled(compiled)
    limit = memory.device_memory_limit()
    memory.report_step_memory(usage, limit, name=spec.directory.name, directory=spec.directory)
    memory.check_fits(
        usage,
        limit,
        where=f"config.{spec.config_key}",
        micro_batches=step_settings.micro_batches,
        batch_size=int(spec.stage_cfg.batch_size),
        data_parallel=data_parallel,
    )


def _train(
    spec,
    ckpt,
    student_graphdef,
    abstract_student,
    abs_full,
    full_shardings,
    initial_student,
    teacher,
    mesh,
    workdir,
    logging_cfg,
):
    scfg = spec.stage_cfg
    steps = total_steps(scfg)
    data_parallel = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
    try:
        settings, step_settings = stage_settings(scfg, spec.kind, data_parallel)
    except ValueError as error:
        raise ValueError(f"config.{spec.config_key}: {error}") from None
    if settings.needs_teacher and teacher is None:
        raise ValueError(f"stage {spec.config_key} ({spec.kind}) needs the teacher.")
    tx, schedule = stage_optimizer(scfg, steps)

    # Structure, dtypes and shardings of the trained (master) / frozen halves and of the optimizer state.
    layout = stage_layout(student_graphdef, abstract_student, spec.trainable, tx, mesh, step_settings)
    gd, state_sh, batch_sh = layout.graphdef, layout.shardings, layout.batch_sharding
    if not jax.tree.leaves(layout.model_params):
        raise ValueError(
            f"stage {spec.config_key}: the 'train' filter selects no parameters "
            f"(config.{spec.config_key}.train={scfg.train!r})."
        )
    abs_opt = layout.abstract_state["opt_state"]

    iterator = spec.make_iterator()
    restored = ckpt.restore_latest(abs_full, abs_opt, iterator)
    if restored is not None:
        start, full, opt_state, meta = restored
        print(f"[{spec.directory.name}] resuming from step {start}/{steps}", flush=True)
        params, frozen = _split(student_graphdef, full, spec.trainable, layout)
    else:
        start = 0
        full = jax.device_put(initial_student(), full_shardings)
        params, frozen = _split(student_graphdef, full, spec.trainable, layout)
        opt_state = jax.jit(tx.init, out_shardings=state_sh["opt_state"])(params)
    state = {
        "params": params,
        "frozen": frozen,
        "opt_state": opt_state,
        "step": jax.device_put(np.int32(start), shd.replicated(mesh)),
    }
    state = jax.device_put(state, state_sh)

    if start >= steps:
        ckpt.mark_done(start)
        return _full_state(gd, state)

    step_fn = make_train_step(
        gd,
        None if teacher is None else teacher.graphdef,
        tx,
        settings,
        schedule,
        step_settings=step_settings,
        model_params=layout.model_params,
        batch_sharding=layout.batch_sharding,
    )
    teacher_state = teacher.state if (teacher is not None and settings.needs_teacher) else None
    teacher_sh = teacher.shardings if teacher_state is not None else None
    jstep = jit_train_step(step_fn, layout, teacher_sh)

    tokens_per_step = int(scfg.batch_size) * int(scfg.seq_len)
    logger = StageLogger(
        workdir,
        spec.directory.name,
        total_steps=steps,
        start_step=start,
        tokens_per_step=tokens_per_step,
        tensorboard=bool(logging_cfg.tensorboard),
        progress=bool(logging_cfg.progress),
    )
    last_good = ckpt.steps()[-1] if ckpt.steps() else None
    compiled = None
    try:
        for step in range(start, steps):
            batch = shd.put_batch(next(iterator), batch_sh)
            if compiled is None:  # compile once, report its memory and refuse a step that cannot fit, then run it
                compiled = jstep.lower(state, teacher_state, batch).compile()
                _check_memory(compiled, spec, step_settings, data_parallel)
            state, metrics = compiled(state, teacher_state, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            done = step + 1
            check_finite(done, spec.config_key, metrics, last_good, ckpt.directory)
            logger.log(done, metrics)
            if ckpt.save(done, _full_state(gd, state), state["opt_state"], iterator, spec.meta, force=done == steps):
                last_good = done
    finally:
        logger.close()
        ckpt.wait()  # the last good checkpoint is complete on disk before we leave, error or not
    ckpt.mark_done(steps)
    print(f"[{spec.directory.name}] done: {steps} steps, final loss {metrics['loss']:.4f}", flush=True)
    return _full_state(gd, state)


def _full_state(graphdef, state):
    """The student's full pure state (trained + frozen Variables), sharing the arrays (no copy)."""
    _, full = nnx.split(nnx.merge(graphdef, state["params"], state["frozen"]))
    return nnx.as_pure(full)
