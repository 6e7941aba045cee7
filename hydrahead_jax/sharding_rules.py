"""The ONE table of logical-axis rules: which mesh axes a logical array dimension is split over.

Parameters carry logical axis names (``hydrahead_jax.models.layers``); ``hydrahead_jax.training.sharding`` places
parameters, optimizer slots and batches with this table, and ``hydrahead_jax.models.kernel_sharding`` runs the
kernels inside ``jax.shard_map`` over the axes it gives "batch" and "heads". It lives outside both packages so that
the model (which must not import ``training``) and the trainer read the same rules.

Mesh axes: ``data`` (pure data parallel), ``fsdp`` (data parallel with parameters sharded over it, ZeRO-3 style),
``sequence`` (context parallelism: the length dimension of activations is split over it; the attention kernels then
run their context-parallel forms, ``hydrahead_jax.context_parallel``), ``tensor`` (Megatron-style model parallel over
heads / MLP width / vocabulary). Parameters never carry the logical name "sequence": they are replicated over that
axis (split over ``fsdp`` when it is there).
"""

from __future__ import annotations

from typing import Any

MESH_AXES = ("data", "fsdp", "sequence", "tensor")  # tensor innermost: its collectives are the most frequent

# logical name -> mesh axis, tuple of mesh axes, or None (replicated). Keep this the only such table.
LOGICAL_AXIS_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "sequence": "sequence",  # the length dimension of activations (tokens)
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "norm": None,
    "layers": None,  # the leading axis of the stacked layers (models.transformer): every device holds all layers
}


class ShardingError(ValueError):
    """A mesh or logical-axis specification that cannot be realised on the available devices."""


def mesh_axes_for(name: str | None) -> tuple[str, ...]:
    """The mesh axes (in order) that the logical axis ``name`` is split over; () for None or a replicated name."""
    if name is None:
        return ()
    if name not in LOGICAL_AXIS_RULES:
        raise ShardingError(
            f"logical axis {name!r} has no rule; add it to LOGICAL_AXIS_RULES in "
            "hydrahead_jax/sharding_rules.py (map it to mesh axes or None)."
        )
    target = LOGICAL_AXIS_RULES[name]
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)
