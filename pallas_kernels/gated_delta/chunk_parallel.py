"""The chunk-parallel Pallas kernels of the gated delta rule, shared by the GPU (Triton) and TPU (Mosaic) backends.

Given the chunk-start states S_n from the sequential pass, every chunk is independent, so these kernels run on a
(batch, head, chunk) grid with every axis parallel (thousands of programs at long T: enough to fill a GPU):

    output_call     O = (q ⊙ e^G) S_n + ((q kᵀ) ⊙ D)(U − W S_n)                       (forward)
    dv_local_call   dν_local = ((q kᵀ) ⊙ D)ᵀ dO                                        (backward, before the dS pass)
    grads_call      dq, dk, dW, dG from S_n, dS_{n+1}, dν (and ν = U − W S_n again)     (backward, after it)

Each program forms q kᵀ once for its chunk, then walks the value dimension in tiles of ``block_v`` columns (a
static loop: the V tile bounds the size of every dot operand, hence the GPU's shared memory and registers, while
the C×C products are not recomputed per tile). The math lives in chunk_math; only the backends' compiler
parameters differ (``compiler_params``: Triton warps/stages or Mosaic dimension semantics).

Packed documents: every kernel of both backends takes the chunk-local document index (`chunk_math.chunk_documents`)
as one more (C, 1) fp32 column in G's layout, right after G, only when segment ids were given (`with_documents`);
without them the kernels and their operands are exactly those of the unsegmented rule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import chunk_math

_F32 = jnp.float32


def _v_tiles(vp, block_v):
    return [pl.ds(j * block_v, block_v) for j in range(vp // block_v)]


def with_documents(kernel, operands, specs, doc, doc_spec, position):
    """The kernel, operands and in_specs of a call, with the document column ``doc`` (or nothing when it is None)
    at ``position``. The kernel always receives a ``doc_ref`` there: None when there are no documents."""
    if doc is not None:
        return (
            kernel,
            [*operands[:position], doc, *operands[position:]],
            [*specs[:position], doc_spec, *specs[position:]],
        )

    def without(*refs, **kw):
        return kernel(*refs[:position], None, *refs[position:], **kw)

    return without, list(operands), list(specs)


def load(ref, index=...):
    """ref[index], or None for an absent optional ref."""
    return None if ref is None else ref[index]


def _output_kernel(q_ref, k_ref, w_ref, u_ref, g_ref, doc_ref, s_ref, o_ref, *, block_v, prec):
    w = w_ref[...]
    scores, qd = chunk_math.intra_chunk(q_ref[...], k_ref[...], g_ref[...], prec, load(doc_ref))
    for tile in _v_tiles(o_ref.shape[-1], block_v):
        o = chunk_math.output_tile(qd, scores, w, u_ref[:, tile], s_ref[:, tile], prec)
        o_ref[:, tile] = o.astype(o_ref.dtype)


def _dv_local_kernel(q_ref, k_ref, g_ref, doc_ref, do_ref, dvl_ref, *, block_v, prec):
    scores, _ = chunk_math.intra_chunk(q_ref[...], k_ref[...], g_ref[...], prec, load(doc_ref))
    for tile in _v_tiles(dvl_ref.shape[-1], block_v):
        dvl_ref[:, tile] = chunk_math.dot(scores, do_ref[:, tile], prec, trans_a=True)


def _grads_kernel(
    q_ref,
    k_ref,
    w_ref,
    u_ref,
    g_ref,
    doc_ref,
    s_ref,
    do_ref,
    dvn_ref,
    ds_ref,
    dq_ref,
    dk_ref,
    dw_ref,
    dg_ref,
    *,
    block_v,
    prec,
):
    C, K = q_ref.shape
    w = w_ref[...]
    acc = chunk_math.grads_init(C, K)
    for tile in _v_tiles(u_ref.shape[-1], block_v):
        acc = chunk_math.grads_tile(
            acc, w, u_ref[:, tile], s_ref[:, tile], do_ref[:, tile], dvn_ref[:, tile], ds_ref[:, tile], prec
        )
    dq, dk, dw, dg = chunk_math.grads_finish(q_ref[...], k_ref[...], g_ref[...], acc, prec, load(doc_ref))
    dq_ref[...] = dq
    dk_ref[...] = dk
    dw_ref[...] = dw
    dg_ref[...] = dg


def _specs(C, Kp, Vp):
    """Block specs of one chunk on the (B, H, N) grid: (C,K) rows, (C,V) rows, the (C,1) decay column, S_n."""
    chunk_k = pl.BlockSpec((None, None, C, Kp), lambda b, h, n: (b, h, n, 0))
    chunk_v = pl.BlockSpec((None, None, C, Vp), lambda b, h, n: (b, h, n, 0))
    chunk_g = pl.BlockSpec((None, None, C, 1), lambda b, h, n: (b, h, n, 0))
    state_n = pl.BlockSpec((None, None, None, Kp, Vp), lambda b, h, n: (b, h, n, 0, 0))
    return chunk_k, chunk_v, chunk_g, state_n


def output_call(q, k, w, u, g, doc, states, *, chunk_size, block_v, prec, compiler_params, interpret):
    """q, k, w [B,H,Tp,Kp] and states [B,H,N,Kp,Vp] (operand dtype), u [B,H,Tp,Vp], g and doc (or None)
    [B,H,Tp,1] (fp32) → o [B,H,Tp,Vp] in the operand dtype."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    chunk_k, chunk_v, chunk_g, state_n = _specs(chunk_size, Kp, Vp)
    kernel, operands, in_specs = with_documents(
        functools.partial(_output_kernel, block_v=block_v, prec=prec),
        [q, k, w, u, g, states],
        [chunk_k, chunk_k, chunk_k, chunk_v, chunk_g, state_n],
        doc,
        chunk_g,
        5,
    )
    return pl.pallas_call(
        kernel,
        grid=(B, H, Tp // chunk_size),
        in_specs=in_specs,
        out_specs=chunk_v,
        out_shape=jax.ShapeDtypeStruct((B, H, Tp, Vp), q.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="gated_delta_output",
    )(*operands)


def dv_local_call(q, k, g, doc, do, *, chunk_size, block_v, prec, compiler_params, interpret):
    """((q kᵀ) ⊙ D)ᵀ dO per chunk → [B,H,Tp,Vp] fp32."""
    B, H, Tp, Kp = q.shape
    Vp = do.shape[-1]
    chunk_k, chunk_v, chunk_g, _ = _specs(chunk_size, Kp, Vp)
    kernel, operands, in_specs = with_documents(
        functools.partial(_dv_local_kernel, block_v=block_v, prec=prec),
        [q, k, g, do],
        [chunk_k, chunk_k, chunk_g, chunk_v],
        doc,
        chunk_g,
        3,
    )
    return pl.pallas_call(
        kernel,
        grid=(B, H, Tp // chunk_size),
        in_specs=in_specs,
        out_specs=chunk_v,
        out_shape=jax.ShapeDtypeStruct((B, H, Tp, Vp), _F32),
        compiler_params=compiler_params,
        interpret=interpret,
        name="gated_delta_dv_local",
    )(*operands)


def grads_call(q, k, w, u, g, doc, states, do, dvn, ds_after, *, chunk_size, block_v, prec, compiler_params, interpret):
    """dq, dk, dW [B,H,Tp,Kp] and dG [B,H,Tp,1], fp32, from S_n (states), dS_{n+1} (ds_after) and dν (dvn)."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    chunk_k, chunk_v, chunk_g, state_n = _specs(chunk_size, Kp, Vp)
    kernel, operands, in_specs = with_documents(
        functools.partial(_grads_kernel, block_v=block_v, prec=prec),
        [q, k, w, u, g, states, do, dvn, ds_after],
        [chunk_k, chunk_k, chunk_k, chunk_v, chunk_g, state_n, chunk_v, chunk_v, state_n],
        doc,
        chunk_g,
        5,
    )
    return pl.pallas_call(
        kernel,
        grid=(B, H, Tp // chunk_size),
        in_specs=in_specs,
        out_specs=[chunk_k, chunk_k, chunk_k, chunk_g],
        out_shape=[jax.ShapeDtypeStruct((B, H, Tp, Kp), _F32)] * 3 + [jax.ShapeDtypeStruct((B, H, Tp, 1), _F32)],
        compiler_params=compiler_params,
        interpret=interpret,
        name="gated_delta_grads",
    )(*operands)
