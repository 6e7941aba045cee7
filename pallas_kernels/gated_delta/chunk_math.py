"""The chunk math of the gated delta rule, shared by the XLA path and the Pallas GPU (Triton) and TPU (Mosaic) kernels.

Every backend runs the same parts:

1. The WY prologue (`chunk_prep`, chunk-parallel XLA): within a chunk of C tokens with state S (K×V) at the chunk
   start, let G_i = Σ_{m≤i} g_m (chunk-local cumulative log decay). Unrolling the recurrence (reference.py) gives,
   for the "new values" ν_i = β_i (v_i − recall_i) that the delta rule writes,

       (I + A) ν = β v − (β e^G k) S,      A_ij = β_i (k_i·k_j) e^{G_i − G_j}  for i > j, else 0
       ⇒ ν = U − W S,   U = T (β v),  W = T (β e^G k),  T = (I + A)⁻¹   (unit lower triangular)

   The XLA path and the TPU kernels compute it here: `unit_lower_solve` inverts by exact block inversion in
   batched matmuls (the solve-free products Π(I + A^{2^m}) lose all precision when keys are correlated: powers of
   a strictly lower matrix of ones grow like binomial coefficients, ~1e18 at C = 64) and has its own VJP (two
   matmuls), so the backward never differentiates through the inversion steps. On a GPU a kernel computes the
   same quantities for half-precision runs by blocked forward substitution (pallas_gpu's `_prologue_kernel`, given to `make_rule` as
   ``prologue_call``); its VJP is this one's.

2. The chunk functions (section 2), each one chunk of C tokens; D_ij = e^{G_i − G_j} for i ≥ j else 0:

   forward, split so that only the state recurrence is sequential:
       `state_step` (sequential):   ν = U − W S_n,   S_{n+1} = e^{G_C} S_n + (k ⊙ e^{G_C − G})ᵀ ν
       `output_tile` (chunk-parallel, from the stored S_n):   O = (q ⊙ e^G) S_n + ((q kᵀ) ⊙ D)(U − W S_n)

   backward, with dS_{n+1} = ∂L/∂S_{n+1}:
       `intra_chunk`ᵀ dO (chunk-parallel):   dν_local = ((q kᵀ) ⊙ D)ᵀ dO
       `dstate_step` (sequential, chunks in reverse):
           dν = dν_local + (k ⊙ e^{G_C − G}) dS_{n+1}
           dS_n = (q ⊙ e^G)ᵀ dO + e^{G_C} dS_{n+1} − Wᵀ dν
       `grads_tile` + `grads_finish` (chunk-parallel, from S_n, dS_{n+1}, dν; ν recomputed as U − W S_n):
           dU = dν ;  dW = −dν S_nᵀ
           dq = (dO S_nᵀ) ⊙ e^G + (dP ⊙ D) k,      dP = dO νᵀ
           dk = (dP ⊙ D)ᵀ q + (ν dS_{n+1}ᵀ) ⊙ e^{G_C − G}
           dG_i = Σ_k dq̂_ik q̂_ik + Σ_j M_ij − Σ_j M_ji − Σ_k dk̂_ik k̂_ik  (+ at i = C−1:
                  Σ_ik dk̂ ⊙ k̂ + e^{G_C} Σ dS_{n+1} ⊙ S_n),  M = dP ⊙ (q kᵀ) ⊙ D, q̂ = q e^G, k̂ = k e^{G_C − G}

   The sequential steps never form a C×C product, so the GPU kernels can split V into tiles there without
   recomputing q kᵀ per tile; the chunk-parallel kernels form q kᵀ once per chunk and loop over V tiles inside.

Packed documents (segment ids). At a document start t > 0 the state restarts from zero. Per chunk, with doc_i the
chunk-local document index (`chunk_documents`: the number of starts at chunk positions ≤ i, so doc_i = 0 for the
tokens that continue the document the chunk began in), the prologue and every chunk function take

    E_ij = [doc_i = doc_j]          (i, j of one document)          r_i = [doc_i = 0]           (reads S_n)
    w_j = [doc_j = doc_{C−1}]       (writes into S_{n+1})           c = [doc_{C−1} = 0]          (S_n survives)
    G_i = Σ_{m ≤ i, E_im} g_m       (segment-local cumulative decay; G_C = G_{C−1})

and every formula above holds with the decays masked:

    D_ij = E_ij e^{G_i − G_j} (i ≥ j),   A_ij = E_ij β_i (k_i·k_j) e^{G_i − G_j} (i > j),   W = T (β r e^G k),
    O = (q ⊙ r e^G) S_n + ((q kᵀ) ⊙ D) ν,   S_{n+1} = c e^{G_C} S_n + (k ⊙ w e^{G_C − G})ᵀ ν

(T is block diagonal by document, so W's rows vanish where r = 0). The backward takes the same masked q̂ = q r e^G,
k̂ = k w e^{G_C − G}, D and c e^{G_C}: the dG terms of masked entries vanish with them, and the prologue's VJP
carries dG to g through the segment-local sums. Every masked exponent is set to −inf before exp (the kept ones are
≤ 0): no reset is emulated by a huge decay, so nothing overflows and no large cumulative sums cancel. Without segment ids the masks
are all ones and the kernels take no document operand. Tokens padded after T repeat the last id: they start nothing.

3. `make_rule`: one custom_vjp around the whole rule (prologue and recurrence) that saves only its inputs (in their
   own dtype) and the chunk-start states S_n; the backward recomputes the prologue (cheap, chunk-parallel) and
   differentiates it with `jax.vjp`. `chunked_gated_delta_rule` calls it. With ``block_chunks`` (the XLA path) both
   passes walk the sequence in blocks of chunks, saving only each block's start state, so their temporaries are
   block-sized (`_blocked_forward`, `_blocked_backward`).

Operand dtype: q, k, W and the stored states S_n enter the kernels' dots in the input dtype (bf16 stays bf16, so
the dots run on bf16 tensor cores / MXU passes) with fp32 accumulation; the decays G, U, the carried states and every
gradient stay fp32, and an fp32 value is cast to the operand dtype only right before it enters a dot. Where the
new values ν = U − W S (a small difference of larger terms) enter the gradient dots, they go in as two bf16 parts
(`hi_lo`): with U or ν rounded to bf16, ∂L/∂g was off by 2.2x the reference's own bf16 error, 1.4x with them kept.

The chunk functions are written with ops that lower on Triton, Mosaic TPU and in interpret mode: 2-D
`lax.dot_general`, broadcasted iota masks, single-axis reductions with keepdims, `jnp.where`; no gathers, no
dynamic value indexing, no 1-D or 0-d values (G travels as a (C, 1) column, or a (1, C) row in the TPU kernels'
layout, G_C as a (1, 1) block: Mosaic cannot always legalise a transcendental on a scalar). Every exponent is ≤ 0: decay differences are masked to −inf where
i < j BEFORE exp, so even g = −20 per step over a 64-token chunk cannot overflow.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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


def chunk_documents(segment_ids, chunk_size):
    """Segment ids [B, T] (int) → the chunk-local document index ``doc`` [B, N, C], fp32.

    A document starts wherever segment_ids[b, t] ≠ segment_ids[b, t−1] (t > 0; a change of id, so an id that
    comes back later starts a new document). doc_i counts those starts at chunk positions ≤ i, so 0 marks the
    tokens that continue the document the chunk began in (they read the carried state) and equal values mark
    one document. Padded steps repeat the last id: they start nothing and leave the final state alone.
    Why fp32: small integers (≤ C) compare exactly, and a float column transposes to a row inside the kernels
    the way G does (`_as_row`); an int transpose does not lower everywhere.
    """
    B, T = segment_ids.shape
    C = chunk_size
    pad = (-T) % C
    seg = jnp.pad(segment_ids, [(0, 0), (0, pad)], mode="edge")
    starts = jnp.concatenate([jnp.zeros((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return jnp.cumsum(starts.reshape(B, -1, C).astype(jnp.int32), axis=-1).astype(_F32)


def chunk_inputs(q, k, v, g, beta, *, scale, use_qk_l2norm, chunk_size):
    """The prologue's inputs, fp32 [B,H,N,C,·] (g, beta [B,H,N,C]): q, k L2-normalised when asked, q scaled, T
    zero padded to a chunk multiple. Padded steps have g=0, β=0, k=0, so they leave the state unchanged (α=1,
    nothing written)."""
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

    return tuple(map(to_chunks, (q, k, v, g, beta)))


def chunk_prep(q, k, v, g, beta, *, scale, use_qk_l2norm, chunk_size, doc=None):
    """Pads T to a chunk multiple and computes the chunk-parallel WY quantities, all fp32.

    Returns a dict of [B,H,N,C,·] arrays: q (scaled), k, w, u and gcum [B,H,N,C] (`chunk_inputs` pads). With
    ``doc`` [B,N,C] (`chunk_documents`), gcum is the segment-local cumulative decay, A only couples tokens of one
    document and W's right-hand side only keeps the rows that read the carried state ("Packed documents" in the
    module docstring).
    """
    C = chunk_size
    q, k, v, g, beta = chunk_inputs(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=C)
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    if doc is None:
        # The chunk-local cumsum as a product with a lower-triangular ones matrix: XLA CPU lowers `cumsum` to a
        # reduce-window that it then fuses into every consumer, re-summing up to C terms per element of the
        # [C, C] decay below (profiled at T=8K, 9 heads: that exp fusion took 19 ms, 7 ms with the matmul).
        gcum = _mm("...j,ij->...i", g, (i >= j).astype(_F32))
        coupled = i > j
        eg = jnp.exp(gcum)
    else:
        doc = doc[:, None]  # [B,1,N,C]: the same documents for every head
        same = doc[..., :, None] == doc[..., None, :]  # [B,1,N,C,C]
        gcum = _mm("...j,...ij->...i", g, ((i >= j) & same).astype(_F32))  # Σ g over the document, up to i
        coupled = (i > j) & same
        eg = jnp.exp(jnp.where(doc == 0, gcum, -jnp.inf))  # r ⊙ e^G: only the carried document reads S_n
    # Mask before exp: only i > j (of one document) ever reaches exp; the rest becomes exp(−inf) = 0.
    decay = jnp.exp(jnp.where(coupled, gcum[..., :, None] - gcum[..., None, :], -jnp.inf))
    a = beta[..., :, None] * _mm("bhnik,bhnjk->bhnij", k, k) * decay
    # W and U as one solve, but with the two right-hand sides kept apart: a concatenation of two activation-sized
    # arrays is a slow copy on XLA CPU.
    w, u = unit_lower_solve(a, (beta[..., None] * eg[..., None] * k, beta[..., None] * v))
    return dict(q=q, k=k, w=w, u=u, gcum=gcum)


# ------------------------------------------------------------------------------------ 2. one chunk


def dot(a, b, prec, trans_a=False, trans_b=False):
    """2-D a·b (or aᵀ·b, a·bᵀ) with fp32 accumulation; a and b enter in their own dtype."""
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=prec, preferred_element_type=_F32)


def _total(x):
    """Σ of a 2-D array as a (1, 1) block (two keepdims reductions: no 0-d value)."""
    return jnp.sum(jnp.sum(x, axis=1, keepdims=True), axis=0, keepdims=True)


def _chunk_end(g):
    """g, the chunk-local cumulative log decay as a (C,1) column or a (1,C) row → (G_C as a (1,1) block, the mask
    of g's last entry)."""
    axis = 0 if g.shape[1] == 1 else 1
    last = jax.lax.broadcasted_iota(jnp.int32, g.shape, axis) == g.shape[axis] - 1
    return jnp.sum(jnp.where(last, g, 0.0), axis=axis, keepdims=True), last


def _iotas(C):
    """Row and column index of a (C,C) block."""
    return jax.lax.broadcasted_iota(jnp.int32, (C, C), 0), jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)


def _as_row(x, row, col):
    """A (C,1) column as a (1,C) row, by a masked reduction: portable where a (C,1)->(1,C) transpose is not."""
    return jnp.sum(jnp.where(row == col, x, 0.0), axis=0, keepdims=True)


def as_row(x):
    """A (C,1) column as a (1,C) row (`_as_row` with its iotas)."""
    return _as_row(x, *_iotas(x.shape[0]))


def as_column(x):
    """A (1,C) row as a (C,1) column, by a masked reduction (the inverse of `_as_row`)."""
    row, col = _iotas(x.shape[1])
    return jnp.sum(jnp.where(row == col, x, 0.0), axis=1, keepdims=True)


def _causal_decay(g, doc=None, transposed=False):
    """D (C,C): e^{G_i − G_j} for i ≥ j (and, with ``doc``, i and j of one document), else 0; plus the iotas.
    ``transposed``: Dᵀ instead (e^{G_j − G_i} for j ≥ i), for a product that would otherwise read D transposed."""
    row, col = _iotas(g.shape[0])
    exponent = g - _as_row(g, row, col)  # G_i − G_j
    keep = row >= col
    if transposed:  # built the other way round from the iotas: no value is transposed
        keep, exponent = row <= col, -exponent
    if doc is not None:
        keep = keep & (doc == _as_row(doc, row, col))  # one document: a symmetric relation
    # Mask before exp: only kept pairs (non-positive exponents) reach exp.
    return jnp.exp(jnp.where(keep, exponent, -jnp.inf)), row, col


def decay_gates(g, g_last, doc=None, doc_last=None):
    """The chunk's decay factors (any leading axes; g, doc (..., C, 1) or (..., C); g_last, doc_last (..., 1, 1)
    or (..., 1)):

        read  r ⊙ e^{G},   write  w ⊙ e^{G_C − G},   carry  c e^{G_C}

    Without ``doc`` r = w = c = 1. With it (`chunk_documents`): r_i = [doc_i = 0] (token i continues the document
    the chunk began in, so it reads S_n), w_j = [doc_j = doc_{C−1}] (token j writes into S_{n+1}), c = [doc_{C−1}
    = 0] (S_n survives the chunk). Exponents are masked to −inf before exp (every kept one is ≤ 0).
    """
    if doc is None:
        return jnp.exp(g), jnp.exp(g_last - g), jnp.exp(g_last)
    return (
        jnp.exp(jnp.where(doc == 0, g, -jnp.inf)),
        jnp.exp(jnp.where(doc == doc_last, g_last - g, -jnp.inf)),
        jnp.exp(jnp.where(doc_last == 0, g_last, -jnp.inf)),
    )


def _gates(g, doc):
    """`decay_gates` of one chunk (g, doc both (C,1) columns or both (1,C) rows) → (read, write, carry, G_C (1,1),
    the mask of the last entry), the gates in g's layout."""
    g_last, last = _chunk_end(g)
    doc_last = None if doc is None else _chunk_end(doc)[0]
    return (*decay_gates(g, g_last, doc, doc_last), g_last, last)


def hi_lo(x, dt):
    """fp32 x as (x_hi, x_lo) in dtype dt, x_lo the rounding error of x_hi: ~16 mantissa bits as two bf16 dot
    operands. (x, None) when dt is fp32. Used for ν = U − W S, a small difference of larger terms."""
    if dt == _F32:
        return x, None
    hi = x.astype(dt)
    return hi, (x - hi.astype(_F32)).astype(dt)


def state_step(k, w, u, g, s, prec, doc=None, *, keys_transposed=False):
    """S_{n+1} = e^{G_C} S_n + (k ⊙ e^{G_C − G})ᵀ (U − W S_n) for one V tile (gated by c and w with ``doc``).

    k, w (C,K) in the operand dtype; u (C,BV), g, doc (C,1) and s (K,BV) fp32 → fp32 (K,BV).
    ``keys_transposed`` (the TPU kernels' layout): k is given as kᵀ (K,C) and g, doc as (1,C) rows, so the
    update is a plain (K,C)·(C,BV) product instead of one that reads its left operand transposed.
    """
    dt = k.dtype
    _, write, carry, _, _ = _gates(g, doc)
    vn = u.astype(_F32) - dot(w, s.astype(dt), prec)
    kd = (k.astype(_F32) * write).astype(dt)
    return carry * s + dot(kd, vn.astype(dt), prec, trans_a=not keys_transposed)


def intra_chunk(q, k, g, prec, doc=None, *, transposed=False):
    """(q kᵀ) ⊙ D and q ⊙ e^G (⊙ r), both in the operand dtype, formed once per chunk for all V tiles.
    ``transposed``: ((q kᵀ) ⊙ D)ᵀ = (k qᵀ) ⊙ Dᵀ instead of the first, for dν_local without a transposed-lhs
    product."""
    dt = q.dtype
    decay, _, _ = _causal_decay(g, doc, transposed)
    read = _gates(g, doc)[0]
    scores = (dot(k, q, prec, trans_b=True) if transposed else dot(q, k, prec, trans_b=True)) * decay
    return scores.astype(dt), (q.astype(_F32) * read).astype(dt)


def output_tile(qd, scores, w, u, s, prec):
    """O = (q ⊙ e^G) S_n + ((q kᵀ) ⊙ D)(U − W S_n) for one V tile (u (C,BV), s (K,BV)) → fp32 (C,BV)."""
    dt = w.dtype
    s = s.astype(dt)
    vn = u.astype(_F32) - dot(w, s, prec)
    return dot(qd, s, prec) + dot(scores, vn.astype(dt), prec)


def dstate_step(q, k, w, g, do, dvl, ds, prec, doc=None, *, transposed=False):
    """Reverse step: ds = dS_{n+1} (K,BV) fp32, dvl = ((q kᵀ) ⊙ D)ᵀ dO (C,BV) fp32 → (dν (C,BV), dS_n), fp32.

    ``transposed`` (the TPU kernels' layout): q and w are given as qᵀ, Wᵀ (K,C) and g, doc as (1,C) rows (k stays
    (C,K)), so every product is a plain one; the write gate, needed as a column for k, is turned by `as_column`.
    """
    dt = k.dtype
    read, write, carry, _, _ = _gates(g, doc)
    kd = (k.astype(_F32) * (as_column(write) if transposed else write)).astype(dt)
    dvn = dvl + dot(kd, ds.astype(dt), prec)
    qd = (q.astype(_F32) * read).astype(dt)
    ds_prev = dot(qd, do.astype(dt), prec, trans_a=not transposed) + carry * ds
    return dvn, ds_prev - dot(w, dvn.astype(dt), prec, trans_a=not transposed)


def grads_init(C, K):
    """Accumulators of `grads_tile`: dO S_nᵀ, ν dS_{n+1}ᵀ, dW (C,K); dP (C,C); Σ dS_{n+1} ⊙ S_n (1,1)."""
    return (jnp.zeros((C, K), _F32),) * 3 + (jnp.zeros((C, C), _F32), jnp.zeros((1, 1), _F32))


def grads_tile(acc, w, u, s, do, dvn, ds, prec):
    """Adds one V tile's share (u, do, dvn (C,BV); s = S_n, ds = dS_{n+1} (K,BV)) to the `grads_init` sums."""
    dqd, dkd, dw, dp, dss = acc
    dt = do.dtype
    s_op, ds_op = s.astype(dt), ds.astype(dt)
    vn_hi, vn_lo = hi_lo(u.astype(_F32) - dot(w, s_op, prec), dt)
    dkd = dkd + dot(vn_hi, ds_op, prec, trans_b=True)
    dp = dp + dot(do, vn_hi, prec, trans_b=True)
    if vn_lo is not None:  # ν feeds ∂L/∂g through dP and ν dSᵀ: keep its low bits (`hi_lo`)
        dkd = dkd + dot(vn_lo, ds_op, prec, trans_b=True)
        dp = dp + dot(do, vn_lo, prec, trans_b=True)
    return (
        dqd + dot(do, s_op, prec, trans_b=True),
        dkd,
        dw - dot(dvn.astype(dt), s_op, prec, trans_b=True),
        dp,
        dss + _total(ds.astype(_F32) * s.astype(_F32)),
    )


def grads_finish(q, k, g, acc, prec, doc=None):
    """The summed tiles → (dq, dk, dW (C,K), dG (C,1)), fp32 (formulas in the module docstring)."""
    dqd, dkd, dw, dp, dss = acc
    dt = q.dtype
    decay, row, col = _causal_decay(g, doc)
    eg, ek, carry, _, last = _gates(g, doc)
    qk = dot(q, k, prec, trans_b=True)
    dsc = dp * decay  # ∂L/∂(q kᵀ), zero above the diagonal
    dq = dqd * eg + dot(dsc.astype(dt), k, prec)
    dk = dot(dsc.astype(dt), q, prec, trans_a=True) + dkd * ek
    m = dsc * qk  # ∂L/∂(G_i − G_j) on i ≥ j
    m_colsum = jnp.sum(jnp.where(row == col, jnp.sum(m, axis=0, keepdims=True), 0.0), axis=1, keepdims=True)
    s_k = jnp.sum(dkd * k.astype(_F32) * ek, axis=1, keepdims=True)
    d_glast = jnp.sum(s_k, axis=0, keepdims=True) + carry * dss
    dg = (
        jnp.sum(dqd * q.astype(_F32) * eg, axis=1, keepdims=True)
        + jnp.sum(m, axis=1, keepdims=True)
        - m_colsum
        - s_k
        + jnp.where(last, d_glast, 0.0)
    )
    return dq, dk, dw, dg


def _round_up_pow2(n, minimum=16):
    p = minimum
    while p < n:
        p *= 2
    return p


def default_precision(dtype):
    """fp32 inputs: exact fp32 matmuls (no TF32 passes). bf16/fp16 inputs: the dots take bf16/fp16 operands, for
    which the default is already exact products with fp32 accumulation."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


# ------------------------------------------------------------------------------------ 3. the whole rule


class RuleConfig(NamedTuple):
    """Static settings of one `make_rule` call (hashable: the custom_vjp's non-differentiable argument)."""

    scale: float
    use_qk_l2norm: bool
    chunk_size: int
    key_dim_padded: int  # K padded for the backend (powers of two ≥ 16 for Triton blocks; K itself for XLA)
    value_dim_padded: int
    operand_dtype: jnp.dtype  # dtype of q, k, W, U, S_n in the backend's dots
    prec: jax.lax.Precision


def flat_padded(x, dp):
    """[B,H,N,C,d] → [B,H,N·C,dp], the feature axis zero padded to dp (zero columns of q, k, W, U contribute
    nothing); a [B,H,N,C] array → [B,H,N·C,1]."""
    B, H = x.shape[:2]
    if x.ndim == 4:
        return x.reshape(B, H, -1, 1)
    d = x.shape[-1]
    x = x.reshape(B, H, -1, d)
    return jnp.pad(x, [(0, 0)] * 3 + [(0, dp - d)]) if dp != d else x


def _prepare(cfg: RuleConfig, q, k, v, g, beta, doc=None):
    """Prologue → the backend's operands, fp32: q, k, W [B,H,Tp,Kp], U [B,H,Tp,Vp], G [B,H,Tp,1]."""
    p = chunk_prep(
        q, k, v, g, beta, scale=cfg.scale, use_qk_l2norm=cfg.use_qk_l2norm, chunk_size=cfg.chunk_size, doc=doc
    )
    Kp, Vp = cfg.key_dim_padded, cfg.value_dim_padded
    return (
        flat_padded(p["q"], Kp),
        flat_padded(p["k"], Kp),
        flat_padded(p["w"], Kp),
        flat_padded(p["u"], Vp),
        flat_padded(p["gcum"], 1),
    )


def _doc_operand(doc, H):
    """`chunk_documents`' [B,N,C] → the kernels' [B,H,Tp,1] column (G's layout, so it shares G's block specs)."""
    B = doc.shape[0]
    return jnp.broadcast_to(doc.reshape(B, 1, -1, 1), (B, H, doc.shape[1] * doc.shape[2], 1))


def _operands(cfg, prepared):
    """q, k, W in the operand dtype; U and G stay fp32 (U never enters a dot; see `hi_lo` for why it must not be
    rounded)."""
    q, k, w, u, g = prepared
    return q.astype(cfg.operand_dtype), k.astype(cfg.operand_dtype), w.astype(cfg.operand_dtype), u, g


def _pad_state(cfg, s):
    K, V = s.shape[-2:]
    return jnp.pad(s, [(0, 0), (0, 0), (0, cfg.key_dim_padded - K), (0, cfg.value_dim_padded - V)])


def make_rule(fwd_call, bwd_call, *, block_chunks=None, prologue_call=None):
    """The custom_vjp gated delta rule of a backend: ``rule(cfg, q, k, v, g, beta, s0, segment_ids) -> (o, s_final)``.

    q, k [B,T,H,K], v [B,T,H,V], g, beta [B,T,H], s0 [B,H,K,V] fp32, segment_ids [B,T] int or None → o [B,T,H,V]
    in q's dtype, s_final fp32. The backend's calls take [B,H,Tp,·] operands (`_prepare`, cast to
    ``cfg.operand_dtype``; G and the document column fp32):

        fwd_call(q, k, w, u, g, doc, s0, *, prec) → (o [B,H,Tp,Vp], s_final fp32, states [B,H,N,Kp,Vp])
        bwd_call(q, k, w, u, g, doc, states, do, ds_final, *, prec) → (dq, dk, dw, du, dg, ds0), fp32

    ``doc`` is None without segment ids (the kernels then take no document operand at all), else the chunk-local
    document index [B,H,Tp,1] (`chunk_documents`). Saved for the backward: the inputs and the chunk-start states
    (what a sequential pass alone can give); everything else, the prologue included, is recomputed. Segment ids
    get no cotangent.

    ``prologue_call(cfg, q, k, v, g, beta, doc)`` (a backend's prologue; ``doc`` as `_prepare` takes it): the
    operands of `_prepare` as the backend computes them, used for the forward's operands and for the backward's
    recomputed ones; the prologue's VJP stays `_prepare`'s (XLA). None: `_prepare` computes them.

    ``block_chunks`` None: the backward recomputes the prologue for the whole sequence and makes one ``bwd_call``.
    An int: the forward walks the sequence in blocks of that many chunks, carrying S, and saves only each block's
    start state instead of every chunk's (`_blocked_forward`); the backward walks it in reverse, carrying dS, and
    per block recomputes the prologue and the block's chunk-start states (``fwd_call`` from the saved one), calls
    ``bwd_call`` and applies the prologue's VJP, writing the block's input gradients in place
    (`_blocked_backward`). The result is the same (chunks only couple through S and dS), but every temporary
    scales with the block instead of with T.
    """

    prepare_operands = prologue_call or _prepare

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def rule(cfg, q, k, v, g, beta, s0, segment_ids):
        return rule_fwd(cfg, q, k, v, g, beta, s0, segment_ids)[0]

    def rule_fwd(cfg, q, k, v, g, beta, s0, segment_ids):
        B, T, H, K = q.shape
        V = v.shape[-1]
        doc = _documents(cfg, segment_ids)
        if block_chunks is not None:
            o, s_final, starts = _blocked_forward(fwd_call, block_chunks, cfg, (q, k, v, g, beta), s0, doc)
            return (o, s_final[:, :, :K, :V]), (q, k, v, g, beta, segment_ids, starts)
        ops = _operands(cfg, prepare_operands(cfg, q, k, v, g, beta, doc))
        doc_op = None if doc is None else _doc_operand(doc, H)
        o, s_final, states = fwd_call(*ops, doc_op, _pad_state(cfg, s0), prec=cfg.prec)
        o = jnp.moveaxis(o[:, :, :T, :V], 1, 2).astype(q.dtype)
        return (o, s_final[:, :, :K, :V]), (q, k, v, g, beta, segment_ids, states)

    def rule_bwd(cfg, res, cts):
        if block_chunks is not None:
            return _blocked_backward(fwd_call, bwd_call, block_chunks, cfg, res, cts)
        q, k, v, g, beta, segment_ids, states = res
        do, ds_final = cts
        B, T, H, K = q.shape
        V = v.shape[-1]
        doc = _documents(cfg, segment_ids)
        prepare = functools.partial(_prepare, cfg, doc=doc)
        prepared = prepare_operands(cfg, q, k, v, g, beta, doc)
        grads = bwd_call(
            *_operands(cfg, prepared),
            None if doc is None else _doc_operand(doc, H),
            states,
            _heads_first(cfg, do, prepared[0].shape[2]),
            _pad_state(cfg, ds_final.astype(_F32)),
            prec=cfg.prec,
        )
        # The prologue's VJP recomputes it once more, after the kernels: its residuals ([T, C] decay and solve
        # matrices) then never coexist with the backward's temporaries. The barrier keeps XLA from merging the two
        # prologue computations (which would bring that overlap back).
        (q, k, v, g, beta), grads = jax.lax.optimization_barrier(((q, k, v, g, beta), grads))
        _, prep_vjp = jax.vjp(prepare, q, k, v, g, beta)
        return (*prep_vjp(grads[:5]), grads[5][:, :, :K, :V], None)

    rule.defvjp(rule_fwd, rule_bwd)
    return rule


def _documents(cfg, segment_ids):
    return None if segment_ids is None else chunk_documents(segment_ids, cfg.chunk_size)


def _heads_first(cfg, do, rows):
    """dO [B,T,H,V] → the kernels' [B,H,rows,Vp] in the operand dtype (zero rows past T, zero columns past V)."""
    T, V = do.shape[1], do.shape[-1]
    do = jnp.pad(jnp.moveaxis(do, 2, 1), [(0, 0), (0, 0), (0, rows - T), (0, cfg.value_dim_padded - V)])
    return do.astype(cfg.operand_dtype)


def _zeros_after(value, shapes_dtypes):
    """Zero buffers that XLA cannot create before ``value`` (any pytree) exists → (buffers, value).

    A loop's preallocated outputs start as constant broadcasts, which the scheduler is free to place at program
    start, holding their memory through everything before the loop (measured: three [T, H, 64] gradient buffers
    held through the gate's backward of a GDN layer). Passing the zero through an optimisation barrier together
    with ``value`` ties its creation to ``value``; ``value`` must be computed, not a constant (a zero cotangent
    of the final state is one)."""
    zero, value = jax.lax.optimization_barrier((jnp.zeros((), _F32), value))
    return [jnp.broadcast_to(zero.astype(dt), shape) for shape, dt in shapes_dtypes], value


def _block_plan(T, C, block_chunks):
    """Blocks of ``block_chunks`` chunks (``block`` tokens): ``full`` of them inside T, then ``tail`` tokens."""
    block = block_chunks * C
    full = T // block
    return block, full, T - full * block


def _blocked_forward(fwd_call, block_chunks, cfg, inputs, s0, doc):
    """`make_rule`'s forward over blocks of ``block_chunks`` chunks, first block first: per block, the prologue on
    the block's tokens and one ``fwd_call`` from the state carried in (S at the block's start), writing the block's
    output in place. → (o [B,T,H,V] in q's dtype, final state [B,H,Kp,Vp] fp32, block-start states
    [B,H,⌈N/block_chunks⌉,Kp,Vp] fp32: the backward's checkpoints, `_blocked_backward`). The prologue is
    chunk-local, so this equals the whole-sequence forward; its temporaries scale with the block, not with T."""
    q = inputs[0]
    B, T, H, _ = q.shape
    V = inputs[2].shape[-1]
    C = cfg.chunk_size
    block, full, tail = _block_plan(T, C, block_chunks)

    def run(n0, chunks, length, s):
        """Outputs of the tokens [n0·C, n0·C + length) (``chunks`` chunks, static) and the state after them."""
        xs = [jax.lax.dynamic_slice_in_dim(x, n0 * C, length, axis=1) for x in inputs]
        doc_b = None if doc is None else jax.lax.dynamic_slice_in_dim(doc, n0, chunks, axis=1)
        ops = _operands(cfg, _prepare(cfg, *xs, doc_b))
        o, s, _ = fwd_call(*ops, None if doc_b is None else _doc_operand(doc_b, H), s, prec=cfg.prec)
        return jnp.moveaxis(o[:, :, :length, :V], 1, 2).astype(q.dtype), s

    s = _pad_state(cfg, s0)
    if full == 0:
        o, s_final = run(0, -(-T // C), T, s)
        return o, s_final, s[:, :, None]
    starts_shape = (B, H, full + (tail > 0), cfg.key_dim_padded, cfg.value_dim_padded)
    (o, starts), inputs = _zeros_after(inputs, [((B, T, H, V), q.dtype), (starts_shape, _F32)])

    def body(i, carry):
        o, starts, s = carry
        starts = jax.lax.dynamic_update_index_in_dim(starts, s, i, axis=2)
        o_b, s = run(i * block_chunks, block_chunks, block, s)
        return jax.lax.dynamic_update_slice_in_dim(o, o_b, i * block, axis=1), starts, s

    o, starts, s = jax.lax.fori_loop(0, full, body, (o, starts, s))
    if tail:
        starts = jax.lax.dynamic_update_index_in_dim(starts, s, full, axis=2)
        o_b, s = run(full * block_chunks, -(-tail // C), tail, s)
        o = jax.lax.dynamic_update_slice_in_dim(o, o_b, full * block, axis=1)
    return o, s, starts


def _blocked_backward(fwd_call, bwd_call, block_chunks, cfg, res, cts):
    """`make_rule`'s backward over blocks of ``block_chunks`` chunks, last block first.

    A block's gradients need nothing from the rest of the sequence but the state at its start (checkpointed by
    `_blocked_forward`) and dS at its end (carried in from the block after): for the block of chunks [n₀, n₁)
    (tokens [n₀C, min(n₁C, T)))

        S_{n₀ … n₁−1} = fwd_call(prologue(block), S_{n₀})             (the block's chunk-start states, recomputed)
        (dq, dk, dW, dU, dG, dS_{n₀}) = bwd_call(prologue(block), S_{n₀ … n₁−1}, dO_block, dS_{n₁})
        (∂q, ∂k, ∂v, ∂g, ∂β)_block = VJP of the prologue on the block's tokens applied to (dq, dk, dW, dU, dG)

    (the prologue is chunk-local; segment ids become chunk-local document indices over the whole sequence first,
    since a document start depends on the token before the chunk). Saving one state per block instead of one per
    chunk costs a second state recurrence over the block (its outputs are unused and dead-code eliminated) and
    saves (1 − 1/block_chunks) of the [B,H,N,K,V] states, a T-sized fp32 array. The blocks of full length run
    in a reverse `fori_loop` that writes each block's gradients into the [B,T,H,·] outputs; a shorter last block
    (T not a multiple of the block) runs first, on its own. One prologue pass per block serves the kernels'
    operands and the VJP (`jax.vjp` keeps the block's residuals, block-sized).
    """
    q, k, v, g, beta, segment_ids, starts = res
    do, ds_final = cts
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = cfg.chunk_size
    block, full, tail = _block_plan(T, C, block_chunks)
    doc = _documents(cfg, segment_ids)
    inputs = (q, k, v, g, beta)

    def grads_of(b, chunks, length, ds):
        """Gradients of block b's tokens [b·block, b·block + length) (``chunks`` chunks, static), dS at its end."""
        n0 = b * block_chunks
        t0 = n0 * C
        xs = [jax.lax.dynamic_slice_in_dim(x, t0, length, axis=1) for x in inputs]
        doc_b = None if doc is None else jax.lax.dynamic_slice_in_dim(doc, n0, chunks, axis=1)
        prepared, prep_vjp = jax.vjp(functools.partial(_prepare, cfg, doc=doc_b), *xs)
        ops = _operands(cfg, prepared)
        doc_op = None if doc_b is None else _doc_operand(doc_b, H)
        states = fwd_call(*ops, doc_op, jax.lax.dynamic_index_in_dim(starts, b, axis=2, keepdims=False), prec=cfg.prec)
        do_b = _heads_first(cfg, jax.lax.dynamic_slice_in_dim(do, t0, length, axis=1), chunks * C)
        grads = bwd_call(*ops, doc_op, states[2], do_b, ds, prec=cfg.prec)
        return prep_vjp(grads[:5]), grads[5]

    ds = _pad_state(cfg, ds_final.astype(_F32))
    if full == 0:
        dx, ds = grads_of(0, -(-T // C), T, ds)
        return (*dx, ds[:, :, :K, :V], None)
    dx, do = _zeros_after(do, [(x.shape, x.dtype) for x in inputs])
    if tail:
        dx_tail, ds = grads_of(full, -(-tail // C), tail, ds)
        dx = [jax.lax.dynamic_update_slice_in_dim(d, t, full * block, axis=1) for d, t in zip(dx, dx_tail)]

    def body(i, carry):
        dx, ds = carry
        b = full - 1 - i
        dx_b, ds = grads_of(b, block_chunks, block, ds)
        dx = [jax.lax.dynamic_update_slice_in_dim(d, t.astype(d.dtype), b * block, axis=1) for d, t in zip(dx, dx_b)]
        return dx, ds

    dx, ds = jax.lax.fori_loop(0, full, body, (dx, ds))
    return (*dx, ds[:, :, :K, :V], None)


def chunked_gated_delta_rule(
    rule,
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
    segment_ids=None,
    operand_dtype=None,
    prec=None,
):
    """Runs a backend's ``rule`` (from `make_rule`); shapes as in api.chunk_gated_delta_rule.

    With ``pad_pow2`` (the Pallas kernels: Triton block shapes) K and V are zero padded to powers of two ≥ 16;
    the padded rows/columns of the state stay zero. ``operand_dtype`` defaults to q's dtype.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    cfg = RuleConfig(
        scale=float(scale),
        use_qk_l2norm=bool(use_qk_l2norm),
        chunk_size=chunk_size,
        key_dim_padded=_round_up_pow2(K) if pad_pow2 else K,
        value_dim_padded=_round_up_pow2(V) if pad_pow2 else V,
        operand_dtype=jnp.dtype(q.dtype if operand_dtype is None else operand_dtype),
        prec=default_precision(q.dtype) if prec is None else prec,
    )
    s0 = jnp.zeros((B, H, K, V), _F32) if initial_state is None else initial_state.astype(_F32)
    o, s_final = rule(cfg, q, k, v, g, beta, s0, segment_ids)
    return o, (s_final if output_final_state else None)
