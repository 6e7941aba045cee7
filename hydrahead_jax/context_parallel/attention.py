"""Causal softmax attention over a row whose tokens are split over the ``sequence`` mesh axes.

Runs per device inside ``jax.shard_map`` (``kernel_call`` with ``BSHD`` layouts). Device i of n holds the tokens of
the natural chunks ``shard_chunks(i, n, layout)`` (c tokens each, c = T / (n · chunks_per_shard)) and must return

    o_t = Σ_{j ≤ t, seg_j = seg_t} softmax_j(scale · q_t · k_j) v_j          for each of its tokens t

(query head h reads KV head h // G, G = Hq / Hkv), i.e. exactly the rows of the unsharded
``flash_attention(causal=True, segment_ids=...)`` it holds. Two ways to get the keys it needs:

``mode="allgather"`` (default). All-gather k, v (and the segment ids) over the axis, restore natural order, and run
``flash_attention`` once per held chunk. Chunk j (natural positions [jc, (j+1)c)) needs only the keys [0, (j+1)c).
To keep the call static-shaped (q_offset a Python int) the gathered keys are rotated so that this visible prefix is
the last (j+1)c of the T keys,

    k'_m = k_{(m + (j+1)c) mod T},    q_offset = T − c   (the queries are the last c key positions),

so causally query jc+i sees k'_m for m ≤ T − c + i, i.e. k_{m'} for m' ≤ jc + i, exactly as unsharded. The rotated-in
future keys (the first T − (j+1)c positions) get a segment id that no query has (the sentinel ``min(ids) − 1``, or
−1 against all-zero ids without packing). The kernels skip every (query tile, key tile) pair whose id ranges do
not meet (the Pallas grid steps and the blockwise XLA loop bounds: ``segment_tile_spans``), so chunk j visits
(j+1)·c/b_k key tiles per query tile row, the work of its causal prefix only. Zig-zag: device i holds chunks i and
2n−1−i, so it visits (i+1) + (2n−i) = 2n+1 chunk-widths of key tiles, the same on every device
(``key_tiles_visited`` counts them; the test checks it); contiguous gives device i (i+1) and the last n× the first.
Any ``implementation`` of ``flash_attention`` works (reference / xla / pallas*), so the Pallas kernels run as they
are. Cost per device: the gathered K/V of the row (cheap for a hybrid: the FA groups are a few KV heads).

``mode="ring"``. K/V (and ids) travel around the ring with ``lax.ppermute``: at step s device i holds the block of
device (i − s) mod n. Each (held query chunk a, visiting key chunk b) pair with b ≤ a gives a partial

    m = max_j s_j,  l = Σ_j e^{s_j − m},  o^(b) = Σ_j e^{s_j − m} v_j / l,  lse^(b) = m + log l   (fp32, visible j)

and pairs with b > a (entirely in the future) are skipped by a ``lax.cond`` (no work). Partials merge online:

    lse ← logaddexp(lse, lse^(b)),   o ← e^{lse_old − lse} o + e^{lse^(b) − lse} o^(b).

Only one visiting block is held at a time in the forward. ``pallas_kernels.flash_attention`` returns no lse, so
the partials are computed here in plain JAX, blockwise over query blocks of ``block_sizes.block_q`` rows (a
``lax.map`` whose body is ``jax.checkpoint``-ed: the backward recomputes each block's [b_q, c] scores instead of
keeping them). Gradients flow by autodiff through ppermute (whose transpose sends the cotangents back around the
ring); autodiff keeps each step's visiting K/V for the backward, so the backward holds the row's K/V like
"allgather" does. ``implementation`` is not used by the ring.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hydrahead_jax.context_parallel.layout import check_layout, chunks_per_shard, from_layout, shard_chunks
from pallas_kernels.flash_attention import BlockSizes, flash_attention

MODES = ("allgather", "ring")

_F32 = jnp.float32
# Finite stand-in for log(0) (an empty partial): exp(_NO_KEYS − x) is exactly 0 and logaddexp never meets inf − inf.
_NO_KEYS = -1e30


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"context-parallel attention mode must be one of {MODES}; got {mode!r}.")


def _axis_size(axis_name) -> int:
    return math.prod(lax.axis_size(a) for a in ((axis_name,) if isinstance(axis_name, str) else axis_name))


def _check_inputs(q, k, v, segment_ids, layout, mode):
    check_layout(layout)
    check_mode(mode)
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"q must be [B, Tl, Hq, D] and k, v [B, Tl, Hkv, D]; got {q.shape}, {k.shape}, {v.shape}.")
    b, tl, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != tl or k.shape[3] != d or hq % k.shape[2]:
        raise ValueError(
            f"q {q.shape} and k/v {k.shape} must share batch, local length and head dim, with Hq a multiple of Hkv."
        )
    if segment_ids is not None and segment_ids.shape != (b, tl):
        raise ValueError(f"segment_ids must be this device's [B, Tl] = {(b, tl)} ids; got {segment_ids.shape}.")
    parts = chunks_per_shard(layout)
    if tl % parts:
        raise ValueError(
            f"this device holds {tl} tokens, which do not split into the {parts} equal chunks of the {layout} layout; "
            f"use a sequence length that is a multiple of {parts} x the sequence axis size."
        )


def sequence_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    axis_name: str | tuple[str, ...],
    layout: str,
    mode: str = "allgather",
    scale: float,
    implementation: str = "auto",
    block_sizes: BlockSizes | None = None,
) -> jax.Array:
    """Causal (GQA) softmax attention of this device's tokens against the whole row (see the module doc).

    q [B, Tl, Hq, D], k/v [B, Tl, Hkv, D]: this device's tokens in ``layout`` order; segment_ids [B, Tl] or None
    (packed documents: a token sees only the earlier tokens of its document). axis_name: the sequence mesh axes
    (``sequence_axes()``). mode: "allgather" or "ring". implementation/block_sizes: passed to ``flash_attention``
    ("allgather"); block_sizes.block_q sets the query block of the ring's partials. Returns [B, Tl, Hq, D] in
    q.dtype, equal to the unsharded call's rows for these tokens.
    """
    _check_inputs(q, k, v, segment_ids, layout, mode)
    n = _axis_size(axis_name)
    if mode == "allgather":
        return _allgather_attention(q, k, v, segment_ids, axis_name, n, layout, scale, implementation, block_sizes)
    return _ring_attention(q, k, v, segment_ids, axis_name, n, layout, scale, block_sizes)


def _sentinel(ids: jax.Array | None) -> jax.Array:
    """A segment id no token carries: one below the smallest (ids are document numbers ≥ 0 in practice)."""
    return jnp.int32(-1) if ids is None else jnp.min(ids) - 1


def _allgather_attention(q, k, v, segment_ids, axis_name, n, layout, scale, implementation, block_sizes):
    gather = lambda x: from_layout(lax.all_gather(x, axis_name, axis=1, tiled=True), n, layout)  # noqa: E731
    k_all, v_all = gather(k), gather(v)
    ids_all = None if segment_ids is None else gather(segment_ids)
    t = k_all.shape[1]
    parts = chunks_per_shard(layout)
    c = q.shape[1] // parts
    chunks = shard_chunks(lax.axis_index(axis_name), n, layout)
    sentinel = _sentinel(ids_all)
    outs = []
    for p in range(parts):
        shift = (chunks[p] + 1) * c  # rotate left by the visible prefix: it becomes the last keys
        hidden = jnp.arange(t) < t - shift  # the rotated-in future keys
        q_ids = jnp.zeros((q.shape[0], c), jnp.int32) if segment_ids is None else segment_ids[:, p * c : (p + 1) * c]
        kv_ids = jnp.zeros((q.shape[0], t), jnp.int32) if ids_all is None else jnp.roll(ids_all, t - shift, axis=1)
        kv_ids = jnp.where(hidden[None], sentinel, kv_ids)
        outs.append(
            flash_attention(
                q[:, p * c : (p + 1) * c],
                jnp.roll(k_all, t - shift, axis=1),  # a traced shift: a dynamic slice, the keys stay static-shaped
                jnp.roll(v_all, t - shift, axis=1),
                causal=True,
                scale=scale,
                q_offset=t - c,
                segment_ids=q_ids,
                kv_segment_ids=kv_ids,
                implementation=implementation,
                block_sizes=block_sizes,
            )
        )
    return outs[0] if parts == 1 else jnp.concatenate(outs, axis=1)


def key_tiles_visited(shard: int, n: int, layout: str, length: int, *, block_q: int, block_k: int) -> int:
    """(query tile, key tile) pairs the "allgather" mode's kernel calls visit on device ``shard`` for a row of
    ``length`` tokens without packing: for each held chunk j, the tile pairs that meet its causal prefix after
    the rotation (the same spans the kernels compute from the sentinel ids and q_offset = T − c)."""
    from pallas_kernels.flash_attention._common import segment_tile_spans

    parts = chunks_per_shard(layout)
    c = length // (n * parts)
    total = 0
    for j in np.asarray(shard_chunks(shard, n, layout)):
        q_ids = jnp.zeros((1, c), jnp.int32)
        kv_ids = jnp.where(jnp.arange(length) < length - (int(j) + 1) * c, -1, 0)[None].astype(jnp.int32)
        nq, nk = -(-c // block_q), -(-length // block_k)
        (k_lo, k_hi), _ = segment_tile_spans(q_ids, kv_ids, bq=block_q, bk=block_k, tp=nq * block_q, sp=nk * block_k)
        last = np.minimum((np.arange(nq) * block_q + block_q - 1 + length - c) // block_k + 1, nk)  # causal bound
        total += int(np.maximum(np.minimum(np.asarray(k_hi[0]), last) - np.asarray(k_lo[0]), 0).sum())
    return total


def _partial_attention(q, k, v, q_pos, k_pos, q_ids, k_ids, scale, block_q):
    """(o [B,c,Hq,D], lse [B,Hkv,G,c]) fp32 of queries q [B,c,Hq,D] at natural positions q_pos [c] against keys
    k/v [B,ck,Hkv,D] at k_pos [ck]: visible iff k_pos ≤ q_pos (and equal ids). A row with no visible key gets o = 0,
    lse = _NO_KEYS. Blockwise over query blocks of block_q rows, each recomputed in the backward."""
    b, c, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    bq = math.gcd(c, block_q)
    nq = c // bq
    qb = q.reshape(b, nq, bq, hkv, g, d).swapaxes(0, 1)
    qpb = q_pos.reshape(nq, bq)
    qib = None if q_ids is None else q_ids.reshape(b, nq, bq).swapaxes(0, 1)

    @jax.checkpoint
    def block(args):
        q_i, qp_i, qi_i = args
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k, preferred_element_type=_F32) * scale
        vis = (k_pos[None, :] <= qp_i[:, None])[None, None, None]
        if qi_i is not None:
            vis = vis & (qi_i[:, :, None] == k_ids[:, None, :])[:, None, None]
        s = jnp.where(vis, s, _NO_KEYS)  # masked before exp: exp(s − m) of a hidden key would overflow
        m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(vis, jnp.exp(s - m), 0.0)
        l = p.sum(-1)
        some = l > 0
        l_safe = jnp.where(some, l, 1.0)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(_F32), preferred_element_type=_F32)
        o = o / jnp.moveaxis(l_safe, 3, 1)[..., None]
        lse = jnp.where(some, m[..., 0] + jnp.log(l_safe), _NO_KEYS)
        return o, lse

    o, lse = lax.map(block, (qb, qpb, qib))
    o = o.swapaxes(0, 1).reshape(b, c, hq, d)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, hkv, g, c)
    return o, lse


def _merge(o, lse, o_new, lse_new):
    """Online-softmax merge of two partials over disjoint key sets (fp32)."""
    out_lse = jnp.logaddexp(lse, lse_new)
    w_old = jnp.exp(lse - out_lse)
    w_new = jnp.exp(lse_new - out_lse)
    b, hkv, g, c = lse.shape
    to_rows = lambda w: jnp.moveaxis(w, 3, 1).reshape(b, c, hkv * g, 1)  # noqa: E731
    return o * to_rows(w_old) + o_new * to_rows(w_new), out_lse


def _attend_and_merge(acc, pair, *, scale, block_q):
    """One ring step for one (query chunk, visiting key chunk) pair: its partial merged into acc = (o, lse)."""
    q, q_ids, k, v, k_ids, q_pos, k_pos = pair
    return _merge(*acc, *_partial_attention(q, k, v, q_pos, k_pos, q_ids, k_ids, scale, block_q))


def _ring_attention(q, k, v, segment_ids, axis_name, n, layout, scale, block_sizes):
    b, tl, hq, d = q.shape
    hkv = k.shape[2]
    parts = chunks_per_shard(layout)
    c = tl // parts
    block_q = (block_sizes or BlockSizes.default("xla")).block_q
    me = lax.axis_index(axis_name)
    my_chunks = shard_chunks(me, n, layout)
    positions = lambda chunk: chunk * c + jnp.arange(c)  # noqa: E731
    piece = lambda x, p: None if x is None else x[:, p * c : (p + 1) * c]  # noqa: E731

    attend = functools.partial(_attend_and_merge, scale=scale, block_q=block_q)

    def visit(acc, block, src):
        """Merge the visiting block of device ``src`` into every held chunk's (o, lse)."""
        src_chunks = shard_chunks(src, n, layout)
        acc = list(acc)
        for a in range(parts):
            for bb in range(parts):
                pair = tuple(piece(x, a) for x in (q, segment_ids)) + tuple(piece(x, bb) for x in block)
                pair += (positions(my_chunks[a]), positions(src_chunks[bb]))
                skip = lambda acc, pair: acc  # noqa: E731
                # a block entirely in the future is skipped: no work
                acc[a] = lax.cond(src_chunks[bb] <= my_chunks[a], attend, skip, acc[a], pair)
        return tuple(acc)

    acc = tuple(
        (jnp.zeros((b, c, hq, d), _F32), jnp.full((b, hkv, hq // hkv, c), _NO_KEYS, _F32)) for _ in range(parts)
    )
    acc = visit(acc, (k, v, segment_ids), me)  # step 0: this device's own block
    ring = [(i, (i + 1) % n) for i in range(n)]

    def step(carry, s):  # steps 1 … n−1: pass the block on, then attend to the one that arrived (from me − s)
        acc, block = carry
        block = jax.tree.map(lambda x: lax.ppermute(x, axis_name, ring), block)
        return (visit(acc, block, (me - s) % n), block), None

    (acc, _), _ = lax.scan(step, (acc, (k, v, segment_ids)), jnp.arange(1, n))
    return jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)
