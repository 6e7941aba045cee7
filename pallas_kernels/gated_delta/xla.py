"""Chunked gated delta rule in plain XLA (WY / UT transform), the CPU default and the Pallas kernels' prologue.

Within a chunk of C tokens with state S (K×V) at the chunk start, let G_i = Σ_{m≤i} g_m (chunk-local
cumulative log decay). Unrolling the recurrence (see reference.py) gives, for the "new values"
ν_i = β_i (v_i − recall_i) that the delta rule writes:

    (I + A) ν = β v − (β e^G k) S,      A_ij = β_i (k_i·k_j) e^{G_i − G_j}  for i > j, else 0
    ⇒ ν = U − W S,   U = T (β v),  W = T (β e^G k),  T = (I + A)^{-1}   (unit lower triangular solve)
    o_i   = e^{G_i} q_iᵀ S + Σ_{j≤i} e^{G_i − G_j} (q_i·k_j) ν_j          (q pre-multiplied by scale)
    S_new = e^{G_C} S + Σ_j e^{G_C − G_j} k_j ν_jᵀ

W, U and the intra-chunk scores are chunk-parallel; only the three small products with S are
sequential (a `lax.scan` over chunks). Every exponent is ≤ 0: decay differences G_i − G_j are masked
to −inf where i < j BEFORE exp, so even g = −20 per step over a 64-token chunk cannot overflow.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import l2norm

_HI = jax.lax.Precision.HIGHEST  # the decay/state math is specified in fp32; no TF32/bf16 passes


def _mm(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HI, preferred_element_type=jnp.float32)


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + A)⁻¹ for strictly lower-triangular A [..., C, C], C a power of two, by recursive block inversion.

    For L = [[L₁₁, 0], [L₂₁, L₂₂]] with unit-triangular diagonal blocks,
        L⁻¹ = [[L₁₁⁻¹, 0], [−L₂₂⁻¹ L₂₁ L₁₁⁻¹, L₂₂⁻¹]],
    so starting from 1×1 blocks (inverse 1) each of log₂C levels doubles the block size with two batched
    matmuls over all diagonal blocks at once. Why not `solve_triangular`: on CPU it runs one small LAPACK solve
    per (batch, head, chunk) and took ~99% of the layer's time; this is plain batched matmuls everywhere, and
    autodiff through it needs no custom rule.
    """
    c = a.shape[-1]
    if c & (c - 1):
        raise ValueError(f"chunk size must be a power of two for the blocked inverse, got {c}.")
    batch = a.shape[:-2]
    inv = jnp.ones(batch + (c, 1, 1), a.dtype)  # the c diagonal 1×1 blocks of (I + A)⁻¹
    size = 1
    while size < c:
        n = c // (2 * size)
        blocks = a.reshape(batch + (n, 2, size, n, 2, size))
        idx = jnp.arange(n)
        lower = blocks[..., idx, 1, :, idx, 0, :]               # L₂₁ of every 2s-block: [n, ..., s, s]
        lower = jnp.moveaxis(lower, 0, -3)                      # [..., n, s, s]
        pairs = inv.reshape(batch + (n, 2, size, size))
        x11, x22 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        x21 = -_mm("...ij,...jk->...ik", x22, _mm("...ij,...jk->...ik", lower, x11))
        zero = jnp.zeros_like(x11)
        top = jnp.concatenate([x11, zero], axis=-1)
        bottom = jnp.concatenate([x21, x22], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)           # [..., n, 2s, 2s]
        size *= 2
    return inv.reshape(batch + (c, c))


def chunk_prep(q, k, v, g, beta, *, scale, use_qk_l2norm, chunk_size):
    """Pads T to a chunk multiple and computes the chunk-parallel WY quantities, all fp32.

    Returns a dict of [B,H,N,C,·] arrays: q (scaled), k, w, u and gcum [B,H,N,C]. Padded steps have
    g=0, β=0, k=0, so they leave the state unchanged (α=1, nothing written).
    """
    B, T, H, K = q.shape
    C = chunk_size
    f32 = jnp.float32
    q, k = (l2norm(q), l2norm(k)) if use_qk_l2norm else (q.astype(f32), k.astype(f32))
    q = q * scale
    pad = (-T) % C
    N = (T + pad) // C

    def to_chunks(x):  # [B,T,H,...] -> [B,H,N,C,...], zero padded in time
        x = x.astype(f32)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(B, H, N, C, *x.shape[3:])

    q, k, v, g, beta = map(to_chunks, (q, k, v, g, beta))
    gcum = jnp.cumsum(g, axis=-1)
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    # Mask before exp: only i > j ever reaches exp; the rest becomes exp(−inf) = 0.
    decay = jnp.exp(jnp.where(i > j, gcum[..., :, None] - gcum[..., None, :], -jnp.inf))
    a = beta[..., :, None] * _mm("bhnik,bhnjk->bhnij", k, k) * decay
    rhs = jnp.concatenate([beta[..., None] * jnp.exp(gcum)[..., None] * k, beta[..., None] * v], axis=-1)
    wu = _mm("...ij,...jd->...id", unit_lower_inverse(a), rhs)
    return dict(q=q, k=k, w=wu[..., :K], u=wu[..., K:], gcum=gcum)


def chunk_gated_delta_rule_xla(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                               use_qk_l2norm, chunk_size=64):
    """Chunked forward in XLA; differentiable by JAX autodiff. Shapes as in api.chunk_gated_delta_rule."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    p = chunk_prep(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=C)
    G = p["gcum"]
    glast = G[..., -1:]                                           # [B,H,N,1]
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    causal_decay = jnp.exp(jnp.where(i >= j, G[..., :, None] - G[..., None, :], -jnp.inf))
    scores = _mm("bhnik,bhnjk->bhnij", p["q"], p["k"]) * causal_decay   # intra-chunk q·k with decay
    qd = p["q"] * jnp.exp(G)[..., None]                           # reads the chunk-start state
    kd = p["k"] * jnp.exp(glast - G)[..., None]                   # writes, decayed to the chunk end
    gam = jnp.exp(glast)[..., None]                               # [B,H,N,1,1] whole-chunk decay

    s0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (kd, p["w"], p["u"], gam))

    # Only the state recurrence is sequential: the scan carries S and emits each chunk's start state S_n and its
    # new values ν_n; the outputs o_n = (q e^G) S_n + scores ν_n are then one batched product over all chunks.
    # Keeping the two output matmuls out of the loop halves the work (and the thread synchronisations) per
    # sequential step, forward and backward; autodiff saves the per-chunk states for the scan anyway.
    def body(s, x):
        kd_n, w_n, u_n, gam_n = x
        vn = u_n - _mm("bhck,bhkv->bhcv", w_n, s)
        return gam_n * s + _mm("bhck,bhcv->bhkv", kd_n, vn), (s, vn)

    s, (s_start, vn) = jax.lax.scan(body, s0, xs)                # s_start [N,B,H,K,V], vn [N,B,H,C,V]
    s_start, vn = jnp.moveaxis(s_start, 0, 2), jnp.moveaxis(vn, 0, 2)
    o = _mm("bhnck,bhnkv->bhncv", qd, s_start) + _mm("bhnij,bhnjv->bhniv", scores, vn)   # [B,H,N,C,V]
    o = o.reshape(B, H, -1, V)[:, :, :T]
    o = jnp.moveaxis(o, 1, 2).astype(q.dtype)
    return o, (s if output_final_state else None)
