"""Gated DeltaNet heads under context parallelism: the gated delta rule and the causal conv over a row whose tokens
are split over the ``sequence`` mesh axes.

Both functions run per device inside ``jax.shard_map`` (``kernel_call`` with ``BSHD``/``BSH``/``BS`` layouts): each
device holds ``chunks_per_shard(layout)`` chunks of c tokens of the row, in ``layout`` order (``layout.py``), and
``axis_name`` names the sequence mesh axes (a str or a tuple), the axis of their collectives. What crosses devices
is tiny (per chunk: a K×K and a K×V matrix per head, W−1 conv inputs, two segment ids); the activations never move.

The rule. For a chunk with q, k, g, β fixed, the recurrence

    S_t = α_t (I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ,     o_t = scale · S_tᵀ q̂_t       (S [K, V], α_t = e^{g_t})

is linear in (v, S_in) jointly, so with P_t = Π_{s≤t} α_s (I − β_s k̂_s k̂_sᵀ) (the chunk's tokens up to t):

    S_out = A · S_in + B,        A = P_c [K, K],  B = the chunk's final state from S_in = 0 [K, V]
    o_t   = o⁰_t + M_t · S_in,   M_t = scale · q̂_tᵀ P_t [K],  o⁰_t = the output from S_in = 0 [V]

Each column of S evolves on its own, so ONE call of the chunked rule on the value columns [v | 0_K] from the state
[0_{K×V} | I_K] gives all four: the first V output columns are o⁰, the last K are M; the first V final-state
columns are B, the last K are A (column i of A is the state that e_i becomes). The device's chunks are stacked
along the batch axis of that call. Then every device all-gathers (A_j, B_j) of all 2n chunks (n devices, zig-zag),
orders them naturally and folds, in fp32,

    S_0 = initial_state,   S_{j+1} = A_j · S̃_j + B_j,   S̃_j = [chunk j continues the document of chunk j−1] · S_j

(the fold is 2n tiny products, cheaper to repeat on every device than to pass around), and finishes its own
chunks with o = o⁰ + M · S̃_j. The row's final state is S_{2n}, the same on every device.

Packed documents (``segment_ids``): within a chunk the rule already restarts the state at every document start
and lets the chunk's first document start from the state handed in (A = 0 and M = 0 past a restart). A chunk
whose first token starts a new document must start from 0 instead: S̃_j = 0 when the chunk's first id differs
from chunk j−1's last id (the chunk-edge ids are all-gathered). Chunk 0 always starts from ``initial_state``.

Gradients: JAX autodiff through the all-gathers (their transposes are reduce-scatters) and the public rule's own
VJP: the state gradients flow back across devices by the same fold, transposed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hydrahead_jax.context_parallel.layout import check_layout, chunk_order, chunks_per_shard, shard_chunks
from pallas_kernels.gated_delta import chunk_gated_delta_rule

_HI = jax.lax.Precision.HIGHEST
AxisName = str | tuple[str, ...]


def _local_chunks(length: int, layout: str, what: str) -> tuple[int, int]:
    """(chunks this device holds, tokens per chunk) for ``length`` local tokens."""
    check_layout(layout)
    cps = chunks_per_shard(layout)
    if length % cps:
        raise ValueError(
            f"{what}: a device's {length} tokens do not split into the {cps} chunks of the {layout} layout; "
            f"use a row length that is a multiple of {cps} x the sequence axis size."
        )
    return cps, length // cps


def _gather_natural(x: jax.Array, axis_name: AxisName, layout: str) -> jax.Array:
    """x [chunks_per_shard, ...] (this device's chunks, stored order) → [2n or n, ...] every device's, natural order."""
    gathered = jax.lax.all_gather(x, axis_name, axis=0, tiled=True)  # sharded order
    n = gathered.shape[0] // x.shape[0]
    return jnp.take(gathered, jnp.asarray(np.argsort(chunk_order(n, layout))), axis=0)


def _my_chunks(axis_name: AxisName, n: int, layout: str) -> jax.Array:
    """Natural indices of this device's chunks [chunks_per_shard], in stored order."""
    return shard_chunks(jax.lax.axis_index(axis_name), n, layout)


def _chunks_to_batch(x: jax.Array, cps: int) -> jax.Array:
    """[B, cps·c, ...] → [B·cps, c, ...] (row b's chunk i at b·cps + i): a free reshape."""
    return x.reshape(x.shape[0] * cps, x.shape[1] // cps, *x.shape[2:])


def _per_chunk_first(x: jax.Array, cps: int) -> jax.Array:
    """[B·cps, ...] → [cps, B, ...]: the chunk axis first, as ``_gather_natural`` takes it."""
    return jnp.swapaxes(x.reshape(x.shape[0] // cps, cps, *x.shape[1:]), 0, 1)


def _per_chunk_to_batch(x: jax.Array) -> jax.Array:
    """[cps, B, ...] → [B·cps, ...] (inverse of ``_per_chunk_first``)."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _document_continues(segment_ids: jax.Array | None, cps: int, axis_name: AxisName, layout: str, batch: int):
    """[2n, B] bool (natural chunks): chunk j's first token continues chunk j−1's last document (chunk 0: True)."""
    if segment_ids is None:
        return None
    chunks = segment_ids.reshape(batch, cps, -1)
    first = _gather_natural(jnp.swapaxes(chunks[:, :, 0], 0, 1), axis_name, layout)
    last = _gather_natural(jnp.swapaxes(chunks[:, :, -1], 0, 1), axis_name, layout)
    return jnp.concatenate([jnp.ones_like(first[:1], bool), first[1:] == last[:-1]], axis=0)


def sequence_parallel_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    axis_name: AxisName,
    layout: str,
    chunk_size: int = 64,
    use_qk_l2norm: bool = False,
    implementation: str = "auto",
    output_final_state: bool = False,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``chunk_gated_delta_rule`` over a row split over ``axis_name``; call per device inside shard_map.

    q, k [B, Tl, H, K], v [B, Tl, H, V], g, beta [B, Tl, H], segment_ids [B, Tl] int or None: this device's tokens
    in ``layout`` order. initial_state [B, H, K, V] (the state before the row's first token, the same on every
    device) or None. Returns (this device's o [B, Tl, H, V] in q.dtype, the row's final state [B, H, K, V] fp32,
    the same on every device, or None). Equal to the unsharded rule on the whole row (method: the module doc).
    """
    B, Tl, H, K = q.shape
    V = v.shape[-1]
    cps, _ = _local_chunks(Tl, layout, "sequence_parallel_gated_delta_rule")
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(
            f"sequence_parallel_gated_delta_rule: initial_state must be [B,H,K,V]={(B, H, K, V)}; "
            f"got {initial_state.shape}"
        )
    stacked = [_chunks_to_batch(x, cps) for x in (q, k, v, g, beta)]
    qc, kc, vc, gc, bc = stacked
    # Value columns [v | 0_K] from the state [0 | I_K]: outputs [o⁰ | M], final state [B | A].
    v_ext = jnp.concatenate([vc, jnp.zeros((*vc.shape[:3], K), vc.dtype)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B * cps, H, K, K))
    s_ext = jnp.concatenate([jnp.zeros((B * cps, H, K, V), jnp.float32), eye], axis=-1)
    o_ext, final_ext = chunk_gated_delta_rule(
        qc,
        kc,
        v_ext,
        gc,
        bc,
        scale=scale,
        initial_state=s_ext,
        output_final_state=True,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        segment_ids=None if segment_ids is None else _chunks_to_batch(segment_ids, cps),
        implementation=implementation,
    )
    o0, m = o_ext[..., :V], o_ext[..., V:]
    chunk_b, chunk_a = final_ext[..., :V], final_ext[..., V:]

    a_all = _gather_natural(_per_chunk_first(chunk_a, cps), axis_name, layout)  # [2n, B, H, K, K]
    b_all = _gather_natural(_per_chunk_first(chunk_b, cps), axis_name, layout)  # [2n, B, H, K, V]
    n = a_all.shape[0] // cps
    continues = _document_continues(segment_ids, cps, axis_name, layout, B)
    if continues is None:
        continues = jnp.ones(a_all.shape[:2], bool)

    def fold(s, chunk):
        a, b, cont = chunk
        s_in = jnp.where(cont[:, None, None, None], s, 0.0)
        return jnp.einsum("bhki,bhiv->bhkv", a, s_in, precision=_HI) + b, s_in

    s0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    final_state, s_in_all = jax.lax.scan(fold, s0, (a_all, b_all, continues))
    s_in = _per_chunk_to_batch(jnp.take(s_in_all, _my_chunks(axis_name, n, layout), axis=0))  # [B·cps, H, K, V]
    o = o0.astype(jnp.float32) + jnp.einsum(
        "bthi,bhiv->bthv", m.astype(jnp.float32), s_in, precision=_HI, preferred_element_type=jnp.float32
    )
    return o.astype(q.dtype).reshape(B, Tl, H, V), (final_state if output_final_state else None)
