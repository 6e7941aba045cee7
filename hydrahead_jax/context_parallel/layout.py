"""Token order under context parallelism: which tokens of a row each device of the ``sequence`` axis holds.

A row of T tokens split over n devices is cut into chunks. Two layouts:

- ``"contiguous"``: n chunks of T/n; device i holds chunk i.
- ``"zigzag"``: 2n chunks of c = T/(2n); device i holds chunks i and 2n−1−i, in that order. Under a causal mask
  chunk j attends to j+1 chunks, so the contiguous layout gives device i (i+1) units of work and the last device n
  times the first's; pairing an early chunk with a late one gives every device (i+1) + (2n−i) = 2n+1.

The sharded order is the row's tokens rearranged so that a plain split of the time axis into n equal parts gives
each device its chunks: ``to_layout`` (natural → sharded order) and ``from_layout`` (back). The model keeps its
activations in the sharded order (``MODEL_LAYOUT``) between the embedding and the final norm; the context-parallel
kernels read ``shard_chunks`` to know which natural chunks they hold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag")
MODEL_LAYOUT = "zigzag"  # the order the model uses whenever the sequence axis is larger than 1


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"sequence layout must be one of {LAYOUTS}; got {layout!r}.")


def chunks_per_shard(layout: str) -> int:
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


def chunk_order(n: int, layout: str) -> np.ndarray:
    """Natural chunk index of each chunk position of the sharded order (n·chunks_per_shard entries)."""
    check_layout(layout)
    if layout == "contiguous":
        return np.arange(n)
    return np.array([j for i in range(n) for j in (i, 2 * n - 1 - i)])


def check_length(length: int, n: int, layout: str) -> None:
    """A row of ``length`` tokens must split into n·chunks_per_shard equal chunks."""
    parts = n * chunks_per_shard(layout)
    if length % parts:
        raise ValueError(
            f"a sequence of {length} tokens does not split into {parts} equal chunks ({layout} layout over a "
            f"sequence axis of {n}); use a sequence length that is a multiple of {parts}."
        )


def _reorder(x: jax.Array, order: np.ndarray, axis: int) -> jax.Array:
    axis = axis % x.ndim
    parts = len(order)
    shape = x.shape
    chunks = x.reshape(*shape[:axis], parts, shape[axis] // parts, *shape[axis + 1 :])
    return jnp.take(chunks, jnp.asarray(order), axis=axis).reshape(shape)


def to_layout(x: jax.Array, n: int, layout: str, axis: int = 1) -> jax.Array:
    """Natural token order → the sharded order of ``layout`` over n devices (along ``axis``)."""
    check_length(x.shape[axis], n, layout)
    return _reorder(x, chunk_order(n, layout), axis)


def from_layout(x: jax.Array, n: int, layout: str, axis: int = 1) -> jax.Array:
    """The sharded order of ``layout`` over n devices → natural token order (inverse of ``to_layout``)."""
    check_length(x.shape[axis], n, layout)
    return _reorder(x, np.argsort(chunk_order(n, layout)), axis)


def shard_chunks(shard: jax.Array | int, n: int, layout: str) -> jax.Array:
    """Natural chunk indices [chunks_per_shard] held by device ``shard`` (may be traced: ``lax.axis_index``), in
    the order the device stores them."""
    check_layout(layout)
    shard = jnp.asarray(shard, jnp.int32)
    if layout == "contiguous":
        return shard[None]
    return jnp.stack([shard, 2 * n - 1 - shard])
