"""Device mesh, and the placement of every parameter, optimizer slot and batch by the logical-axis rules.

Parameters carry logical axis names in their ``out_sharding`` metadata (``hydrahead_jax.models.layers``); the
rules of ``hydrahead_jax.sharding_rules`` turn a logical name into mesh axes. A dimension whose size does not
divide by the product of its mesh axes is replicated instead (e.g. 3 KV heads on a tensor axis of 2): correct
everywhere, logged once.

Mesh axes: ``data`` (pure data parallel), ``fsdp`` (data parallel with parameters sharded over it, ZeRO-3
style), ``sequence`` (context parallelism over the tokens of a row), ``tensor`` (Megatron-style model parallel over
heads / MLP width / vocabulary). All axes are ``AxisType.Auto`` so XLA's sharding propagation chooses the
collectives inside the jitted step; the attention kernels run inside ``jax.shard_map``
(``hydrahead_jax.models.kernel_sharding``).
"""

from __future__ import annotations

import logging
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hydrahead_jax.sharding_rules import (  # noqa: F401  (re-exported: the rules table lives there)
    LOGICAL_AXIS_RULES,
    MESH_AXES,
    ShardingError,
    mesh_axes_for,
)

log = logging.getLogger(__name__)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None, *, sequence: int = 1) -> Mesh:
    """Mesh with axes (data, fsdp, sequence, tensor); at most one size may be −1 and is filled with the remaining
    devices."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [int(data), int(fsdp), int(sequence), int(tensor)]
    if sizes.count(-1) > 1:
        raise ShardingError(f"mesh sizes {dict(zip(MESH_AXES, sizes))}: at most one axis may be -1 (fill).")
    if any(s == 0 or s < -1 for s in sizes):
        raise ShardingError(f"mesh sizes {dict(zip(MESH_AXES, sizes))} must be positive or -1.")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ShardingError(
                f"{len(devices)} devices cannot fill mesh {dict(zip(MESH_AXES, sizes))}: "
                f"{len(devices)} is not a multiple of {known}."
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ShardingError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices but "
            f"{len(devices)} are available; set one axis to -1 to fill."
        )
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_to_spec(logical: tuple[str | None, ...] | None, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for an array of ``shape`` whose dims carry ``logical`` names (None = unannotated)."""
    if not logical:
        return PartitionSpec()
    if len(logical) != len(shape):
        raise ShardingError(f"logical axes {logical} do not match an array of shape {shape}.")
    used: set[str] = set()
    parts = []
    for name, dim in zip(logical, shape):
        axes = tuple(a for a in mesh_axes_for(name) if a not in used)
        size = math.prod(mesh.shape[a] for a in axes) if axes else 1
        if axes and dim % size:
            log.info("dimension %s (%d) does not divide by mesh axes %s (%d): replicated", name, dim, axes, size)
            axes = ()
        used.update(axes)
        parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*parts)


def _logical_of(variable: nnx.Variable) -> tuple | None:
    meta = variable.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    return tuple(names) if names else None


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedSharding for every Variable of an nnx State (Variables or ShapeDtypeStructs inside), same structure
    as ``nnx.as_pure(state)``."""

    def one(v):
        if isinstance(v, nnx.Variable):
            value = v.get_value()
            return NamedSharding(mesh, logical_to_spec(_logical_of(v), tuple(value.shape), mesh))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over (data, fsdp), tokens (dimension 1) over sequence, the rest replicated."""
    logical = ("batch", "sequence", *(None,) * (ndim - 2))[:ndim]
    return NamedSharding(mesh, logical_to_spec(logical, (0,) * ndim, mesh))


def optimizer_shardings(tx, param_shapes, param_shardings, mesh: Mesh):
    """Shardings of ``tx.init(params)``: slots shaped like a parameter follow it (optax.tree_map_params);
    scalars (counts) are replicated."""
    import optax  # local: keeps this module importable without optax for mesh-only users

    opt_shapes = jax.eval_shape(tx.init, param_shapes)
    return optax.tree_map_params(
        tx, lambda _, s: s, opt_shapes, param_shardings, transform_non_params=lambda _: replicated(mesh)
    )


def _row_slices(sharding: NamedSharding, num_rows: int, addressable: bool) -> set[tuple[int, int]]:
    """The distinct (start, stop) row ranges of a [num_rows, ...] array under ``sharding`` that the devices
    hold: this process's (``addressable``) or all of them. The other dims are sized so that any split divides."""
    ndim = max(1, len(sharding.spec))
    shape = (num_rows,) + (math.prod(sharding.mesh.shape.values()),) * (ndim - 1)
    indices = sharding.addressable_devices_indices_map(shape) if addressable else sharding.devices_indices_map(shape)
    return {slice_ranges[0].indices(num_rows)[:2] for slice_ranges in indices.values()}


def process_batch_rows(sharding: NamedSharding, batch_size: int) -> tuple[int, ...]:
    """The rows of a global [batch_size, T, ...] batch placed by ``sharding`` that this process's devices hold,
    sorted: what this process's data iterator reads (``make_stage_iterator(batch_rows=...)``), whole rows.

    With the rows split over (data, fsdp) and processes laid out along them, process p of P holds the p-th
    contiguous block of B/P rows; where a row's tokens are split over a ``sequence`` axis that spans processes,
    those processes hold (and read) the same rows."""
    rows = set()
    for start, stop in _row_slices(sharding, batch_size, addressable=True):
        rows.update(range(start, stop))
    return tuple(sorted(rows))


def put_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Host batch (this process's rows, whole: every token) → global jax Arrays placed by ``sharding``.

    Single process: a plain device_put. Multi-process: the local batch holds the rows
    ``process_batch_rows(sharding, B)`` of the global batch of B rows (B follows from how many of the row
    blocks this process holds); each device gets its block of rows and its slice of their tokens.
    """
    if jax.process_count() == 1:
        return {k: jax.device_put(v, sharding) for k, v in batch.items()}
    local_rows = len(next(iter(batch.values())))
    row_blocks = len(_row_slices(sharding, jax.device_count(), addressable=False))
    held_blocks = len(_row_slices(sharding, row_blocks, addressable=True))
    global_rows = local_rows * row_blocks // held_blocks
    rows = process_batch_rows(sharding, global_rows)
    if len(rows) != local_rows or local_rows * row_blocks % held_blocks:
        raise ShardingError(
            f"this process holds {held_blocks} of {row_blocks} row blocks but its batch has {local_rows} rows; "
            "the data iterator must read process_batch_rows(sharding, batch_size) of every global batch."
        )
    position = {row: i for i, row in enumerate(rows)}

    def place(local: np.ndarray):
        def block(index):
            start, stop = index[0].indices(global_rows)[:2]
            first = position[start]  # a device's rows are consecutive in ``rows`` too (sorted, contiguous range)
            return local[(slice(first, first + stop - start),) + tuple(index[1:])]

        return jax.make_array_from_callback((global_rows,) + local.shape[1:], sharding, block)

    return {k: place(np.asarray(v)) for k, v in batch.items()}
