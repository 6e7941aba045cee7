"""Pallas TPU (Mosaic) gated delta rule: forward and recomputing backward kernels.

TPU grids run in order, so the recurrence is the grid itself: grid (B, H, chunks) with the chunk
axis "arbitrary" (sequential) and the fp32 K×V state carried across grid steps in a VMEM scratch
buffer; each step sees one (C, ·) block of q, k, W, U, G, so Pallas double-buffers the HBM traffic.
The backward walks the chunk axis in reverse through its index maps, carrying dS in VMEM and
reading the chunk-start states the training forward saved. Same chunk math as the GPU kernel
(`chunk_math`); only block specs, scratch handling and compiler params differ.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import chunk_math as common

_F32 = jnp.float32
_SEMANTICS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _fwd_kernel(q_ref, k_ref, w_ref, u_ref, g_ref, s0_ref, o_ref, sT_ref, *rest, prec, save_states):
    states_ref, s_scr = (rest[0], rest[1]) if save_states else (None, rest[0])
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        s_scr[...] = s0_ref[...].astype(_F32)

    s = s_scr[...]
    if save_states:
        states_ref[...] = s
    o, s = common.chunk_forward(q_ref[...], k_ref[...], w_ref[...], u_ref[...], g_ref[...], s, prec)
    o_ref[...] = o.astype(o_ref.dtype)
    s_scr[...] = s

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        sT_ref[...] = s


def _bwd_kernel(
    q_ref,
    k_ref,
    w_ref,
    u_ref,
    g_ref,
    st_ref,
    do_ref,
    dsT_ref,
    dq_ref,
    dk_ref,
    dw_ref,
    du_ref,
    dg_ref,
    ds0_ref,
    ds_scr,
    *,
    prec,
):
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _():
        ds_scr[...] = dsT_ref[...].astype(_F32)

    dq, dk, dw, du, dg, ds = common.chunk_backward(
        q_ref[...], k_ref[...], w_ref[...], u_ref[...], g_ref[...], st_ref[...], do_ref[...], ds_scr[...], prec
    )
    dq_ref[...] = dq
    dk_ref[...] = dk
    dw_ref[...] = dw
    du_ref[...] = du
    dg_ref[...] = dg
    ds_scr[...] = ds

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        ds0_ref[...] = ds


def _specs(C, Kp, Vp, N, reverse):
    n_of = (lambda n: N - 1 - n) if reverse else (lambda n: n)
    chunk_k = pl.BlockSpec((None, None, C, Kp), lambda b, h, n: (b, h, n_of(n), 0))
    chunk_v = pl.BlockSpec((None, None, C, Vp), lambda b, h, n: (b, h, n_of(n), 0))
    chunk_g = pl.BlockSpec((None, None, C, 1), lambda b, h, n: (b, h, n_of(n), 0))
    state_n = pl.BlockSpec((None, None, None, Kp, Vp), lambda b, h, n: (b, h, n_of(n), 0, 0))
    state = pl.BlockSpec((None, None, Kp, Vp), lambda b, h, n: (b, h, 0, 0))  # resident across chunks
    return chunk_k, chunk_v, chunk_g, state_n, state


def fwd_call(q, k, w, u, g, s0, *, save_states, prec, chunk_size=64, interpret=False):
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C = chunk_size
    N = Tp // C
    chunk_k, chunk_v, chunk_g, state_n, state = _specs(C, Kp, Vp, N, reverse=False)
    out_specs = [chunk_v, state] + ([state_n] if save_states else [])
    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, Vp), _F32), jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32)]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((B, H, N, Kp, Vp), _F32))
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, prec=prec, save_states=save_states),
        grid=(B, H, N),
        in_specs=[chunk_k, chunk_k, chunk_k, chunk_v, chunk_g, state],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((Kp, Vp), _F32)],
        compiler_params=_SEMANTICS,
        interpret=interpret,
        name="gated_delta_fwd",
    )(q, k, w, u, g, s0)
    return outs[0], outs[1], (outs[2] if save_states else None)


def bwd_call(q, k, w, u, g, states, do, dsT, *, prec, chunk_size=64, interpret=False):
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C = chunk_size
    N = Tp // C
    chunk_k, chunk_v, chunk_g, state_n, state = _specs(C, Kp, Vp, N, reverse=True)
    return tuple(
        pl.pallas_call(
            functools.partial(_bwd_kernel, prec=prec),
            grid=(B, H, N),
            in_specs=[chunk_k, chunk_k, chunk_k, chunk_v, chunk_g, state_n, chunk_v, state],
            out_specs=[chunk_k, chunk_k, chunk_k, chunk_v, chunk_g, state],
            out_shape=[jax.ShapeDtypeStruct((B, H, Tp, Kp), _F32)] * 3
            + [
                jax.ShapeDtypeStruct((B, H, Tp, Vp), _F32),
                jax.ShapeDtypeStruct((B, H, Tp, 1), _F32),
                jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32),
            ],
            scratch_shapes=[pltpu.VMEM((Kp, Vp), _F32)],
            compiler_params=_SEMANTICS,
            interpret=interpret,
            name="gated_delta_bwd",
        )(q, k, w, u, g, states, do, dsT)
    )


@functools.cache
def recurrence(chunk_size=64, interpret=False):
    """The custom_vjp recurrence for one static configuration (cached so jit sees one function)."""
    kw = dict(chunk_size=chunk_size, interpret=interpret)
    return common.make_recurrence(functools.partial(fwd_call, **kw), functools.partial(bwd_call, **kw))


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
    interpret=False,
    prec=None,
):
    return common.chunked_gated_delta_rule(
        recurrence(chunk_size, interpret),
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
        prec=prec,
    )
