"""Pallas TPU (Mosaic) gated delta rule: sequential state kernels and chunk-parallel kernels.

The same split as the GPU backend (pallas_gpu.py), with TPU grids:
  ``gated_delta_state``   grid (B, H, N), chunk axis "arbitrary" (TPU grids run in order): the fp32 K×V state is
                          carried across grid steps in a VMEM scratch buffer, each step reads one (C, ·) block of
                          k, W, U, G (double-buffered by Pallas) and writes its chunk-start state S_n.
  ``gated_delta_dstate``  the reverse dS pass, walking the chunk axis backwards through its index maps.
  ``gated_delta_output``, ``gated_delta_dv_local``, ``gated_delta_grads``: chunk-parallel on a fully "parallel"
                          (B, H, N) grid (chunk_parallel.py), one V tile per program (the MXU takes whole tiles).
Dots take the operand dtype (bf16 inputs → bf16 MXU passes) with fp32 accumulation. With segment ids every kernel
also reads the (C, 1) document column of its chunk (chunk_parallel.py), in G's layout.
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


def _state_kernel(k_ref, w_ref, u_ref, g_ref, doc_ref, s0_ref, states_ref, sT_ref, s_scr, *, prec):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        s_scr[...] = s0_ref[...].astype(_F32)

    s = s_scr[...]
    states_ref[...] = s.astype(states_ref.dtype)
    s = chunk_math.state_step(k_ref[...], w_ref[...], u_ref[...], g_ref[...], s, prec, chunk_parallel.load(doc_ref))
    s_scr[...] = s

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        sT_ref[...] = s


def _dstate_kernel(
    q_ref, k_ref, w_ref, g_ref, doc_ref, do_ref, dvl_ref, dsT_ref, dvn_ref, ds_after_ref, ds0_ref, ds_scr, *, prec
):
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _():
        ds_scr[...] = dsT_ref[...].astype(_F32)

    ds = ds_scr[...]
    ds_after_ref[...] = ds.astype(ds_after_ref.dtype)
    q, k, w, g, do, dvl = (r[...] for r in (q_ref, k_ref, w_ref, g_ref, do_ref, dvl_ref))
    dvn, ds = chunk_math.dstate_step(q, k, w, g, do, dvl, ds, prec, chunk_parallel.load(doc_ref))
    dvn_ref[...] = dvn
    ds_scr[...] = ds

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        ds0_ref[...] = ds


def _seq_specs(C, Kp, Vp, N, reverse):
    n_of = (lambda n: N - 1 - n) if reverse else (lambda n: n)
    chunk_k = pl.BlockSpec((None, None, C, Kp), lambda b, h, n: (b, h, n_of(n), 0))
    chunk_v = pl.BlockSpec((None, None, C, Vp), lambda b, h, n: (b, h, n_of(n), 0))
    chunk_g = pl.BlockSpec((None, None, C, 1), lambda b, h, n: (b, h, n_of(n), 0))
    state_n = pl.BlockSpec((None, None, None, Kp, Vp), lambda b, h, n: (b, h, n_of(n), 0, 0))
    state = pl.BlockSpec((None, None, Kp, Vp), lambda b, h, n: (b, h, 0, 0))  # resident across chunks
    return chunk_k, chunk_v, chunk_g, state_n, state


def fwd_call(q, k, w, u, g, doc, s0, *, prec, chunk_size=64, interpret=False):
    """(o [B,H,Tp,Vp] operand dtype, s_final [B,H,Kp,Vp] fp32, states [B,H,N,Kp,Vp] operand dtype)."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C, N = chunk_size, Tp // chunk_size
    chunk_k, chunk_v, chunk_g, state_n, state = _seq_specs(C, Kp, Vp, N, reverse=False)
    kernel, operands, in_specs = chunk_parallel.with_documents(
        functools.partial(_state_kernel, prec=prec),
        [k, w, u, g, s0],
        [chunk_k, chunk_k, chunk_v, chunk_g, state],
        doc,
        chunk_g,
        4,
    )
    states, s_final = pl.pallas_call(
        kernel,
        grid=(B, H, N),
        in_specs=in_specs,
        out_specs=[state_n, state],
        out_shape=[jax.ShapeDtypeStruct((B, H, N, Kp, Vp), q.dtype), jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32)],
        scratch_shapes=[pltpu.VMEM((Kp, Vp), _F32)],
        compiler_params=_SEQUENTIAL,
        interpret=interpret,
        name="gated_delta_state",
    )(*operands)
    o = chunk_parallel.output_call(
        q, k, w, u, g, doc, states, chunk_size=C, block_v=Vp, prec=prec, compiler_params=_PARALLEL, interpret=interpret
    )
    return o, s_final, states


def bwd_call(q, k, w, u, g, doc, states, do, dsT, *, prec, chunk_size=64, interpret=False):
    """(dq, dk, dw, du, dg, ds0), fp32, from the stored chunk-start states."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C, N = chunk_size, Tp // chunk_size
    par = dict(chunk_size=C, block_v=Vp, prec=prec, compiler_params=_PARALLEL, interpret=interpret)
    dvl = chunk_parallel.dv_local_call(q, k, g, doc, do, **par)
    chunk_k, chunk_v, chunk_g, state_n, state = _seq_specs(C, Kp, Vp, N, reverse=True)
    kernel, operands, in_specs = chunk_parallel.with_documents(
        functools.partial(_dstate_kernel, prec=prec),
        [q, k, w, g, do, dvl, dsT],
        [chunk_k, chunk_k, chunk_k, chunk_g, chunk_v, chunk_v, state],
        doc,
        chunk_g,
        4,
    )
    dvn, ds_after, ds0 = pl.pallas_call(
        kernel,
        grid=(B, H, N),
        in_specs=in_specs,
        out_specs=[chunk_v, state_n, state],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, Tp, Vp), _F32),
            jax.ShapeDtypeStruct((B, H, N, Kp, Vp), q.dtype),
            jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32),
        ],
        scratch_shapes=[pltpu.VMEM((Kp, Vp), _F32)],
        compiler_params=_SEQUENTIAL,
        interpret=interpret,
        name="gated_delta_dstate",
    )(*operands)
    dq, dk, dw, dg = chunk_parallel.grads_call(q, k, w, u, g, doc, states, do, dvn, ds_after, **par)
    return dq, dk, dw, dvn, dg, ds0


@functools.cache
def rule(chunk_size=64, interpret=False):
    """The custom_vjp rule for one static configuration (cached so jit sees one function)."""
    kw = dict(chunk_size=chunk_size, interpret=interpret)
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
):
    return chunk_math.chunked_gated_delta_rule(
        rule(chunk_size, interpret),
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
