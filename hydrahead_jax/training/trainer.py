"""One training stage: shard, restore or initialise, run the jitted step, log, checkpoint, finish.

State interchange between stages is the student's *full* pure state (every Variable, ``nnx.as_pure``) plus its
graphdef; inside a stage it is split into the trained Params and the rest by the stage's filter.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from hydrahead_jax.run_config import LoggingConfig, Stage, StageConfig
from hydrahead_jax.training import memory
from hydrahead_jax.training import sharding as shd
from hydrahead_jax.training.checkpoint import StageCheckpointer, finished_step
from hydrahead_jax.training.data import DataPosition
from hydrahead_jax.training.metrics import StageLogger, all_finite, check_finite
from hydrahead_jax.training.steps import (
    abstract_with_shardings,
    cast_like,
    f32_param_target,
    jit_eval_step,
    jit_train_step,
    make_eval_step,
    make_train_step,
    stage_layout,
    stage_optimizer,
    stage_settings,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StageSpec:
    """Everything one stage needs, resolved from the RunConfig by the pipeline."""

    stage: Stage  # its row of the stage table
    config: StageConfig
    directory: Path
    trainable: Any  # nnx filter of the trained parameters
    make_iterator: Callable[[int], Any]  # global batch i -> grain DatasetIterator of global batches from i on
    meta: dict[str, Any]  # config hash and resolved config, stored in every checkpoint
    mask_documents: bool = True  # config.data.mask_documents: packed documents run each on its own
    # The stage's fixed held-out batch, whole ([rows, seq_len] per feature, the same on every process:
    # ``training.data.make_heldout_batch``), or None: no held-out evaluation.
    heldout: dict[str, np.ndarray] | None = None
    update_mask: Any = None  # the slices of the trained parameters that stay fixed (hybrid.build.fa_slice_mask)


class Preempted(RuntimeError):
    """SIGTERM stopped a stage after its last finished step was checkpointed; train.py exits with status 143."""


# Every call of the preemption sync point in this process, counted across stages. The coordination service agrees
# on a count (one past the furthest process's); every process runs the same stages and steps, asking once per step,
# so one count is the same step on every process.
_SYNC_POINTS = itertools.count()


class PreemptionWatch:
    """Whether to stop for a preemption notice (SIGTERM), asked before each step (a step in flight finishes first).

    One process: a SIGTERM handler sets a flag. It is installed in the main thread only (signal handlers can be set
    nowhere else); ``close`` restores the previous handler, so SIGTERM outside a train loop keeps its default effect.

    Several processes: all must stop after the same step and save it together (a save is collective), whichever of
    them got the notice, or one waits in a save the others never start. ``jax.distributed.initialize`` starts the
    coordination service's preemption notifier, which owns SIGTERM from then on and passes a notice to every
    process; ``multihost_utils.reached_preemption_sync_point`` then answers True on all of them at the same count
    (Orbax's and MaxText's mechanism). No Python handler is installed (it would replace the notifier's); a notice
    outside a train loop stops the next one before its first step (after it, for a notice before the run's first)."""

    def __init__(self):
        self.coordinated = jax.process_count() > 1
        self.requested = False
        self._previous = None
        if not self.coordinated and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def stop_now(self) -> bool:
        """Whether to checkpoint the last finished step and stop; every process gets the same answer (each asks
        once per step)."""
        if not self.coordinated:
            return self.requested
        try:
            return multihost_utils.reached_preemption_sync_point(next(_SYNC_POINTS))
        except RuntimeError:  # jax_enable_preemption_service=False: no notifier, SIGTERM ends the process (Orbax's way)
            return False

    def close(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class TeacherHandle:
    """The frozen teacher, split once and placed on the mesh once; passed to every step as an argument."""

    def __init__(self, teacher: nnx.Module, mesh):
        self.graphdef, state = nnx.split(teacher)
        shardings = shd.state_shardings(state, mesh)
        self.state = jax.device_put(nnx.as_pure(state), shardings)
        self.shardings = shardings


class _InThread:
    """``fn()`` run in a daemon thread from construction on; ``result()`` waits for it and returns its value or
    raises its exception. For XLA compilation, which releases the GIL: a second program compiles on another core
    while the main thread compiles the train step (daemon: a run that fails meanwhile does not wait for it)."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn):
        try:
            self._value = fn()
        except BaseException as error:  # handed to the caller of result()
            self._error = error

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class HeldoutEval:
    """The stage's fixed held-out batch placed on the mesh, and its jitted evaluation (``steps.make_eval_step``).

    Every process holds the whole batch (it is small, and a function of the config alone) and takes its devices'
    blocks of it, so all processes evaluate the same global batch without reading per-process rows. The rows are
    padded to a multiple of the data-parallel devices (and of the loss's row tiles) with copies of the first row
    whose loss_mask is 0: every metric is a masked token mean, so padding changes no value. A batch of more rows
    than one of the train step's micro-batches is evaluated in groups of that many rows (the activations of one
    group alive, as in training).

    The evaluation is traced here, against the stage's initial ``state``, and compiled in a background thread
    (``_InThread``): a stage's first held-out point comes right after its train step has compiled, so the two
    compilations (each a minute or more for SmolLM2 on one CPU core) overlap instead of running one after the other.
    """

    def __init__(self, batch, stage_cfg, layout, settings, step_settings, teacher: TeacherHandle, mesh, state):
        rows = len(batch["input_ids"])
        self.shape = (rows, int(batch["input_ids"].shape[1]))
        data_parallel = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
        group_rows = stage_cfg.batch_size // step_settings.micro_batches  # a multiple of data_parallel (checked)
        padded = -(-rows // data_parallel) * data_parallel
        groups = 1
        if padded > group_rows:
            groups = -(-rows // group_rows)
            padded = groups * group_rows
        elif settings.chunk_rows and settings.chunk_rows < padded:
            padded = -(-padded // settings.chunk_rows) * settings.chunk_rows
        extra = padded - rows
        host = {k: np.concatenate([v, np.repeat(v[:1], extra, axis=0)]) for k, v in batch.items()}
        host["loss_mask"][rows:] = 0
        sharding = layout.batch_sharding
        self.batch = {
            k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index]) for k, v in host.items()
        }
        fn = make_eval_step(
            layout.graphdef,
            teacher.graphdef,
            settings,
            step_settings=step_settings,
            model_params=layout.model_params,
            batch_sharding=sharding,
            groups=groups,
        )
        self._teacher_state, self._mesh = teacher.state, mesh
        with jax.set_mesh(mesh):  # the model's kernels shard_map over the ambient mesh (models/kernel_sharding)
            lowered = jit_eval_step(fn, layout, teacher.shardings).lower(
                state["params"], state["frozen"], teacher.state, self.batch
            )
        self._compiled = _InThread(lowered.compile, name="compile-heldout-eval")

    def __call__(self, state) -> dict[str, float]:
        """The held-out metrics of the train state ``state`` (read back: waits for them)."""
        evaluate = self._compiled.result()
        with jax.set_mesh(self._mesh):
            metrics = evaluate(state["params"], state["frozen"], self._teacher_state, self.batch)
        return {k: float(v) for k, v in jax.device_get(metrics).items()}


def run_stage(
    spec: StageSpec,
    *,
    student_graphdef,
    abstract_student,
    initial_student: Callable[[], Any],
    teacher: TeacherHandle | None,
    mesh,
    workdir: Path,
    logging_cfg: LoggingConfig,
) -> Any:
    """Train (or resume, or skip when finished) one stage; returns the student's final full pure state."""
    scfg = spec.config
    full_shardings = shd.state_shardings(abstract_student, mesh)
    # Checkpoints hold trained parameters in their master dtype: restore every Param as f32 (exact for any stored
    # dtype); _train casts each half back to the dtype it trains or computes in.
    abs_full = abstract_with_shardings(nnx.as_pure(f32_param_target(abstract_student)), full_shardings)
    ckpt = StageCheckpointer(
        spec.directory,
        save_every=scfg.checkpoint_every,
        keep=scfg.keep_checkpoints,
        async_save=logging_cfg.async_save,
        stage=spec.stage.name,
    )
    try:
        final_step = finished_step(spec.directory)
        if final_step is not None and final_step < scfg.total_steps:
            print(
                f"[{spec.directory.name}] finished earlier at step {final_step}; continuing to step "
                f"{scfg.total_steps} (config.{spec.stage.config_key} now asks for more).",
                flush=True,
            )
            ckpt.clear_done()
        elif ckpt.done:
            restored = ckpt.restore_model(abs_full)
            if restored is not None:
                print(f"[{spec.directory.name}] finished earlier; using its final checkpoint.", flush=True)
                return restored
            print(f"[{spec.directory.name}] final checkpoint damaged; resuming the stage.", flush=True)
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
        where=f"config.{spec.stage.config_key}",
        micro_batches=step_settings.micro_batches,
        batch_size=spec.config.batch_size,
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
    scfg, key = spec.config, spec.stage.config_key
    steps = scfg.total_steps
    data_parallel = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
    try:
        settings, step_settings = stage_settings(scfg, spec.stage.loss, data_parallel, spec.mask_documents)
    except ValueError as error:
        raise ValueError(f"config.{key}: {error}") from None
    if settings.needs_teacher and teacher is None:
        raise ValueError(f"stage {key} ({spec.stage.name}) needs the teacher.")
    tx, schedule = stage_optimizer(scfg, steps, spec.update_mask)

    # Structure, dtypes and shardings of the trained (master) / frozen halves and of the optimizer state.
    layout = stage_layout(student_graphdef, abstract_student, spec.trainable, tx, mesh, step_settings)
    gd, state_sh, batch_sh = layout.graphdef, layout.shardings, layout.batch_sharding
    if not jax.tree.leaves(layout.model_params):
        raise ValueError(f"stage {key}: the 'train' filter selects no parameters (config.{key}.train={scfg.train!r}).")
    abs_opt = layout.abstract_state["opt_state"]

    had_checkpoints = bool(ckpt.steps())
    restored = ckpt.restore_latest(abs_full, abs_opt, scfg.batch_size)
    if restored is None and had_checkpoints:
        # Only damage of every step's own files gets here (any other failure stops the run, nothing moved).
        damaged = "; ".join(f"step {step}: {what}" for step, what in ckpt.quarantined)
        print(
            f"WARNING: [{spec.directory.name}] every checkpoint of this stage is damaged ({damaged}; moved to "
            f"{ckpt.directory / 'corrupt'}); starting the stage over from step 0.",
            flush=True,
        )
    resumed = restored is not None
    if resumed:
        start, full, opt_state, position = restored
        print(f"[{spec.directory.name}] resuming from step {start}/{steps}", flush=True)
        params, frozen = _split(student_graphdef, full, spec.trainable, layout)
    else:
        start, position = 0, DataPosition(0, scfg.batch_size)  # a fresh run's data, from its first batch
        full = jax.device_put(initial_student(), full_shardings)
        params, frozen = _split(student_graphdef, full, spec.trainable, layout)
        opt_state = jax.jit(tx.init, out_shardings=state_sh["opt_state"])(params)
    # The full state is now held as (params in the master dtype, frozen): drop it, so a model-sized copy does not
    # stay alive through the whole stage (the previous stage's state, for a fresh stage: the pipeline hands it over).
    del full, restored
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
        step_settings=step_settings,
        model_params=layout.model_params,
        batch_sharding=layout.batch_sharding,
    )
    teacher_state = teacher.state if (teacher is not None and settings.needs_teacher) else None
    teacher_sh = teacher.shardings if teacher_state is not None else None
    jstep = jit_train_step(step_fn, layout, teacher_sh)
    # The schedule's value at every step, on the host: each step gets its own as an argument (make_train_step).
    learning_rates = np.asarray(schedule(np.arange(steps)), np.float32)
    iterator = spec.make_iterator(position.batches)  # one global batch per step from here on

    def position_at(step: int) -> DataPosition:
        return position.advanced(step - start)

    heldout = None
    if spec.heldout is not None and scfg.heldout_rows > 0:
        if teacher is None:
            raise ValueError(
                f"stage {key}: the held-out evaluation compares the student with the teacher; pass the teacher or "
                f"set config.{key}.heldout_rows=0."
            )
        heldout = HeldoutEval(spec.heldout, scfg, layout, settings, step_settings, teacher, mesh, state)
    every = scfg.heldout_every

    def heldout_due(step: int) -> bool:
        """Held-out points: step 0 (before any update), every ``heldout_every`` steps, the last step."""
        return heldout is not None and (step in (0, steps) or (every > 0 and step % every == 0))

    logger = StageLogger(
        workdir,
        spec.directory.name,
        total_steps=steps,
        start_step=start,
        tokens_per_step=scfg.tokens_per_step,
        tensorboard=logging_cfg.tensorboard,
        progress=logging_cfg.progress,
        heldout_file=spec.directory / "heldout.json",
        heldout_shape=None if heldout is None else heldout.shape,
    )
    # A checkpoint holds the state S_n after step n's update. It is good only when the loss and gradients computed
    # FROM it (step n+1's metrics) are finite, so every save is provisional until those are read: a non-finite
    # step m retracts the checkpoint of S_{m-1} (written, or restored by a resume after a kill in between), and
    # the stage stops with the checkpoint before it kept. The final state has no next step in this stage; it is
    # kept when its own step's metrics and its parameters are finite.
    saved = ckpt.steps()
    last_good = saved[-1] if saved else None
    unconfirmed = start if resumed else None  # the restored state's own loss is not known yet

    def report(step: int, device_metrics) -> dict[str, float]:
        """Read back one step's metrics (waits for that step only), stop on a non-finite value, log them."""
        nonlocal last_good, unconfirmed
        metrics = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        if not all_finite(metrics):
            last_good = ckpt.retract_from(step - 1)  # S_{step-1} produced the non-finite values
            check_finite(step, key, metrics, last_good, ckpt.directory)
        if unconfirmed is not None and step == unconfirmed + 1:
            last_good, unconfirmed = unconfirmed, None
        logger.log(step, metrics)
        return metrics

    # One device-side reduction (a bool read back) over the trained parameters, before each save.
    params_finite = jax.jit(lambda tree: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)])))

    # The host runs one step ahead of its read-backs: step n is dispatched, then step n-1's metrics are read
    # (computed by then, so reading them does not leave the device idle).
    pending = None  # (step, its metrics still on the device)
    metrics: dict[str, float] = {}
    compiled = None
    preemption = PreemptionWatch()
    try:
        # A held-out point's row is logged before that step's checkpoint is saved: a resumed stage finds the rows
        # of every held-out point up to its checkpoint in metrics.jsonl (step 0's among them) and evaluates none
        # of them again; rows past the checkpoint are dropped by the logger and logged again. Step 0's point (the
        # state before any update) is evaluated once the train step has compiled, so that the held-out step,
        # compiling in the background since HeldoutEval was built, compiles meanwhile.
        for step in range(start, steps):
            if preemption.stop_now():
                # SIGTERM (a preempted TPU VM, SLURM's notice; on several processes, to any of them): checkpoint the
                # last finished step and stop, every process at the same step.
                if pending is not None:
                    metrics, pending = report(*pending), None
                if step > 0 and ckpt.latest_step() != step and bool(params_finite(state["params"])):
                    full = _full_state(gd, state)
                    ckpt.save(step, full, state["opt_state"], position_at(step), spec.meta, force=True)
                ckpt.wait()
                kept = ckpt.latest_step()
                raise Preempted(
                    f"stage {key} stopped by SIGTERM after step {step}/{steps}; the checkpoint of step "
                    f"{'(none)' if kept is None else kept} is in {ckpt.directory}. Rerun the same command to resume."
                )
            batch = shd.put_batch(next(iterator), batch_sh)
            learning_rate = jax.device_put(learning_rates[step], state_sh["step"])  # replicated, as the step count
            with jax.set_mesh(mesh):  # the model's kernels shard_map over the ambient mesh (models/kernel_sharding)
                if compiled is None:  # compile once, report its memory and refuse a step that cannot fit
                    compiled = jstep.lower(state, teacher_state, batch, learning_rate).compile()
                    _check_memory(compiled, spec, step_settings, data_parallel)
                    if step == 0 and heldout_due(0):  # before the first update consumes (donates) the state
                        logger.log_heldout(0, heldout(state))
                state, device_metrics = compiled(state, teacher_state, batch, learning_rate)
            done = step + 1
            if pending is not None:
                metrics = report(*pending)
            pending = (done, device_metrics)
            if heldout_due(done):
                metrics, pending = report(*pending), None  # a non-finite step stops before its held-out row
                logger.log_heldout(done, heldout(state))
            if done == steps or ckpt.should_save(done):
                if pending is not None:
                    metrics, pending = report(*pending), None
                if not bool(params_finite(state["params"])):
                    check_finite(done, key, {"params": math.nan}, last_good, ckpt.directory)
                full = _full_state(gd, state)
                if ckpt.save(done, full, state["opt_state"], position_at(done), spec.meta, force=done == steps):
                    logger.flush()
                    unconfirmed = done
                    if done == steps:
                        last_good = done
        summary = logger.heldout_summary()
    finally:
        preemption.close()
        logger.close()
        ckpt.wait()  # the last good checkpoint is complete on disk before we leave, error or not
    ckpt.mark_done(steps)
    print(f"[{spec.directory.name}] done: {steps} steps, final loss {metrics['loss']:.4f}", flush=True)
    if summary is not None:
        print(summary, flush=True)
    return _full_state(gd, state)


def _full_state(graphdef, state):
    """The student's full pure state (trained + frozen Variables), sharing the arrays (no copy)."""
    _, full = nnx.split(nnx.merge(graphdef, state["params"], state["frozen"]))
    return nnx.as_pure(full)
