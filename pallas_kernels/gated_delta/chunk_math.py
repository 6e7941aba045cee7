"""The chunk math of the gated delta rule, shared by the XLA path and the Pallas GPU (Triton) and TPU (Mosaic) kernels.

Every backend runs the same three parts:

1. The WY prologue (`chunk_prep`, chunk-parallel XLA): within a chunk of C tokens with state S (K×V) at the chunk
   start, let G_i = Σ_{m≤i} g_m (chunk-local cumulative log decay). Unrolling the recurrence (reference.py) gives,
   for the "new values" ν_i = β_i (v_i − recall_i) that the delta rule writes,

       (I + A) ν = β v − (β e^G k) S,      A_ij = β_i (k_i·k_j) e^{G_i − G_j}  for i > j, else 0
       ⇒ ν = U − W S,   U = T (β v),  W = T (β e^G k),  T = (I + A)⁻¹   (unit lower triangular)

   Why XLA and not the kernels: Triton has no triangular solve, and the solve-free products Π(I + A^{2^m}) lose
   all precision when keys are correlated (powers of a strictly lower matrix of ones grow like binomial
   coefficients, ~1e18 at C = 64). `unit_lower_solve` does it with exact block inversion in batched matmuls and
   has its own VJP (two matmuls), so the backward never differentiates through the inversion steps.

2. The sequential recurrence over chunks (a `lax.scan` in xla.py, a loop with the state on chip in the kernels):

       forward, chunk n (S = state at chunk start, D_ij = e^{G_i − G_j} for i ≥ j else 0):
           ν = U − W S
           O = (q ⊙ e^G) S + ((q kᵀ) ⊙ D) ν
           S ← e^{G_C} S + (k ⊙ e^{G_C − G})ᵀ ν

       backward, chunks in reverse, carrying dS = ∂L/∂S_{n+1} and recomputing ν from the saved S_n:
           dν  = ((q kᵀ) ⊙ D)ᵀ dO + (k ⊙ e^{G_C − G}) dS
           dU  = dν ;  dW = −dν Sᵀ
           dq  = (dO Sᵀ) ⊙ e^G + (dP ⊙ D) k,      dP = dO νᵀ
           dk  = (dP ⊙ D)ᵀ q + (ν dSᵀ) ⊙ e^{G_C − G}
           dG_i = Σ_k dq̂_ik q̂_ik + Σ_j M_ij − Σ_j M_ji − Σ_k dk̂_ik k̂_ik  (+ at i = C−1:
                  Σ_ik dk̂ ⊙ k̂ + e^{G_C} Σ dS ⊙ S),  M = dP ⊙ (q kᵀ) ⊙ D, q̂ = q e^G, k̂ = k e^{G_C − G}
           dS  ← (q ⊙ e^G)ᵀ dO + e^{G_C} dS − Wᵀ dν

   `make_recurrence` wraps a backend's forward and backward in a custom_vjp that saves only the inputs and the
   per-chunk start states S_n; everything else is recomputed.

3. The wrapper `chunked_gated_delta_rule`: prologue, recurrence, unpadding.

The per-chunk functions are written with ops that lower on Triton, Mosaic TPU and in interpret mode: 2-D
`jnp.dot`/`lax.dot_general`, broadcasted iota masks, full or single-axis reductions, `jnp.where`; no gathers, no
dynamic value indexing, no 1-D layouts (G travels as a (C, 1) column). Every exponent is ≤ 0: decay differences
are masked to −inf where i < j BEFORE exp, so even g = −20 per step over a 64-token chunk cannot overflow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .reference import l2norm

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST  # the decay/state math is specified in fp32; no TF32/bf16 passes


def _mm(spec, a, b, prec=_HI):
    return jnp.einsum(spec, a, b, precision=prec, preferred_element_type=_F32)


# ------------------------------------------------------------------------------------ 1. WY prologue (XLA)


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + A)⁻¹ for strictly lower-triangular A [..., C, C], C a power of two, by recursive block inversion.

    For L = [[L₁₁, 0], [L₂₁, L₂₂]] with unit-triangular diagonal blocks,
        L⁻¹ = [[L₁₁⁻¹, 0], [−L₂₂⁻¹ L₂₁ L₁₁⁻¹, L₂₂⁻¹]],
    so starting from 1×1 blocks (inverse 1) each of log₂C levels doubles the block size with two batched
    matmuls over all diagonal blocks at once. Why not `solve_triangular`: on CPU it runs one small LAPACK solve
    per (batch, head, chunk) and took ~99% of the layer's time; this is plain batched matmuls everywhere.
    Only the strictly lower part of A is read.
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
        lower = blocks[..., idx, 1, :, idx, 0, :]  # L₂₁ of every 2s-block: [n, ..., s, s]
        lower = jnp.moveaxis(lower, 0, -3)  # [..., n, s, s]
        pairs = inv.reshape(batch + (n, 2, size, size))
        x11, x22 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        x21 = -_mm("...ij,...jk->...ik", x22, _mm("...ij,...jk->...ik", lower, x11))
        zero = jnp.zeros_like(x11)
        top = jnp.concatenate([x11, zero], axis=-1)
        bottom = jnp.concatenate([x21, x22], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)  # [..., n, 2s, 2s]
        size *= 2
    return inv.reshape(batch + (c, c))


@jax.custom_vjp
def unit_lower_solve(a: jax.Array, rhs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """x_r = (I + A)⁻¹ rhs_r for strictly lower-triangular A [..., C, C] and each rhs_r [..., C, D_r].

    VJP (T = (I + A)⁻¹, so dT = −T dA T):  ∂L/∂rhs_r = Tᵀ ∂L/∂x_r,   ∂L/∂A = −strict_lower(Σ_r (∂L/∂rhs_r) x_rᵀ).
    A few matmuls, against autodiff through `unit_lower_inverse`'s gathers and concatenations (a scatter per
    level in the backward, ~6x the forward's time on CPU).
    """
    return _solve_fwd(a, rhs)[0]


def _solve_fwd(a, rhs):
    t = unit_lower_inverse(a)
    x = tuple(_mm("...ij,...jd->...id", t, r) for r in rhs)
    return x, (t, x)


def _solve_bwd(res, dx):
    t, x = res
    drhs = tuple(_mm("...ji,...jd->...id", t, d) for d in dx)
    c = t.shape[-1]
    strictly_lower = jnp.arange(c)[:, None] > jnp.arange(c)[None, :]
    da = -sum(_mm("...id,...jd->...ij", d, xr) for d, xr in zip(drhs, x))
    return jnp.where(strictly_lower, da, 0.0).astype(t.dtype), drhs


unit_lower_solve.defvjp(_solve_fwd, _solve_bwd)


def chunk_prep(q, k, v, g, beta, *, scale, use_qk_l2norm, chunk_size):
    """Pads T to a chunk multiple and computes the chunk-parallel WY quantities, all fp32.

    Returns a dict of [B,H,N,C,·] arrays: q (scaled), k, w, u and gcum [B,H,N,C]. Padded steps have
    g=0, β=0, k=0, so they leave the state unchanged (α=1, nothing written).
    """
    B, T, H, K = q.shape
    C = chunk_size
    q, k = (l2norm(q), l2norm(k)) if use_qk_l2norm else (q.astype(_F32), k.astype(_F32))
    q = q * scale
    pad = (-T) % C
    N = (T + pad) // C

    def to_chunks(x):  # [B,T,H,...] -> [B,H,N,C,...], zero padded in time
        x = x.astype(_F32)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(B, H, N, C, *x.shape[3:])

    q, k, v, g, beta = map(to_chunks, (q, k, v, g, beta))
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    # The chunk-local cumsum as a product with a lower-triangular ones matrix: XLA CPU lowers `cumsum` to a
    # reduce-window that it then fuses into every consumer, re-summing up to C terms per element of the
    # [C, C] decay below (profiled at T=8K, 9 heads: that exp fusion took 19 ms, 7 ms with the matmul).
    gcum = _mm("...j,ij->...i", g, (i >= j).astype(_F32))
    # Mask before exp: only i > j ever reaches exp; the rest becomes exp(−inf) = 0.
    decay = jnp.exp(jnp.where(i > j, gcum[..., :, None] - gcum[..., None, :], -jnp.inf))
    a = beta[..., :, None] * _mm("bhnik,bhnjk->bhnij", k, k) * decay
    # W and U as one solve, but with the two right-hand sides kept apart: a concatenation of two activation-sized
    # arrays is a slow copy on XLA CPU.
    w, u = unit_lower_solve(a, (beta[..., None] * jnp.exp(gcum)[..., None] * k, beta[..., None] * v))
    return dict(q=q, k=k, w=w, u=u, gcum=gcum)


# ------------------------------------------------------------------------------------ 2. one chunk


def _dot(a, b, prec, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=prec, preferred_element_type=_F32)


def _decays(g):
    """g: (C,1) chunk-local cumulative log decay → (causal decay D (C,C), g as a row (1,C), G_C scalar)."""
    C = g.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    # Transpose the column into a row with a masked reduction: portable where (C,1)->(1,C) is not.
    g_row = jnp.sum(jnp.where(row == col, g, 0.0), axis=0, keepdims=True)
    # Mask before exp: only i ≥ j (non-positive exponents) reaches exp.
    decay = jnp.exp(jnp.where(row >= col, g - g_row, -jnp.inf))
    last = jax.lax.broadcasted_iota(jnp.int32, g.shape, 0) == C - 1
    g_last = jnp.sum(jnp.where(last, g, 0.0))
    return decay, row, col, g_last, last


def chunk_forward(q, k, w, u, g, s, prec):
    """One chunk. q,k,w (C,K); u (C,V); g (C,1); s (K,V) → (o (C,V), s_next (K,V)); all fp32."""
    decay, _, _, g_last, _ = _decays(g)
    scores = _dot(q, k, prec, trans_b=True) * decay
    vn = u - _dot(w, s, prec)
    o = _dot(q * jnp.exp(g), s, prec) + _dot(scores, vn, prec)
    s_next = jnp.exp(g_last) * s + _dot(k * jnp.exp(g_last - g), vn, prec, trans_a=True)
    return o, s_next


def chunk_backward(q, k, w, u, g, s, do, ds, prec):
    """Reverse step of `chunk_forward`. s = state at chunk start, ds = ∂L/∂(state after the chunk).

    Returns (dq, dk, dw, du, dg (C,1), ds_prev (K,V)), all fp32.
    """
    decay, row, col, g_last, last = _decays(g)
    eg = jnp.exp(g)
    ek = jnp.exp(g_last - g)
    qk = _dot(q, k, prec, trans_b=True)
    scores = qk * decay
    vn = u - _dot(w, s, prec)
    kd = k * ek
    dvn = _dot(scores, do, prec, trans_a=True) + _dot(kd, ds, prec)
    dw = -_dot(dvn, s, prec, trans_b=True)
    dqd = _dot(do, s, prec, trans_b=True)
    dsc = _dot(do, vn, prec, trans_b=True) * decay  # ∂L/∂(q kᵀ), zero above the diagonal
    dq = dqd * eg + _dot(dsc, k, prec)
    dkd = _dot(vn, ds, prec, trans_b=True)
    dk = _dot(dsc, q, prec, trans_a=True) + dkd * ek
    m = dsc * qk  # ∂L/∂(G_i − G_j) on i ≥ j
    m_colsum = jnp.sum(jnp.where(row == col, jnp.sum(m, axis=0, keepdims=True), 0.0), axis=1, keepdims=True)
    s_k = jnp.sum(dkd * kd, axis=1, keepdims=True)
    d_glast = jnp.sum(s_k) + jnp.exp(g_last) * jnp.sum(ds * s)
    dg = (
        jnp.sum(dqd * q * eg, axis=1, keepdims=True)
        + jnp.sum(m, axis=1, keepdims=True)
        - m_colsum
        - s_k
        + jnp.where(last, d_glast, 0.0)
    )
    ds_prev = _dot(q * eg, do, prec, trans_a=True) + jnp.exp(g_last) * ds - _dot(w, dvn, prec, trans_a=True)
    return dq, dk, dw, dvn, dg, ds_prev


def _round_up_pow2(n, minimum=16):
    p = minimum
    while p < n:
        p *= 2
    return p


def default_precision(dtype):
    """fp32 inputs: exact fp32 matmuls. bf16/fp16 inputs: the backend default (TF32 on GPU), whose
    error is below the bf16 rounding of the inputs themselves."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def make_recurrence(fwd_call, bwd_call):
    """custom_vjp around a backend's (fwd_call, bwd_call).

    fwd_call(q, k, w, u, g, s0, *, save_states, prec) → (o, s_final, states or None)
    bwd_call(q, k, w, u, g, states, do, ds_final, *, prec) → (dq, dk, dw, du, dg, ds0)
    Arrays are [B,H,Tp,·] fp32 with Tp a chunk multiple and K,V padded; g is [B,H,Tp,1].
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
    def recurrence(q, k, w, u, g, s0, prec):
        o, s_final, _ = fwd_call(q, k, w, u, g, s0, save_states=False, prec=prec)
        return o, s_final

    def rec_fwd(q, k, w, u, g, s0, prec):
        o, s_final, states = fwd_call(q, k, w, u, g, s0, save_states=True, prec=prec)
        return (o, s_final), (q, k, w, u, g, states)

    def rec_bwd(prec, res, cts):
        q, k, w, u, g, states = res
        do, ds_final = cts
        return bwd_call(q, k, w, u, g, states, do.astype(_F32), ds_final.astype(_F32), prec=prec)

    recurrence.defvjp(rec_fwd, rec_bwd)
    return recurrence


# ------------------------------------------------------------------------------------ 3. the wrapper


def chunked_gated_delta_rule(
    recurrence,
    q,
    k,
    v,
    g,
    beta,
    *,
    scale,
    initial_state,
    output_final_state,
    use_qk_l2norm,
    chunk_size,
    pad_pow2,
    prec=None,
):
    """Prologue (l2norm, time padding, WY transform), then a backend's ``recurrence`` (from `make_recurrence`).

    With ``pad_pow2`` (the Pallas kernels: Triton block shapes) K and V are zero padded to powers of two ≥ 16;
    zero columns of q, k, W and U contribute nothing, and the padded rows/columns of the state stay zero.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    prec = default_precision(q.dtype) if prec is None else prec
    p = chunk_prep(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=C)
    Kp, Vp = (_round_up_pow2(K), _round_up_pow2(V)) if pad_pow2 else (K, V)

    def flat(x, d, dp):  # [B,H,N,C,d] -> [B,H,Tp,dp]
        x = x.reshape(B, H, -1, d)
        return jnp.pad(x, [(0, 0)] * 3 + [(0, dp - d)]) if dp != d else x

    qf, kf, wf = (flat(p[n], K, Kp) for n in ("q", "k", "w"))
    uf = flat(p["u"], V, Vp)
    gf = p["gcum"].reshape(B, H, -1, 1)
    s0 = jnp.zeros((B, H, Kp, Vp), _F32)
    if initial_state is not None:
        s0 = s0.at[:, :, :K, :V].set(initial_state.astype(_F32))
    o, s_final = recurrence(qf, kf, wf, uf, gf, s0, prec)
    o = jnp.moveaxis(o[:, :, :T, :V], 1, 2).astype(q.dtype)
    return o, (s_final[:, :, :K, :V] if output_final_state else None)
