"""Run a kernel call inside ``jax.shard_map`` over the mesh axes that shard its batch and head dimensions.

A Pallas kernel is a custom call (Mosaic on TPU, Triton on GPU) that XLA's SPMD partitioner cannot split: on a
sharded operand, lowering fails ("Mosaic kernels cannot be automatically partitioned. Please wrap the call in a
shard_map"). Attention kernels are independent over batch rows and heads, so each device can run the kernel on its
own rows and heads:

    out[b ∈ shard_i, :, h ∈ shard_j] = kernel(x[b ∈ shard_i, :, h ∈ shard_j], …)     no communication

``kernel_call(kernel, *args, in_axes=..., out_axes=...)`` does that. Each array argument and output names its
dimensions with logical axes (``"batch"``, ``"heads"`` or None, as ``BTHD`` = (batch, time, heads, dim)); the
mesh axes come from the logical-axis rules (``hydrahead_jax.sharding_rules``: batch → (data, fsdp), heads →
tensor), restricted to the axes of the ambient mesh. The mesh is the one the caller traces under: ``jax.set_mesh``
(the trainer) or ``jax.sharding.use_abstract_mesh`` (compile-for-TPU tests), read with
``jax.sharding.get_abstract_mesh()``.

- No mesh, or a mesh of one device: the kernel is called as is (one device: nothing changes).
- A logical name's mesh axes are taken in rule order while every dimension carrying that name divides by their
  product (heads over tensor=2 with one KV head: heads stay whole); a dimension not split is replicated, and the
  devices along the unused axes compute the same values. This is correct for any shape; it only costs speed.
- Every non-manual mesh axis becomes manual inside the call, size-1 axes included (axes the kernel is not split
  over see replicated operands), so no Pallas call is ever left to the automatic partitioner. Inside an enclosing
  ``shard_map`` the axes it already made manual are left alone.
- GQA: query heads [.., Hq, ..] and KV heads [.., Hkv, ..] both carry "heads". With Hq = G·Hkv split into n
  contiguous shards, shard i holds query heads i·Hq/n … and KV heads i·Hkv/n …, exactly the KV heads those query
  heads read (h // G), so one name for both is right.

The XLA implementations are wrapped too: the same code path for every backend, and no reliance on the partitioner
for chunked scans.

Context parallelism: a layout that names the time dimension ``"sequence"`` (``BSHD``, ``BSH``, ``BS``) splits it
over the mesh axes of the logical name "sequence" (the ``sequence`` mesh axis). Attention over a split time axis is
not local, so only kernels written for it go there: the context-parallel forms in ``hydrahead_jax.context_parallel``,
which receive ``sequence_axes()`` as their collective axis name. A time dimension that does not divide over those
axes is an error (replicating it would silently gather the whole sequence on every device).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, PartitionSpec

from hydrahead_jax.sharding_rules import mesh_axes_for

Layout = tuple[str | None, ...]  # one logical axis name (or None) per array dimension

BTHD: Layout = ("batch", None, "heads", None)  # q/k/v/o [B, T, H, D]
BTH: Layout = ("batch", None, "heads")  # per-head scalars (gate g, β) [B, T, H]
BHD: Layout = ("batch", "heads", None)  # one token's q/k/v/o [B, H, D]
BH: Layout = ("batch", "heads")  # one token's g, β [B, H]
BHKV: Layout = ("batch", "heads", None, None)  # recurrent state [B, H, K, V]
BT: Layout = ("batch", None)  # per-token ids (segment ids of packed documents) [B, T]
# The same with the time dimension split over the sequence axes (context parallelism; see the module doc).
BSHD: Layout = ("batch", "sequence", "heads", None)
BSH: Layout = ("batch", "sequence", "heads")
BS: Layout = ("batch", "sequence")

log = logging.getLogger(__name__)


def _free_axes(mesh) -> tuple[str, ...]:
    """Mesh axes this call makes manual: all but those an enclosing shard_map already made manual (size-1 axes
    too: Mosaic refuses a call whose mesh keeps any axis automatic)."""
    return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != AxisType.Manual)


def sequence_axes() -> tuple[str, ...]:
    """The mesh axes that split the time dimension of activations (logical name "sequence") in the ambient mesh:
    those of size > 1 not already made manual by an enclosing ``shard_map``; () when there is no context
    parallelism. Context-parallel kernels use it as the axis name of their collectives."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    free = _free_axes(mesh)
    return tuple(a for a in mesh_axes_for("sequence") if a in free and mesh.shape[a] > 1)


def _split_axes(
    mesh, free: tuple[str, ...], args: Sequence[Any], in_axes: Sequence[Layout | None]
) -> dict[str, tuple[str, ...]]:
    """{logical name: mesh axes it is split over}: the rule's axes present in ``free``, in order, kept while every
    argument dimension carrying the name divides by their product (the rest of that name stays whole)."""
    sizes: dict[str, list[int]] = {}
    for x, layout in zip(args, in_axes):
        for name, dim in zip(layout or (), () if x is None else x.shape):
            if name is not None:
                sizes.setdefault(name, []).append(dim)
    used: set[str] = set()
    split: dict[str, tuple[str, ...]] = {}
    for name, dims in sizes.items():
        axes: list[str] = []
        for axis in mesh_axes_for(name):
            size = math.prod(mesh.shape[a] for a in axes) * mesh.shape[axis]
            if axis in free and axis not in used and all(d % size == 0 for d in dims):
                axes.append(axis)
        skipped = [a for a in mesh_axes_for(name) if a in free and a not in axes]
        if name == "sequence" and any(mesh.shape[a] > 1 for a in skipped):
            raise ValueError(
                f"kernel_call: time dimensions {dims} do not divide over the sequence mesh axes "
                f"{ {a: mesh.shape[a] for a in skipped} }; use a sequence length that is a multiple of 2 x the "
                "sequence axis size (context parallelism gives every device two equal chunks)."
            )
        if skipped:
            log.debug("kernel_call: %s sizes %s do not divide over mesh axes %s; not split there", name, dims, skipped)
        used.update(axes)
        split[name] = tuple(axes)
    return split


def _is_layout(x) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def _check_layouts(args: Sequence[Any], in_axes: Sequence[Layout | None], out_axes: Any) -> None:
    """Every argument has a layout naming each of its dimensions, and outputs name only axes the inputs name (the
    split is decided from the inputs): checked on every call, with or without a mesh."""
    if len(in_axes) != len(args):
        raise ValueError(f"kernel_call: {len(args)} arguments but {len(in_axes)} in_axes; give one layout each.")
    names: set[str] = set()
    for x, layout in zip(args, in_axes):
        if x is not None and (layout is None or len(layout) != x.ndim):
            raise ValueError(f"kernel_call: in_axes {layout} must name every dimension of an array of shape {x.shape}.")
        if x is not None:
            names.update(n for n in layout if n is not None)
    out_names = {n for layout in jax.tree.leaves(out_axes, is_leaf=_is_layout) for n in layout if n is not None}
    if out_names - names:
        raise ValueError(
            f"kernel_call: output axes {sorted(out_names - names)} name no input dimension; name them in in_axes."
        )


def _spec(layout: Layout, split: dict[str, tuple[str, ...]]) -> PartitionSpec:
    parts = []
    for name in layout:
        axes = split.get(name, ()) if name is not None else ()
        parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*parts)


def kernel_call(
    kernel: Callable[..., Any],
    *args: jax.Array | None,
    in_axes: Sequence[Layout | None],
    out_axes: Any,
) -> Any:
    """``kernel(*args)``, run per device inside ``jax.shard_map`` over the ambient mesh when it has one.

    args: arrays, or None for an absent optional operand (passed to ``kernel`` as None); in_axes: one ``Layout``
    per argument (None for a None argument); out_axes: the ``Layout`` of each output, in the structure ``kernel``
    returns (None where it returns None). Every logical name of ``out_axes`` must appear in ``in_axes``: the split
    is decided from the inputs. Static options go into ``kernel`` (``functools.partial``).
    """
    _check_layouts(args, in_axes, out_axes)
    mesh = jax.sharding.get_abstract_mesh()
    free = () if mesh.empty else _free_axes(mesh)
    if math.prod(mesh.shape[a] for a in free) == 1:
        return kernel(*args)
    split = _split_axes(mesh, free, args, in_axes)
    present = [i for i, x in enumerate(args) if x is not None]

    def per_device(*arrays):
        full = list(args)
        for i, x in zip(present, arrays):
            full[i] = x
        return kernel(*full)

    out_specs = jax.tree.map(lambda layout: _spec(layout, split), out_axes, is_leaf=_is_layout)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=tuple(_spec(in_axes[i], split) for i in present),
        out_specs=out_specs,
        axis_names=set(free),
        # The kernels' internal loops start their carries from constants, which the varying-manual-axes type check
        # rejects; the outputs are replicated over every axis out_specs leave out because the inputs are.
        check_vma=False,
    )(*(args[i] for i in present))
