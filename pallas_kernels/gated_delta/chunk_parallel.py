"""The chunk-parallel Pallas kernels of the gated delta rule, shared by the GPU (Triton) and TPU (Mosaic) backends.

Given the chunk-start states S_n from the sequential pass, every chunk is independent, so these kernels run on a
(batch, head, chunk) grid with every axis parallel (thousands of programs at long T: enough to fill a GPU):

    output_call     O = (q ⊙ e^G) S_n + ((q kᵀ) ⊙ D)(U − W S_n)                       (forward)
    dv_local_call   dν_local = ((q kᵀ) ⊙ D)ᵀ dO                                        (backward, before the dS pass)
    grads_call      dq, dk, dW, dG from S_n, dS_{n+1}, dν (and ν = U − W S_n again)     (backward, after it)

Each program forms q kᵀ once for its chunk, then walks the value dimension in tiles of ``block_v`` columns (a
static loop: the V tile bounds the size of every dot operand, hence the GPU's shared memory and registers, while
the C×C products are not recomputed per tile). The math lives in chunk_math; the backends differ in their
compiler parameters (``compiler_params``: Triton warps/stages or Mosaic dimension semantics) and in the `Layout`:

    GPU   one chunk per program, G as a (C, 1) column per chunk ([B,H,Tp,1]).
    TPU   ``chunks`` chunks per program (a static loop over them: a TPU runs its grid steps one after another,
          each with a fixed cost, so fewer and larger steps), G as lane-dense rows ([B,H,N,C], a (chunks, C)
          block: one decay per lane instead of one per 128-lane row), and dν_local from the transposed scores
          (`intra_chunk(transposed=True)`), so no product reads its left operand transposed.

Packed documents: every kernel of both backends takes the chunk-local document index (`chunk_math.chunk_documents`)
as one more fp32 operand in G's layout, right after G, only when segment ids were given (`with_documents`);
without them the kernels and their operands are exactly those of the unsegmented rule.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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


class Layout(NamedTuple):
    """How a backend's kernels lay out their blocks (module docstring): chunks per program, and G and the document
    index as (1, C) rows of a [B,H,N,C] array (``lane_dense``) or as (C, 1) columns of a [B,H,Tp,1] array."""

    chunks: int = 1
    lane_dense: bool = False

    def rows(self, p, C):
        """Chunk p's rows of a (chunks·C, ·) block (the whole block for one chunk: the GPU kernels load it whole)."""
        return pl.ds(p * C, C) if self.chunks > 1 else slice(None)

    def state(self, ref, p):
        """Chunk p's (K, V) start state of a (chunks, K, V) block (a (K, V) block for one chunk)."""
        return ref.at[p] if self.chunks > 1 else ref

    def g_spec(self, C):
        """The block of G (and of the document index) for one program of the (B, H, N / chunks) grid."""
        if self.lane_dense:
            return pl.BlockSpec((None, None, self.chunks, C), lambda b, h, n: (b, h, n, 0))
        return pl.BlockSpec((None, None, self.chunks * C, 1), lambda b, h, n: (b, h, n, 0))

    def g_of(self, ref, p, C):
        """Chunk p's G (or document index) from its block, as the chunk functions take it: a (C, 1) column."""
        if ref is None:
            return None
        if self.lane_dense:
            return chunk_math.as_column(ref[pl.ds(p, 1), :])
        return ref[self.rows(p, C), :]

    def put_g(self, ref, p, C, column):
        """Writes chunk p's (C, 1) column into a block of G's layout."""
        if self.lane_dense:
            ref[pl.ds(p, 1), :] = chunk_math.as_row(column)
        else:
            ref[self.rows(p, C), :] = column

    def g_shape(self, B, H, Tp, C):
        """The shape of a G-like array of Tp = N·C tokens in this layout."""
        return (B, H, Tp // C, C) if self.lane_dense else (B, H, Tp, 1)

    def g_array(self, x, C):
        """A [B,H,Tp,1] column array (`chunk_math.flat_padded`) in this layout."""
        return x.reshape(self.g_shape(*x.shape[:3], C))

    def g_from_array(self, x):
        """The inverse of `g_array`: back to [B,H,Tp,1]."""
        return x.reshape(*x.shape[:2], -1, 1) if self.lane_dense else x


GPU = Layout()


def _output_kernel(q_ref, k_ref, w_ref, u_ref, g_ref, doc_ref, s_ref, o_ref, *, C, layout, block_v, prec):
    for p in range(layout.chunks):
        rows = layout.rows(p, C)
        w = w_ref[rows, :]
        g, doc = layout.g_of(g_ref, p, C), layout.g_of(doc_ref, p, C)
        scores, qd = chunk_math.intra_chunk(q_ref[rows, :], k_ref[rows, :], g, prec, doc)
        for tile in _v_tiles(o_ref.shape[-1], block_v):
            o = chunk_math.output_tile(qd, scores, w, u_ref[rows, tile], layout.state(s_ref, p)[:, tile], prec)
            o_ref[rows, tile] = o.astype(o_ref.dtype)


def _dv_local_kernel(q_ref, k_ref, g_ref, doc_ref, do_ref, dvl_ref, *, C, layout, block_v, prec):
    for p in range(layout.chunks):
        rows = layout.rows(p, C)
        g, doc = layout.g_of(g_ref, p, C), layout.g_of(doc_ref, p, C)
        q, k = q_ref[rows, :], k_ref[rows, :]
        if layout.lane_dense:  # ((q kᵀ) ⊙ D)ᵀ formed as such: a plain product with dO
            scores_t, _ = chunk_math.intra_chunk(q, k, g, prec, doc, transposed=True)
            for tile in _v_tiles(dvl_ref.shape[-1], block_v):
                dvl_ref[rows, tile] = chunk_math.dot(scores_t, do_ref[rows, tile], prec)
        else:
            scores, _ = chunk_math.intra_chunk(q, k, g, prec, doc)
            for tile in _v_tiles(dvl_ref.shape[-1], block_v):
                dvl_ref[rows, tile] = chunk_math.dot(scores, do_ref[rows, tile], prec, trans_a=True)


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
    C,
    layout,
    block_v,
    prec,
):
    K = q_ref.shape[-1]
    for p in range(layout.chunks):
        rows = layout.rows(p, C)
        w = w_ref[rows, :]
        acc = chunk_math.grads_init(C, K)
        for tile in _v_tiles(u_ref.shape[-1], block_v):
            acc = chunk_math.grads_tile(
                acc,
                w,
                u_ref[rows, tile],
                layout.state(s_ref, p)[:, tile],
                do_ref[rows, tile],
                dvn_ref[rows, tile],
                layout.state(ds_ref, p)[:, tile],
                prec,
            )
        g, doc = layout.g_of(g_ref, p, C), layout.g_of(doc_ref, p, C)
        dq, dk, dw, dg = chunk_math.grads_finish(q_ref[rows, :], k_ref[rows, :], g, acc, prec, doc)
        dq_ref[rows, :] = dq
        dk_ref[rows, :] = dk
        dw_ref[rows, :] = dw
        layout.put_g(dg_ref, p, C, dg)


def specs(C, Kp, Vp, layout):
    """Block specs of one program on the (B, H, N / chunks) grid: (chunks·C, K) rows, (chunks·C, V) rows, G's
    block (`Layout.g_spec`), and the chunks' start states S_n (chunks, K, V)."""
    P = layout.chunks
    chunk_k = pl.BlockSpec((None, None, P * C, Kp), lambda b, h, n: (b, h, n, 0))
    chunk_v = pl.BlockSpec((None, None, P * C, Vp), lambda b, h, n: (b, h, n, 0))
    state_n = pl.BlockSpec((None, None, P if P > 1 else None, Kp, Vp), lambda b, h, n: (b, h, n, 0, 0))
    return chunk_k, chunk_v, layout.g_spec(C), state_n


def output_call(q, k, w, u, g, doc, states, *, chunk_size, block_v, prec, compiler_params, interpret, layout=GPU):
    """q, k, w [B,H,Tp,Kp] and states [B,H,N,Kp,Vp] (operand dtype), u [B,H,Tp,Vp], g and doc (or None)
    [B,H,Tp,1] (fp32) → o [B,H,Tp,Vp] in the operand dtype. N must be a multiple of ``layout.chunks``."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C = chunk_size
    chunk_k, chunk_v, chunk_g, state_n = specs(C, Kp, Vp, layout)
    kernel, operands, in_specs = with_documents(
        functools.partial(_output_kernel, C=C, layout=layout, block_v=block_v, prec=prec),
        [q, k, w, u, layout.g_array(g, C), states],
        [chunk_k, chunk_k, chunk_k, chunk_v, chunk_g, state_n],
        None if doc is None else layout.g_array(doc, C),
        chunk_g,
        5,
    )
    return pl.pallas_call(
        kernel,
        grid=(B, H, Tp // (C * layout.chunks)),
        in_specs=in_specs,
        out_specs=chunk_v,
        out_shape=jax.ShapeDtypeStruct((B, H, Tp, Vp), q.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="gated_delta_output",
    )(*operands)


def dv_local_call(q, k, g, doc, do, *, chunk_size, block_v, prec, compiler_params, interpret, layout=GPU):
    """((q kᵀ) ⊙ D)ᵀ dO per chunk → [B,H,Tp,Vp] fp32."""
    B, H, Tp, Kp = q.shape
    Vp = do.shape[-1]
    C = chunk_size
    chunk_k, chunk_v, chunk_g, _ = specs(C, Kp, Vp, layout)
    kernel, operands, in_specs = with_documents(
        functools.partial(_dv_local_kernel, C=C, layout=layout, block_v=block_v, prec=prec),
        [q, k, layout.g_array(g, C), do],
        [chunk_k, chunk_k, chunk_g, chunk_v],
        None if doc is None else layout.g_array(doc, C),
        chunk_g,
        3,
    )
    return pl.pallas_call(
        kernel,
        grid=(B, H, Tp // (C * layout.chunks)),
        in_specs=in_specs,
        out_specs=chunk_v,
        out_shape=jax.ShapeDtypeStruct((B, H, Tp, Vp), _F32),
        compiler_params=compiler_params,
        interpret=interpret,
        name="gated_delta_dv_local",
    )(*operands)


def grads_call(
    q, k, w, u, g, doc, states, do, dvn, ds_after, *, chunk_size, block_v, prec, compiler_params, interpret, layout=GPU
):
    """dq, dk, dW [B,H,Tp,Kp] and dG [B,H,Tp,1], fp32, from S_n (states), dS_{n+1} (ds_after) and dν (dvn)."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C = chunk_size
    chunk_k, chunk_v, chunk_g, state_n = specs(C, Kp, Vp, layout)
    kernel, operands, in_specs = with_documents(
        functools.partial(_grads_kernel, C=C, layout=layout, block_v=block_v, prec=prec),
        [q, k, w, u, layout.g_array(g, C), states, do, dvn, ds_after],
        [chunk_k, chunk_k, chunk_k, chunk_v, chunk_g, state_n, chunk_v, chunk_v, state_n],
        None if doc is None else layout.g_array(doc, C),
        chunk_g,
        5,
    )
    dq, dk, dw, dg = pl.pallas_call(
        kernel,
        grid=(B, H, Tp // (C * layout.chunks)),
        in_specs=in_specs,
        out_specs=[chunk_k, chunk_k, chunk_k, chunk_g],
        out_shape=[jax.ShapeDtypeStruct((B, H, Tp, Kp), _F32)] * 3
        + [jax.ShapeDtypeStruct(layout.g_shape(B, H, Tp, C), _F32)],
        compiler_params=compiler_params,
        interpret=interpret,
        name="gated_delta_grads",
    )(*operands)
    return dq, dk, dw, layout.g_from_array(dg)
