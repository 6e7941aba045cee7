"""Exact attention that materialises the [T, S] scores in fp32: the oracle for every other backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention._common import check_inputs, check_segment_ids


def attention_reference(
    q,
    k,
    v,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_offset: int | None = None,
    segment_ids=None,
    kv_segment_ids=None,
):
    """softmax(scale · q kᵀ + mask) v, per query head, fp32 throughout.

    q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D] in q.dtype. Query head h uses KV head h // (Hq//Hkv).
    Causal: query i attends keys j <= i + q_offset (q_offset defaults to S - T). Segment ids ([B,T] and
    [B,S], the latter defaulting to the former): query i attends key j only if their ids are equal. A
    query with no visible key outputs 0 (the softmax over an empty set is taken as all-zero weights).
    """
    scale, q_offset = check_inputs(q, k, v, causal=causal, scale=scale, q_offset=q_offset)
    q_seg, kv_seg = check_segment_ids(
        segment_ids, kv_segment_ids, batch=q.shape[0], q_len=q.shape[1], kv_len=k.shape[1]
    )
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    hi = jax.lax.Precision.HIGHEST  # exact fp32 products even where the default is TF32/bf16 passes
    qf = q.astype(jnp.float32).reshape(b, t, hkv, g, d)
    scores = jnp.einsum("bthgd,bshd->bhgts", qf, k.astype(jnp.float32), precision=hi) * scale
    if causal:
        visible = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + q_offset  # [T, S]
        scores = jnp.where(visible, scores, -jnp.inf)
    if q_seg is None:
        p = jax.nn.softmax(scores, axis=-1)
    else:
        same = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None, None]  # [B, 1, 1, T, S]
        scores = jnp.where(same, scores, -jnp.inf)
        # Softmax that tolerates all-masked rows: exp(-inf - 0) = 0 everywhere, normaliser clamped to 1. The shift
        # by the row max cancels in the ratio, so it carries no gradient.
        row_max = jnp.max(scores, axis=-1, keepdims=True)
        e = jnp.exp(scores - jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0)))
        denom = e.sum(-1, keepdims=True)
        p = e / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32), precision=hi)
    return out.reshape(b, t, hq, d).astype(q.dtype)
