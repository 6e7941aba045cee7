"""One-token gated delta rule step for decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import l2norm

_HI = jax.lax.Precision.HIGHEST


def gated_delta_rule_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False):
    """S' = e^g S + β k (v − e^g Sᵀk)ᵀ ;  o = scale · S'ᵀ q.   (fp32 state, see reference.py)

    q,k [B,H,K], v [B,H,V], g,beta [B,H], state [B,H,K,V] fp32 → (o [B,H,V] in q.dtype, new_state fp32).

    Stays in XLA on every backend on purpose: one token is two K×V mat-vecs and a rank-1 update per
    head, a few microseconds of memory-bound work that XLA fuses into one or two kernels; a Pallas
    launch would add overhead and buy nothing (there is no chunk of tokens to amortise it over).
    """
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"gated_delta_rule_step: expected q,k [B,H,K] and v [B,H,V]; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    B, H, K = q.shape
    V = v.shape[-1]
    if g.shape != (B, H) or beta.shape != (B, H):
        raise ValueError(f"gated_delta_rule_step: g and beta must be [B,H]={(B, H)}; got {g.shape}, {beta.shape}")
    if state.shape != (B, H, K, V):
        raise ValueError(f"gated_delta_rule_step: state must be [B,H,K,V]={(B, H, K, V)}; got {state.shape}")
    scale = K**-0.5 if scale is None else scale
    f32 = jnp.float32
    out_dtype = q.dtype
    q, k = (l2norm(q), l2norm(k)) if use_qk_l2norm else (q.astype(f32), k.astype(f32))
    s = state.astype(f32) * jnp.exp(g.astype(f32))[..., None, None]
    pred = jnp.einsum("bhkv,bhk->bhv", s, k, precision=_HI)
    s = s + k[..., :, None] * (beta.astype(f32)[..., None] * (v.astype(f32) - pred))[..., None, :]
    o = jnp.einsum("bhkv,bhk->bhv", s, q, precision=_HI) * scale
    return o.astype(out_dtype), s
