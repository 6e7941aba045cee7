"""Pallas TPU (Mosaic) gated delta rule: sequential state kernels and chunk-parallel kernels.

The same split as the GPU backend (pallas_gpu.py), shaped for a TPU:
  ``gated_delta_state``   grid (B, H, N / P), the chunk axis "arbitrary" (TPU grids run in order): the fp32 K×V
                          state is carried across grid steps in a VMEM scratch buffer; each step reads the
                          (P·C, ·) blocks of P chunks (double-buffered by Pallas), walks them in a static loop and
                          writes their chunk-start states S_n.
  ``gated_delta_dstate``  the reverse dS pass, walking the grid backwards through its index maps and each block's
                          chunks backwards in the loop.
  ``gated_delta_output``, ``gated_delta_dv_local``, ``gated_delta_grads``: chunk-parallel on a fully "parallel"
                          (B, H, N / P) grid (chunk_parallel.py, its TPU `Layout`), one V tile per chunk.
Why P chunks per grid step (``chunks_per_step``, 8 by default): a TPU core runs the grid's steps one after another
with a fixed cost per step, and at T = 8K with 16 heads one chunk per step makes 2,048 sequential steps per batch
row. N is padded to a multiple of P with identity chunks (k = W = U = 0, g = 0: S passes through unchanged, their
outputs and gradients are dropped); P becomes N when N < P.
Layouts (module docstring of chunk_parallel.py): G and the document index travel as lane-dense (P, C) blocks of a
[B,H,N,C] array, and the sequential kernels read k (forward), q and W (backward) transposed, [B,H,N,K,C], prepared
once by XLA, so no product inside the loops reads its left operand transposed (`chunk_math.state_step` and
`dstate_step` with their transposed layouts).
Dots take the operand dtype (bf16 inputs → bf16 MXU passes) with fp32 accumulation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import chunk_math, chunk_parallel

_F32 = jnp.float32
_SEQUENTIAL = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
_PARALLEL = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
CHUNKS_PER_STEP = 8  # a multiple of 8: (P, C) blocks of G fill whole (8, 128) tiles' sublanes


def _row(ref, p):
    """Chunk p's (1, C) row of a lane-dense (P, C) block, or None for an absent optional ref."""
    return None if ref is None else ref[pl.ds(p, 1), :]


def _state_kernel(kt_ref, w_ref, u_ref, g_ref, doc_ref, s0_ref, states_ref, sT_ref, s_scr, *, C, P, prec):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        s_scr[...] = s0_ref[...].astype(_F32)

    s = s_scr[...]
    for p in range(P):
        rows = pl.ds(p * C, C)
        states_ref[p] = s.astype(states_ref.dtype)
        s = chunk_math.state_step(
            kt_ref[p], w_ref[rows, :], u_ref[rows, :], _row(g_ref, p), s, prec, _row(doc_ref, p), keys_transposed=True
        )
    s_scr[...] = s

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        sT_ref[...] = s


def _dstate_kernel(
    qt_ref,
    k_ref,
    wt_ref,
    g_ref,
    doc_ref,
    do_ref,
    dvl_ref,
    dsT_ref,
    dvn_ref,
    ds_after_ref,
    ds0_ref,
    ds_scr,
    *,
    C,
    P,
    prec,
):
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _():
        ds_scr[...] = dsT_ref[...].astype(_F32)

    ds = ds_scr[...]
    for p in reversed(range(P)):
        rows = pl.ds(p * C, C)
        ds_after_ref[p] = ds.astype(ds_after_ref.dtype)
        dvn, ds = chunk_math.dstate_step(
            qt_ref[p],
            k_ref[rows, :],
            wt_ref[p],
            _row(g_ref, p),
            do_ref[rows, :],
            dvl_ref[rows, :],
            ds,
            prec,
            _row(doc_ref, p),
            transposed=True,
        )
        dvn_ref[rows, :] = dvn
    ds_scr[...] = ds

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        ds0_ref[...] = ds


def _plan(N, chunks_per_step):
    """(P, N padded to a multiple of P)."""
    P = min(chunks_per_step, N)
    return P, -(-N // P) * P


def _pad_chunks(x, rows):
    """[B,H,Tp,·] or [B,H,N,·,·] zero padded on axis 2 to ``rows``."""
    return jnp.pad(x, [(0, 0), (0, 0), (0, rows - x.shape[2])] + [(0, 0)] * (x.ndim - 3)) if rows != x.shape[2] else x


def _transposed(x, C):
    """[B,H,Tp,K] → [B,H,N,K,C]: each chunk's (C, K) block transposed."""
    B, H, Tp, K = x.shape
    return jnp.swapaxes(x.reshape(B, H, Tp // C, C, K), -1, -2)


def _seq_specs(C, P, Kp, Vp, NP, reverse):
    """Block specs of the sequential kernels' grid (B, H, NP) (NP = N / P; ``reverse`` walks it backwards)."""
    n_of = (lambda n: NP - 1 - n) if reverse else (lambda n: n)
    rows_k = pl.BlockSpec((None, None, P * C, Kp), lambda b, h, n: (b, h, n_of(n), 0))
    rows_v = pl.BlockSpec((None, None, P * C, Vp), lambda b, h, n: (b, h, n_of(n), 0))
    transposed = pl.BlockSpec((None, None, P, Kp, C), lambda b, h, n: (b, h, n_of(n), 0, 0))
    g = pl.BlockSpec((None, None, P, C), lambda b, h, n: (b, h, n_of(n), 0))
    states = pl.BlockSpec((None, None, P, Kp, Vp), lambda b, h, n: (b, h, n_of(n), 0, 0))
    state = pl.BlockSpec((None, None, Kp, Vp), lambda b, h, n: (b, h, 0, 0))  # resident across the grid
    return rows_k, rows_v, transposed, g, states, state


def fwd_call(q, k, w, u, g, doc, s0, *, prec, chunk_size=64, chunks_per_step=CHUNKS_PER_STEP, interpret=False):
    """(o [B,H,Tp,Vp] operand dtype, s_final [B,H,Kp,Vp] fp32, states [B,H,N,Kp,Vp] operand dtype)."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C, N = chunk_size, Tp // chunk_size
    P, Np = _plan(N, chunks_per_step)
    layout = chunk_parallel.Layout(chunks=P, lane_dense=True)
    q, k, w, u, g = (_pad_chunks(x, Np * C) for x in (q, k, w, u, g))
    doc = None if doc is None else _pad_chunks(doc, Np * C)
    rows_k, rows_v, transposed, g_spec, states_spec, state = _seq_specs(C, P, Kp, Vp, Np // P, reverse=False)
    kernel, operands, in_specs = chunk_parallel.with_documents(
        functools.partial(_state_kernel, C=C, P=P, prec=prec),
        [_transposed(k, C), w, u, layout.g_array(g, C), s0],
        [transposed, rows_k, rows_v, g_spec, state],
        None if doc is None else layout.g_array(doc, C),
        g_spec,
        4,
    )
    states, s_final = pl.pallas_call(
        kernel,
        grid=(B, H, Np // P),
        in_specs=in_specs,
        out_specs=[states_spec, state],
        out_shape=[jax.ShapeDtypeStruct((B, H, Np, Kp, Vp), q.dtype), jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32)],
        scratch_shapes=[pltpu.VMEM((Kp, Vp), _F32)],
        compiler_params=_SEQUENTIAL,
        interpret=interpret,
        name="gated_delta_state",
    )(*operands)
    par = dict(chunk_size=C, block_v=Vp, prec=prec, compiler_params=_PARALLEL, interpret=interpret, layout=layout)
    o = chunk_parallel.output_call(q, k, w, u, g, doc, states, **par)
    return o[:, :, :Tp], s_final, states[:, :, :N]


def bwd_call(
    q, k, w, u, g, doc, states, do, dsT, *, prec, chunk_size=64, chunks_per_step=CHUNKS_PER_STEP, interpret=False
):
    """(dq, dk, dw, du, dg, ds0), fp32, from the stored chunk-start states."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C, N = chunk_size, Tp // chunk_size
    P, Np = _plan(N, chunks_per_step)
    layout = chunk_parallel.Layout(chunks=P, lane_dense=True)
    q, k, w, u, g, do = (_pad_chunks(x, Np * C) for x in (q, k, w, u, g, do))
    doc = None if doc is None else _pad_chunks(doc, Np * C)
    states = _pad_chunks(states, Np)
    par = dict(chunk_size=C, block_v=Vp, prec=prec, compiler_params=_PARALLEL, interpret=interpret, layout=layout)
    dvl = chunk_parallel.dv_local_call(q, k, g, doc, do, **par)
    rows_k, rows_v, transposed, g_spec, states_spec, state = _seq_specs(C, P, Kp, Vp, Np // P, reverse=True)
    kernel, operands, in_specs = chunk_parallel.with_documents(
        functools.partial(_dstate_kernel, C=C, P=P, prec=prec),
        [_transposed(q, C), k, _transposed(w, C), layout.g_array(g, C), do, dvl, dsT],
        [transposed, rows_k, transposed, g_spec, rows_v, rows_v, state],
        None if doc is None else layout.g_array(doc, C),
        g_spec,
        4,
    )
    dvn, ds_after, ds0 = pl.pallas_call(
        kernel,
        grid=(B, H, Np // P),
        in_specs=in_specs,
        out_specs=[rows_v, states_spec, state],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, Np * C, Vp), _F32),
            jax.ShapeDtypeStruct((B, H, Np, Kp, Vp), q.dtype),
            jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32),
        ],
        scratch_shapes=[pltpu.VMEM((Kp, Vp), _F32)],
        compiler_params=_SEQUENTIAL,
        interpret=interpret,
        name="gated_delta_dstate",
    )(*operands)
    dq, dk, dw, dg = chunk_parallel.grads_call(q, k, w, u, g, doc, states, do, dvn, ds_after, **par)
    return tuple(x[:, :, :Tp] for x in (dq, dk, dw, dvn, dg)) + (ds0,)


@functools.cache
def rule(chunk_size=64, chunks_per_step=CHUNKS_PER_STEP, interpret=False):
    """The custom_vjp rule for one static configuration (cached so jit sees one function)."""
    kw = dict(chunk_size=chunk_size, chunks_per_step=chunks_per_step, interpret=interpret)
    return chunk_math.make_rule(functools.partial(fwd_call, **kw), functools.partial(bwd_call, **kw))


def chunk_gated_delta_rule_pallas_tpu(
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
    interpret=False,
    prec=None,
    chunks_per_step=CHUNKS_PER_STEP,
):
    if chunks_per_step < 8 or chunks_per_step % 8:
        raise ValueError(
            f"chunks_per_step must be a positive multiple of 8 (G's (chunks, C) blocks fill whole (8, 128) tiles); "
            f"got {chunks_per_step!r}"
        )
    return chunk_math.chunked_gated_delta_rule(
        rule(chunk_size, chunks_per_step, interpret),
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
        pad_pow2=True,
        segment_ids=segment_ids,
        prec=prec,
    )
