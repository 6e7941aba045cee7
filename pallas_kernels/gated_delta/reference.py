"""Naive token-by-token gated delta rule: the slow, exact definition every other path is tested against.

Per (batch, head), with the state S ∈ R^{K×V} kept in fp32:

    α_t = exp(g_t)                       (g_t ≤ 0 is the log decay)
    S_t = α_t S_{t−1} + β_t k_t (v_t − α_t S_{t−1}ᵀ k_t)ᵀ
        = (I − β_t k_t k_tᵀ) α_t S_{t−1} + β_t k_t v_tᵀ
    o_t = scale · S_tᵀ q_t

With segment ids (packed documents), S_{t−1} ← 0 before every document start t > 0 (segment_ids[b, t] ≠
segment_ids[b, t−1]): each document runs as if alone from a zero state, the row's first one from initial_state.

(The row-vector papers write S ∈ R^{V×K} and S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ; it is the
same map transposed.) Semantics and argument names follow flash-linear-attention's `chunk_gated_delta_rule`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST  # the oracle must be exact fp32: no TF32 / single bf16 pass on GPU or TPU
L2NORM_EPS = 1e-6  # the same eps as flash-linear-attention / transformers' l2norm


def l2norm(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x / sqrt(Σ x² + eps) over the last axis, in fp32 (eps inside the sqrt, as in FLA)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def naive_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm=False,
    segment_ids=None,
):
    """Token-by-token fp32 scan. q,k [B,T,H,K], v [B,T,H,V], g,beta [B,T,H], initial_state [B,H,K,V],
    segment_ids [B,T] int or None.

    Returns (o [B,T,H,V] in q.dtype, final_state [B,H,K,V] fp32 or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    f32 = jnp.float32
    out_dtype = q.dtype
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # Time-major for the scan: [T, B, H, ...].
    qs, ks, vs = (jnp.moveaxis(x.astype(f32), 1, 0) for x in (q, k, v))
    gs, bs = (jnp.moveaxis(x.astype(f32), 1, 0) for x in (g, beta))
    s0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
    if segment_ids is None:
        starts = jnp.zeros((T, B), bool)
    else:  # [T, B]: True where a document other than the row's first begins
        starts = jnp.moveaxis(jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], [(0, 0), (1, 0)]), 1, 0)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t, start_t = xs
        s = jnp.where(start_t[:, None, None, None], 0.0, s)  # a new document forgets the previous one's state
        s = s * jnp.exp(g_t)[..., None, None]
        pred = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=_HI)  # what the decayed state recalls for k_t
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * (v_t - pred), precision=_HI)
        o_t = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=_HI) * scale
        return s, o_t

    s, o = jax.lax.scan(step, s0, (qs, ks, vs, gs, bs, starts))
    o = jnp.moveaxis(o, 0, 1).astype(out_dtype)
    return o, (s if output_final_state else None)
