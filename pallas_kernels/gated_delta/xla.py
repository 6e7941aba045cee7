"""Chunked gated delta rule in plain XLA: the CPU default and every platform's fallback.

The math is chunk_math's (WY prologue, chunk functions, `make_rule`'s custom_vjp, run block by block:
``block_chunks``); here the recurrence of one block of chunks runs as batched XLA:

- forward: the chunk-parallel parts ((q kᵀ) ⊙ D, q e^G, k e^{G_C − G}) are batched over the block's chunks first;
  a loop over chunks then carries the state, S_{n+1} = e^{G_C} S_n + (k e^{G_C − G})ᵀ ν_n with ν_n = U − W S_n, stores
  each chunk's start state S_n (the backward's residual) and writes O_n = (q e^G) S_n + ((q kᵀ) ⊙ D) ν_n while
  S_n and ν_n are at hand. Why the output is not one batched product after the loop: that stores ν for every
  chunk and reads it and all S_n back (a [B,H,N,K,V] array is 2x the input at K = V = 2C), and on the
  memory-bound CPU those passes cost more than the smaller per-step products (bench/RESULTS.md, "XLA forward").
- backward: only the dS recurrence is sequential,
      dν_n = ((q kᵀ) ⊙ D)ᵀ dO_n + (k e^{G_C − G}) dS_{n+1},   dS_n = (q e^G)ᵀ dO_n + e^{G_C} dS_{n+1} − W_nᵀ dν_n,
  a reverse loop whose chunk-parallel terms ((q kᵀ ⊙ D)ᵀ dO, (q e^G)ᵀ dO) are computed before it. With every
  dS_{n+1} known, `chunk_math.grads_tile`/`grads_finish` give each chunk's dq, dk, dW, dG independently: one
  batched (vmapped) call over the block's chunks (dU = dν).

Everything runs in fp32 (``operand_dtype=float32``): on a CPU bf16 dots are no faster, and this path is the
fallback users compare against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import chunk_math
from .chunk_math import _mm

_F32 = jnp.float32

# Tokens per block of the rule (`chunk_math.make_rule`'s ``block_chunks``): the forward and the backward walk the
# sequence block by block, so their temporaries scale with this, not with T. Small blocks also keep each block's
# working set in cache: on the CPU 256 tokens was the fastest of 256/512/1024 (bench/RESULTS.md, "XLA memory").
BLOCK_TOKENS = 256


def _chunked(x, C):
    """[B,H,Tp,d] -> [B,H,N,C,d]."""
    B, H, Tp, d = x.shape
    return x.reshape(B, H, Tp // C, C, d)


def _at(x, n):
    """Chunk n of a [B,H,N,...] array. The loops index the chunk axis in place: moving it to the front for a
    `lax.scan` costs a transposing copy of every input and output (~10 ms each at T=8K on the 2-core CPU)."""
    return jax.lax.dynamic_index_in_dim(x, n, axis=2, keepdims=False)


def _put(x, value, n):
    return jax.lax.dynamic_update_index_in_dim(x, value, n, axis=2)


def _decay_terms(g, doc, C):
    """g, doc [B,H,Tp,1] (chunk-local cumulative decay, document index or None) → causal decay D [B,H,N,C,C]
    and the `chunk_math.decay_gates` read [B,H,N,C,1], write [B,H,N,C,1] and carry [B,H,N,1,1]."""
    B, H, Tp, _ = g.shape
    G = g.reshape(B, H, Tp // C, C)
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    keep = i >= j
    doc_last = None
    if doc is not None:
        doc = doc.reshape(G.shape)
        keep = keep & (doc[..., :, None] == doc[..., None, :])
        doc_last = doc[..., -1:]
    causal = jnp.exp(jnp.where(keep, G[..., :, None] - G[..., None, :], -jnp.inf))  # mask before exp
    read, write, carry = chunk_math.decay_gates(G, G[..., -1:], doc, doc_last)
    return causal, read[..., None], write[..., None], carry[..., None]


def fwd_call(q, k, w, u, g, doc, s0, *, prec, chunk_size):
    """Arrays [B,H,Tp,·] fp32, g and doc (or None) [B,H,Tp,1] → (o [B,H,Tp,V], final state, start states
    [B,H,N,K,V])."""
    B, H, Tp, K = q.shape
    V = u.shape[-1]
    C = chunk_size
    qc, kc, wc, uc = (_chunked(x, C) for x in (q, k, w, u))
    causal, read, write, gam = _decay_terms(g, doc, C)  # gam [B,H,N,1,1]: whole-chunk decay
    scores = _mm("bhnik,bhnjk->bhnij", qc, kc, prec) * causal  # intra-chunk q·k with decay
    qd = qc * read  # reads the chunk-start state
    kd = kc * write  # writes, decayed to the chunk end

    def body(n, carry):
        s, s_start, o = carry
        qd_n, scores_n, kd_n, w_n, u_n, gam_n = (_at(x, n) for x in (qd, scores, kd, wc, uc, gam))
        vn_n = u_n - _mm("bhck,bhkv->bhcv", w_n, s, prec)
        o_n = _mm("bhck,bhkv->bhcv", qd_n, s, prec) + _mm("bhij,bhjv->bhiv", scores_n, vn_n, prec)
        s_start, o = _put(s_start, s, n), _put(o, o_n, n)
        return gam_n * s + _mm("bhck,bhcv->bhkv", kd_n, vn_n, prec), s_start, o

    N = Tp // C
    s, s_start, o = jax.lax.fori_loop(
        0, N, body, (s0, jnp.zeros((B, H, N, K, V), _F32), jnp.zeros((B, H, N, C, V), _F32))
    )
    return o.reshape(B, H, Tp, V), s, s_start


def bwd_call(q, k, w, u, g, doc, states, do, ds_final, *, prec, chunk_size):
    """VJP of `fwd_call` from the saved start states: → (dq, dk, dw, du, dg, ds0), shapes as the inputs."""
    B, H, Tp, K = q.shape
    V = u.shape[-1]
    C = chunk_size
    N = Tp // C
    qc, kc, wc, uc, do_c = (_chunked(x, C) for x in (q, k, w, u, do))
    causal, read, write, gam = _decay_terms(g, doc, C)
    scores = _mm("bhnik,bhnjk->bhnij", qc, kc, prec) * causal
    dvn_from_o = _mm("bhnij,bhniv->bhnjv", scores, do_c, prec)  # ((q kᵀ) ⊙ D)ᵀ dO
    ds_from_o = _mm("bhnck,bhncv->bhnkv", qc * read, do_c, prec)  # (q e^G)ᵀ dO
    kd = kc * write

    def body(i, carry):  # ds = ∂L/∂S_{n+1}  →  ∂L/∂S_n, for n = N−1 … 0
        ds, ds_after, dvn_all = carry
        n = N - 1 - i
        dvn_o, ds_o, kd_n, w_n, gam_n = (_at(x, n) for x in (dvn_from_o, ds_from_o, kd, wc, gam))
        dvn = dvn_o + _mm("bhck,bhkv->bhcv", kd_n, ds, prec)
        ds_after, dvn_all = _put(ds_after, ds, n), _put(dvn_all, dvn, n)
        return ds_o + gam_n * ds - _mm("bhck,bhcv->bhkv", w_n, dvn, prec), ds_after, dvn_all

    init = (ds_final, jnp.zeros((B, H, N, K, V), _F32), jnp.zeros((B, H, N, C, V), _F32))
    ds0, ds_after, dvn = jax.lax.fori_loop(0, N, body, init)  # ds_after[n] = ∂L/∂S_{n+1}

    def flat(x):  # [B,H,N,...] -> [B·H·N, ...]
        return x.reshape((B * H * N,) + x.shape[3:])

    def per_chunk(q, k, w, u, g, doc, s, do, dvn, ds):
        acc = chunk_math.grads_tile(chunk_math.grads_init(C, K), w, u, s, do, dvn, ds, prec)
        return chunk_math.grads_finish(q, k, g, acc, prec, doc)

    docs = None if doc is None else flat(_chunked(doc, C))
    chunks = map(flat, (qc, kc, wc, uc, _chunked(g, C)))
    dq, dk, dw, dg = jax.vmap(per_chunk)(*chunks, docs, *map(flat, (states, do_c, dvn, ds_after)))
    back = lambda x: x.reshape(B, H, Tp, x.shape[-1])  # noqa: E731
    return back(dq), back(dk), back(dw), back(dvn), back(dg), ds0


@functools.cache
def rule(chunk_size=64):
    """The custom_vjp rule for one chunk size (cached so jit sees one function)."""
    return chunk_math.make_rule(
        functools.partial(fwd_call, chunk_size=chunk_size),
        functools.partial(bwd_call, chunk_size=chunk_size),
        block_chunks=max(1, BLOCK_TOKENS // chunk_size),
    )


def chunk_gated_delta_rule_xla(
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
    chunk_size=64,
    segment_ids=None,
    prec=None,
):
    """Chunked forward in XLA with a hand-written backward. Shapes as in api.chunk_gated_delta_rule."""
    return chunk_math.chunked_gated_delta_rule(
        rule(chunk_size),
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        pad_pow2=False,
        segment_ids=segment_ids,
        operand_dtype=jnp.float32,
        prec=prec,
    )
