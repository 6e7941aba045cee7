"""Pallas GPU (Triton lowering) gated delta rule: forward and recomputing backward kernels.

GPU grids have no execution order, so the chunk recurrence runs inside one program: one program per
(batch, head, value tile) loops over all chunks with `fori_loop`, keeping its K×BV slice of the
state in fp32 registers. Value tiles are independent (the recurrence never mixes value columns),
so the grid parallelises over them; the backward's q/k/W/G gradients sum over value tiles, so each
program writes a partial and the wrapper adds them. The forward used for training also writes the
state at every chunk start ([B,H,N,K,V], the only thing the backward does not recompute).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import chunk_math as common

_F32 = jnp.float32


def _block_v(vp, kp):
    # Register budget per program: the K×BV fp32 state plus (C,K) tiles of q, k, W. 64 columns for
    # small heads, 32 once K reaches 128, keeps a 4-warp program from spilling heavily.
    return min(vp, 32 if kp >= 128 else 64)


def _fwd_kernel(q_ref, k_ref, w_ref, u_ref, g_ref, s0_ref, o_ref, sT_ref, *maybe_states, C, N, prec):
    states_ref = maybe_states[0] if maybe_states else None

    def body(n, s):
        sl = pl.ds(pl.multiple_of(n * C, C), C)
        if states_ref is not None:
            states_ref[n, :, :] = s
        o, s = common.chunk_forward(q_ref[sl, :], k_ref[sl, :], w_ref[sl, :], u_ref[sl, :], g_ref[sl, :], s, prec)
        o_ref[sl, :] = o.astype(o_ref.dtype)
        return s

    sT_ref[...] = jax.lax.fori_loop(0, N, body, s0_ref[...].astype(_F32))


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
    *,
    C,
    N,
    prec,
):
    def body(i, ds):
        n = N - 1 - i
        sl = pl.ds(pl.multiple_of(n * C, C), C)
        dq, dk, dw, du, dg, ds = common.chunk_backward(
            q_ref[sl, :],
            k_ref[sl, :],
            w_ref[sl, :],
            u_ref[sl, :],
            g_ref[sl, :],
            st_ref[n, :, :],
            do_ref[sl, :],
            ds,
            prec,
        )
        dq_ref[sl, :] = dq
        dk_ref[sl, :] = dk
        dw_ref[sl, :] = dw
        du_ref[sl, :] = du
        dg_ref[sl, :] = dg
        return ds

    ds0_ref[...] = jax.lax.fori_loop(0, N, body, dsT_ref[...].astype(_F32))


def _params(num_warps, kp):
    # Wider heads hold 3 (C, K) fp32 tiles plus the state per program: spread them over 8 warps.
    return plt.CompilerParams(num_warps=num_warps or (8 if kp >= 128 else 4), num_stages=1)


def fwd_call(q, k, w, u, g, s0, *, save_states, prec, chunk_size=64, interpret=False, block_v=None, num_warps=None):
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C = chunk_size
    N = Tp // C
    bv = block_v or _block_v(Vp, Kp)
    full_k = pl.BlockSpec((None, None, Tp, Kp), lambda b, h, j: (b, h, 0, 0))
    tile_v = pl.BlockSpec((None, None, Tp, bv), lambda b, h, j: (b, h, 0, j))
    state = pl.BlockSpec((None, None, Kp, bv), lambda b, h, j: (b, h, 0, j))
    out_specs = [tile_v, state]
    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, Vp), _F32), jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32)]
    if save_states:
        out_specs.append(pl.BlockSpec((None, None, N, Kp, bv), lambda b, h, j: (b, h, 0, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((B, H, N, Kp, Vp), _F32))
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, C=C, N=N, prec=prec),
        grid=(B, H, Vp // bv),
        in_specs=[
            full_k,
            full_k,
            full_k,
            tile_v,
            pl.BlockSpec((None, None, Tp, 1), lambda b, h, j: (b, h, 0, 0)),
            state,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(num_warps, Kp),
        interpret=interpret,
        name="gated_delta_fwd",
    )(q, k, w, u, g, s0)
    return outs[0], outs[1], (outs[2] if save_states else None)


def bwd_call(q, k, w, u, g, states, do, dsT, *, prec, chunk_size=64, interpret=False, block_v=None, num_warps=None):
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C = chunk_size
    N = Tp // C
    bv = block_v or _block_v(Vp, Kp)
    nv = Vp // bv
    full_k = pl.BlockSpec((None, None, Tp, Kp), lambda b, h, j: (b, h, 0, 0))
    tile_v = pl.BlockSpec((None, None, Tp, bv), lambda b, h, j: (b, h, 0, j))
    state = pl.BlockSpec((None, None, Kp, bv), lambda b, h, j: (b, h, 0, j))
    g_spec = pl.BlockSpec((None, None, Tp, 1), lambda b, h, j: (b, h, 0, 0))
    part_k = pl.BlockSpec((None, None, None, Tp, Kp), lambda b, h, j: (b, h, j, 0, 0))
    part_g = pl.BlockSpec((None, None, None, Tp, 1), lambda b, h, j: (b, h, j, 0, 0))
    dq, dk, dw, du, dg, ds0 = pl.pallas_call(
        functools.partial(_bwd_kernel, C=C, N=N, prec=prec),
        grid=(B, H, nv),
        in_specs=[
            full_k,
            full_k,
            full_k,
            tile_v,
            g_spec,
            pl.BlockSpec((None, None, N, Kp, bv), lambda b, h, j: (b, h, 0, 0, j)),
            tile_v,
            state,
        ],
        out_specs=[part_k, part_k, part_k, tile_v, part_g, state],
        out_shape=[jax.ShapeDtypeStruct((B, H, nv, Tp, Kp), _F32)] * 3
        + [
            jax.ShapeDtypeStruct((B, H, Tp, Vp), _F32),
            jax.ShapeDtypeStruct((B, H, nv, Tp, 1), _F32),
            jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32),
        ],
        compiler_params=_params(num_warps, Kp),
        interpret=interpret,
        name="gated_delta_bwd",
    )(q, k, w, u, g, states, do, dsT)
    # Value tiles each saw only their columns of V: the q/k/W/G gradients are sums over tiles.
    return dq.sum(2), dk.sum(2), dw.sum(2), du, dg.sum(2), ds0


@functools.cache
def recurrence(chunk_size=64, interpret=False, block_v=None, num_warps=None):
    """The custom_vjp recurrence for one static configuration (cached so jit sees one function)."""
    kw = dict(chunk_size=chunk_size, interpret=interpret, block_v=block_v, num_warps=num_warps)
    return common.make_recurrence(functools.partial(fwd_call, **kw), functools.partial(bwd_call, **kw))


def chunk_gated_delta_rule_pallas_gpu(
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
    block_v=None,
    num_warps=None,
    prec=None,
):
    rec = recurrence(chunk_size, interpret, block_v, num_warps)
    return common.chunked_gated_delta_rule(
        rec,
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
