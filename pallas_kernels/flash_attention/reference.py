"""Exact attention that materialises the [T, S] scores in fp32: the oracle for every other backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention._common import check_inputs


def attention_reference(q, k, v, *, causal: bool = True, scale: float | None = None, q_offset: int | None = None):
    """softmax(scale · q kᵀ + mask) v, per query head, fp32 throughout.

    q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D] in q.dtype. Query head h uses KV head h // (Hq//Hkv).
    Causal: query i attends keys j <= i + q_offset (q_offset defaults to S - T).
    """
    scale, q_offset = check_inputs(q, k, v, causal=causal, scale=scale, q_offset=q_offset)
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    hi = jax.lax.Precision.HIGHEST  # exact fp32 products even where the default is TF32/bf16 passes
    qf = q.astype(jnp.float32).reshape(b, t, hkv, g, d)
    scores = jnp.einsum("bthgd,bshd->bhgts", qf, k.astype(jnp.float32), precision=hi) * scale
    if causal:
        visible = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + q_offset  # [T, S]
        scores = jnp.where(visible, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32), precision=hi)
    return out.reshape(b, t, hq, d).astype(q.dtype)
