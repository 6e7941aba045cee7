"""Streaming softmax attention for the LA heads: each query sees its document's first ``sinks`` tokens and its last
``window`` tokens (itself included), with the teacher's own q/k/v and RoPE (``HybridConfig.la_window``).

For a query at index t of its row, in a document that starts at index s_t (positions restart at 0 in each packed
document, so s_t = t − position_t), the visible keys are

    sinks  S_t = { j : s_t ≤ j < s_t + sinks, j ≤ t }
    local  W_t = { j : t − window < j ≤ t, j in t's document, position_j ≥ sinks }     (a sink is counted once)

and the output is one softmax over both, o_t = Σ_{j ∈ S_t ∪ W_t} softmax_j(q_t·k_j·scale) v_j. It is the teacher's
attention of that head restricted to S_t ∪ W_t: exact for t < sinks + window, and the head's cache is constant in
size (``sinks + window`` keys and values). Most of a pretrained model's heads attend locally or to the first tokens
(StreamingLLM's attention sinks; DuoAttention's streaming heads), so the restriction changes them little, while
the kept FA groups do the long-range retrieval.

Prefill and training run in blocks of ``window`` queries against the block before and their own (O(T · window)),
plus the gathered sink keys; decoding keeps the sinks and a ring of the last ``window`` keys (``decode_step``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def streaming_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int,
    sinks: int,
    scale: float,
    positions: jax.Array,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Streaming attention (module doc) of q [B,T,Hq,D] over k, v [B,T,Hkv,D] (after RoPE; query head h reads KV
    head h // (Hq/Hkv)); ``positions`` [B,T] or [T] (restarting at 0 in each packed document), ``segment_ids``
    [B,T] (packed documents) or None. Returns [B,T,Hq,D] float32."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (b, t))
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    qf = q.astype(jnp.float32).reshape(b, t, hkv, g, d) * scale
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)

    # sinks: the document's first `sinks` keys, gathered per query: [B,T,S,Hkv,D]
    index = jnp.arange(t, dtype=jnp.int32)[None]
    sink_index = (index - positions)[..., None] + jnp.arange(sinks, dtype=jnp.int32)  # [B,T,S]
    sink_ok = jnp.arange(sinks)[None, None] <= positions[..., None]
    sink_index = jnp.clip(sink_index, 0, t - 1)
    rows = jnp.arange(b)[:, None, None]
    k_sink, v_sink = kf[rows, sink_index], vf[rows, sink_index]
    sink_scores = jnp.einsum("btkgd,btskd->btkgs", qf, k_sink)
    sink_scores = jnp.where(sink_ok[:, :, None, None, :], sink_scores, -jnp.inf)

    # local: blocks of `window` queries against the previous block and their own
    w = window
    nb = -(-t // w)
    pad = nb * w - t

    def blocks(x, fill=0):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape(b, nb, w, *x.shape[2:])

    def with_previous(x, fill=0):  # [B,nb,w,…] → [B,nb,2w,…]: the block before (fill for block 0), then its own
        before = jnp.concatenate([jnp.full_like(x[:, :1], fill), x[:, :-1]], axis=1)
        return jnp.concatenate([before, x], axis=2)

    q_b = blocks(qf)  # [B,nb,w,Hkv,G,D]
    k_b, v_b = with_previous(blocks(kf)), with_previous(blocks(vf))  # [B,nb,2w,Hkv,D]
    key_pos = with_previous(blocks(positions, -1), -1)  # [B,nb,2w]
    key_seg = with_previous(blocks(seg, -1), -2)
    query_seg = blocks(seg, -3)
    j = jnp.arange(2 * w) - w  # key offset from the block's first query
    i = jnp.arange(w)
    distance = i[:, None] - j[None, :]  # query minus key index, [w, 2w]
    local_ok = (
        (distance >= 0)[None, None]
        & (distance < w)[None, None]
        & (key_pos[:, :, None, :] >= sinks)
        & (key_seg[:, :, None, :] == query_seg[..., None])
    )  # [B,nb,w,2w]
    local_scores = jnp.einsum("bnqkgd,bnskd->bnqkgs", q_b, k_b)
    local_scores = jnp.where(local_ok[:, :, :, None, None, :], local_scores, -jnp.inf)
    local_scores = local_scores.reshape(b, nb * w, hkv, g, 2 * w)[:, :t]

    scores = jnp.concatenate([sink_scores, local_scores], axis=-1)  # [B,T,Hkv,G,S+2w]
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("btkgs,btskd->btkgd", probs[..., :sinks], v_sink)
    p_local = jnp.pad(probs[..., sinks:], [(0, 0), (0, pad), (0, 0), (0, 0), (0, 0)])
    p_local = p_local.reshape(b, nb, w, hkv, g, 2 * w)
    out_local = jnp.einsum("bnqkgs,bnskd->bnqkgd", p_local, v_b).reshape(b, nb * w, hkv, g, d)[:, :t]
    return (out + out_local).reshape(b, t, hq, d)


def init_cache(batch: int, groups: int, head_dim: int, *, window: int, sinks: int, dtype) -> dict[str, jax.Array]:
    """The LA heads' streaming cache: ``win_k``, ``win_v`` [B, sinks + window, groups, D] (slots 0 … sinks−1 the
    first tokens, then a ring of the last ``window``), a constant size whatever the context."""
    shape = (batch, sinks + window, groups, head_dim)
    return {"win_k": jnp.zeros(shape, dtype), "win_v": jnp.zeros(shape, dtype)}


def slot_of(p: jax.Array, *, window: int, sinks: int) -> jax.Array:
    """The cache slot of the token at position p: p itself for a sink, else sinks + (p − sinks) mod window."""
    return jnp.where(p < sinks, p, sinks + (p - sinks) % window)


def fill_cache(cache: dict, k: jax.Array, v: jax.Array, *, window: int, sinks: int) -> dict[str, jax.Array]:
    """``cache`` after a prefill of k, v [B,T,Hkv,D] (positions 0 … T−1): its sinks and its last ``window``
    tokens in their slots (the tokens before them are not needed again)."""
    t = k.shape[1]
    keep = np.arange(t)
    keep = keep[(keep < sinks) | (keep >= max(sinks, t - window))]
    slots = slot_of(keep, window=window, sinks=sinks)
    return {
        "win_k": cache["win_k"].at[:, slots].set(k[:, keep].astype(cache["win_k"].dtype)),
        "win_v": cache["win_v"].at[:, slots].set(v[:, keep].astype(cache["win_v"].dtype)),
    }


def decode_step(
    q: jax.Array, k: jax.Array, v: jax.Array, cache: dict, p: jax.Array, *, window: int, sinks: int, scale: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One new token at position ``p`` (q [B,1,Hq,D], k, v [B,1,Hkv,D]): writes its key/value into its slot and
    attends to every filled slot (the sinks seen so far and the ring's last min(window, p + 1 − sinks) tokens).
    Returns (o [B,1,Hq,D] float32, the new cache)."""
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    slot = slot_of(p, window=window, sinks=sinks)
    new = {
        "win_k": jax.lax.dynamic_update_slice_in_dim(cache["win_k"], k.astype(cache["win_k"].dtype), slot, 1),
        "win_v": jax.lax.dynamic_update_slice_in_dim(cache["win_v"], v.astype(cache["win_v"].dtype), slot, 1),
    }
    s = jnp.arange(sinks + window)
    filled = jnp.where(s < sinks, s <= p, (s - sinks) < jnp.minimum(window, p + 1 - sinks))
    qf = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d) * scale
    scores = jnp.einsum("bkgd,bskd->bkgs", qf, new["win_k"].astype(jnp.float32))
    probs = jax.nn.softmax(jnp.where(filled, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgs,bskd->bkgd", probs, new["win_v"].astype(jnp.float32))
    return out.reshape(b, 1, hq, d), new
