"""The chunk math shared by the Pallas GPU (Triton) and TPU (Mosaic) kernels, and their JAX wrapper.

Division of labour (why the kernels start after the WY transform): W, U come from a unit lower
triangular solve per chunk. Triton has no triangular solve, and the solve-free alternatives (Neumann
/ doubling products Π(I + A^{2^m})) lose all precision when keys are correlated (powers of a strictly
lower matrix of ones grow like binomial coefficients, ~1e18 at C = 64). The solve is chunk-parallel
batched work that XLA already does well, so `xla.chunk_prep` computes q·scale, k, W, U and the
chunk-local cumulative decay G, and the kernels do the sequential part with the state held on chip
in fp32 (never written to HBM except at chunk boundaries for the backward pass):

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

Everything here is written with ops that lower on Triton, Mosaic TPU and in interpret mode: 2-D
`jnp.dot`/`lax.dot_general`, broadcasted iota masks, full or single-axis reductions, `jnp.where`;
no gathers, no dynamic value indexing, no 1-D layouts (G travels as a (C, 1) column).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import xla as _xla

_F32 = jnp.float32


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
    dsc = _dot(do, vn, prec, trans_b=True) * decay          # ∂L/∂(q kᵀ), zero above the diagonal
    dq = dqd * eg + _dot(dsc, k, prec)
    dkd = _dot(vn, ds, prec, trans_b=True)
    dk = _dot(dsc, q, prec, trans_a=True) + dkd * ek
    m = dsc * qk                                              # ∂L/∂(G_i − G_j) on i ≥ j
    m_colsum = jnp.sum(jnp.where(row == col, jnp.sum(m, axis=0, keepdims=True), 0.0), axis=1, keepdims=True)
    s_k = jnp.sum(dkd * kd, axis=1, keepdims=True)
    d_glast = jnp.sum(s_k) + jnp.exp(g_last) * jnp.sum(ds * s)
    dg = (jnp.sum(dqd * q * eg, axis=1, keepdims=True) + jnp.sum(m, axis=1, keepdims=True) - m_colsum
          - s_k + jnp.where(last, d_glast, 0.0))
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


def chunk_gated_delta_rule_pallas(recurrence, q, k, v, g, beta, *, scale, initial_state, output_final_state,
                                  use_qk_l2norm, chunk_size, prec=None):
    """Shared wrapper: XLA prologue (l2norm, padding, WY transform), then the Pallas recurrence.

    K and V are zero padded to powers of two ≥ 16 (Triton block shapes); zero columns of q, k, W
    and U contribute nothing, and the padded rows/columns of the state stay zero.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    prec = default_precision(q.dtype) if prec is None else prec
    p = _xla.chunk_prep(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=C)
    Kp, Vp = _round_up_pow2(K), _round_up_pow2(V)

    def flat(x, d, dp):  # [B,H,N,C,d] -> [B,H,Tp,dp]
        x = x.reshape(B, H, -1, d)
        return jnp.pad(x, [(0, 0)] * 3 + [(0, dp - d)])

    qf, kf, wf = (flat(p[n], K, Kp) for n in ("q", "k", "w"))
    uf = flat(p["u"], V, Vp)
    gf = p["gcum"].reshape(B, H, -1, 1)
    s0 = jnp.zeros((B, H, Kp, Vp), _F32)
    if initial_state is not None:
        s0 = s0.at[:, :, :K, :V].set(initial_state.astype(_F32))
    o, s_final = recurrence(qf, kf, wf, uf, gf, s0, prec)
    o = jnp.moveaxis(o[:, :, :T, :V], 1, 2).astype(q.dtype)
    return o, (s_final[:, :, :K, :V] if output_final_state else None)
