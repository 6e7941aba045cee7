"""Per-device memory of a compiled train step, held against the device's memory before the first step runs.

XLA's ``compiled.memory_analysis()`` gives the sizes of one device's buffers of the SPMD-partitioned step:

    peak ≈ arguments + outputs − aliased + temporaries

(arguments: this device's shard of the train state, the teacher and the batch; outputs: the new state and the
metrics; aliased: outputs written into donated arguments, i.e. the train state, counted once; temporaries: the
activations kept for the backward pass, gradients, the logits tile, XLA's scratch). The device's memory comes from
``device.memory_stats()["bytes_limit"]`` where the backend reports it (GPU, TPU); CPU reports none.

When the step does not fit, the error suggests a ``micro_batches`` value from a linear model: temporaries scale
with the rows of one micro-batch (activations dominate them), the rest does not,

    peak(M') ≈ (peak − temporaries) + temporaries · M / M'

an estimate (the logits tile and the gradient buffers do not shrink with M'): ``scripts/memory_plan.py`` compiles
the candidates and reports the real figure.

Context parallelism (``mesh.sequence`` = n > 1) splits each row's tokens over n devices, so the activations one
device keeps scale with (rows per data-parallel device) × seq_len / n; the plan compiles the step under the same
mesh as the trainer (``plan_stage``), so the figure includes that split and the collectives' buffers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax

log = logging.getLogger(__name__)

GiB = 1024**3


class MemoryBudgetError(RuntimeError):
    """A compiled step needs more memory per device than the device has."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes one device needs for one compiled step (XLA memory analysis)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @classmethod
    def from_compiled(cls, compiled) -> StepMemory:
        m = compiled.memory_analysis()
        if m is None:
            raise RuntimeError("this backend's compiled executables report no memory analysis.")
        return cls(
            arguments=int(m.argument_size_in_bytes),
            outputs=int(m.output_size_in_bytes),
            aliased=int(m.alias_size_in_bytes),
            temporaries=int(m.temp_size_in_bytes),
        )

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def to_dict(self) -> dict[str, int]:
        return dict(dataclasses.asdict(self), peak=self.peak)

    def describe(self, limit: int | None = None) -> str:
        g = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
        text = (
            f"per device: peak {g(self.peak)} = arguments {g(self.arguments)} + outputs {g(self.outputs)} "
            f"- aliased {g(self.aliased)} + temporaries {g(self.temporaries)}"
        )
        if limit:
            text += f"; device memory {g(limit)} ({100 * self.peak / limit:.0f} % used)"
        return text


def device_memory_limit(device=None) -> int | None:
    """Bytes the backend lets one device allocate, or None where it does not say (CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 — backends without the query raise instead of returning None
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def valid_micro_batches(batch_size: int, data_parallel: int) -> list[int]:
    """Micro-batch counts M that split batch_size rows into equal groups divisible over the data-parallel devices."""
    return [m for m in range(1, batch_size + 1) if batch_size % m == 0 and (batch_size // m) % data_parallel == 0]


def suggest_micro_batches(
    memory: StepMemory, limit: int, *, micro_batches: int, batch_size: int, data_parallel: int
) -> int | None:
    """The smallest valid M' > M whose estimated peak (module docstring) fits ``limit``; None when none does."""
    fixed = memory.peak - memory.temporaries
    for m in valid_micro_batches(batch_size, data_parallel):
        if m > micro_batches and fixed + memory.temporaries * micro_batches / m <= limit:
            return m
    return None


def check_fits(
    memory: StepMemory,
    limit: int | None,
    *,
    where: str,
    micro_batches: int,
    batch_size: int,
    data_parallel: int,
) -> None:
    """Raise MemoryBudgetError (with the fix) when ``memory.peak`` exceeds ``limit``; no-op when limit is None."""
    if limit is None or memory.peak <= limit:
        return
    suggestion = suggest_micro_batches(
        memory, limit, micro_batches=micro_batches, batch_size=batch_size, data_parallel=data_parallel
    )
    if suggestion is not None:
        fix = (
            f"set {where}.micro_batches={suggestion} (estimated; confirm with scripts/memory_plan.py), or lower "
            f"{where}.loss_chunk_rows / loss_chunk, turn on {where}.remat, shard over more fsdp devices, or split "
            "each row's tokens over more devices (config.mesh.sequence)"
        )
    else:
        fix = (
            f"even micro_batches={batch_size // data_parallel} (one row per device) is estimated not to fit: shard "
            f"over more fsdp devices, split each row's tokens over more devices (config.mesh.sequence: activations "
            f"scale with seq_len / sequence), turn on {where}.remat, lower {where}.seq_len or loss_chunk"
        )
    raise MemoryBudgetError(
        f"{where}: the compiled step needs {memory.peak / GiB:.2f} GiB per device but the device has "
        f"{limit / GiB:.2f} GiB ({memory.describe()}). Fix: {fix}."
    )


def report_step_memory(memory: StepMemory, limit: int | None, *, name: str, directory: Path | None = None) -> str:
    """Print and log the step's memory; also write it to ``directory/memory.json`` when given."""
    line = f"[{name}] compiled step memory {memory.describe(limit)}"
    print(line, flush=True)
    log.info(line)
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "memory.json").write_text(
            json.dumps(dict(memory.to_dict(), device_limit=limit), indent=2, sort_keys=True)
        )
    return line


# ------------------------------------------------------------------------------------------------ compile-only plan
def plan_stage(run, kind: str, cfg, head_map, mesh, *, micro_batches: int | None = None) -> StepMemory:
    """Per-device memory of stage ``kind``'s train step for the RunConfig ``run`` on ``mesh``, compiled from abstract shapes
    only (``nnx.eval_shape`` models, ShapeDtypeStruct state and batch): nothing is allocated or run.

    ``cfg`` is the teacher's ModelConfig (its dtypes are the run's), ``head_map`` the student's; ``micro_batches``
    overrides the stage's setting. The step is built by the trainer's own functions (stage_layout,
    make_train_step, jit_train_step), so the figure is the one the trainer prints at the stage's start.
    """
    from flax import nnx

    from hydrahead_jax.data.rows import FEATURES
    from hydrahead_jax.hybrid import build_model
    from hydrahead_jax.hybrid.build import fa_slice_mask, trainable_filter
    from hydrahead_jax.models import Transformer
    from hydrahead_jax.run_config import STAGES
    from hydrahead_jax.training import sharding as shd
    from hydrahead_jax.training.steps import (
        abstract_with_shardings,
        jit_train_step,
        make_train_step,
        stage_layout,
        stage_optimizer,
        stage_settings,
    )

    stage = next(s for s in STAGES if s.name == kind)
    key = stage.config_key
    scfg = run.stage(stage)
    data_parallel = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
    if micro_batches is not None:
        scfg = dataclasses.replace(scfg, micro_batches=int(micro_batches))
    try:
        loss, step_settings = stage_settings(scfg, stage.loss, data_parallel, run.data.mask_documents)
    except ValueError as error:
        raise ValueError(f"config.{key}: {error}") from None
    tx, _ = stage_optimizer(scfg, scfg.total_steps, fa_slice_mask(scfg.train, head_map.fa_counts(), cfg.num_kv_heads))
    graphdef, abstract_student = nnx.split(nnx.eval_shape(lambda: build_model(cfg, head_map, run.hybrid, nnx.Rngs(0))))
    trainable = trainable_filter(scfg.train, scfg.lr_scales)
    layout = stage_layout(graphdef, abstract_student, trainable, tx, mesh, step_settings)

    t_graphdef, t_abstract, t_shardings = None, None, None
    if loss.needs_teacher:
        t_graphdef, t_state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
        t_shardings = shd.state_shardings(t_state, mesh)
        t_abstract = abstract_with_shardings(nnx.as_pure(t_state), t_shardings)
    rows = (scfg.batch_size, scfg.seq_len)
    batch = {
        name: jax.ShapeDtypeStruct(rows, "float32" if name == "loss_mask" else "int32", sharding=layout.batch_sharding)
        for name in FEATURES
    }
    step = make_train_step(
        layout.graphdef,
        t_graphdef,
        tx,
        loss,
        step_settings=step_settings,
        model_params=layout.model_params,
        batch_sharding=layout.batch_sharding,
    )
    learning_rate = jax.ShapeDtypeStruct((), "float32", sharding=layout.shardings["step"])
    with jax.set_mesh(mesh):  # traced as the trainer traces it: kernels and context parallelism see the mesh
        jitted = jit_train_step(step, layout, t_shardings)
        compiled = jitted.lower(layout.abstract_state, t_abstract, batch, learning_rate).compile()
    return StepMemory.from_compiled(compiled)
