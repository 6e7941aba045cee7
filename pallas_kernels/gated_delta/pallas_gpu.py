"""Pallas GPU (Triton lowering) gated delta rule: a sequential state kernel and chunk-parallel kernels.

Forward (2 kernels):
  ``gated_delta_state``   grid (B, H, V/BV): one program per value tile loops over the chunks with `fori_loop`,
                          carrying only its K×BV slice of the state in fp32 registers and storing each chunk-start
                          state S_n ([B,H,N,K,V] in the operand dtype). Value tiles are independent (the recurrence
                          never mixes value columns), and the loop body has no C×C product to recompute per tile.
  ``gated_delta_output``  grid (B, H, N), chunk-parallel from S_n (chunk_parallel.py).
Backward (3 kernels): ``gated_delta_dv_local`` (chunk-parallel ((q kᵀ) ⊙ D)ᵀ dO), ``gated_delta_dstate`` (the
reverse sequential dS pass, same layout as the state kernel, storing dν and each dS_{n+1}), ``gated_delta_grads``
(chunk-parallel dq, dk, dW, dG).

Dots take the operand dtype (bf16 inputs → bf16 tensor-core dots) with fp32 accumulation. Tiles, warps and stages
per key dimension come from `GPU_CONFIGS`, sized so every kernel fits the H200's 232,448 B of shared memory per
block (checked for every configuration by tests/test_compile_tier_gated_delta.py). With segment ids every kernel
also reads the document column (chunk_parallel.py), in G's layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import pallas_triton

from . import chunk_math, chunk_parallel

plt = pallas_triton()

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    """Launch configuration of the gated delta kernels for one (padded) key dimension.

    block_v_seq: value columns per program of the sequential kernels (state, dstate): their grid is
    (B, H, V/block_v_seq), and the fp32 K×block_v_seq state lives in registers. block_v_par: value columns per
    step of the chunk-parallel kernels' inner loop. warps_*/stages_*: Triton num_warps / num_stages (stages only
    matter for the sequential kernels' chunk loop, whose next chunk's loads they prefetch).
    """

    block_v_seq: int
    block_v_par: int
    warps_seq: int
    warps_par: int
    stages_seq: int


# Padded key dimension → configuration. Smaller value tiles for wider keys keep the K×BV state and the (C,K)
# operand tiles within registers and shared memory (tests/test_compile_tier_gated_delta.py checks every entry).
GPU_CONFIGS = {
    16: GpuConfig(block_v_seq=64, block_v_par=64, warps_seq=4, warps_par=4, stages_seq=2),
    32: GpuConfig(block_v_seq=64, block_v_par=64, warps_seq=4, warps_par=4, stages_seq=2),
    64: GpuConfig(block_v_seq=64, block_v_par=64, warps_seq=4, warps_par=8, stages_seq=2),
    128: GpuConfig(block_v_seq=32, block_v_par=64, warps_seq=4, warps_par=8, stages_seq=2),
    256: GpuConfig(block_v_seq=32, block_v_par=32, warps_seq=8, warps_par=8, stages_seq=1),
}


# Dots of fp32 inputs: three TF32 tensor-core passes (~fp32 accuracy). Precision.HIGHEST lowers to FMA loops on
# CUDA cores: every kernel at 255 registers with spills, and a 16-minute Triton compile at K=128. (Interpret mode
# keeps HIGHEST: exact fp32 on the CPU.)
FP32_DOTS = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def gpu_config(kp: int, vp: int, block_v: int | None = None) -> GpuConfig:
    """The table's entry for padded key dim ``kp`` (the largest for wider keys), value tiles capped at ``vp``;
    ``block_v`` overrides both value tiles (tests use it to exercise several tiles at small V)."""
    cfg = GPU_CONFIGS.get(kp) or GPU_CONFIGS[max(GPU_CONFIGS)]
    seq, par = (block_v, block_v) if block_v else (cfg.block_v_seq, cfg.block_v_par)
    return dataclasses.replace(cfg, block_v_seq=min(seq, vp), block_v_par=min(par, vp))


def _params(warps, stages=1):
    return plt.CompilerParams(num_warps=warps, num_stages=stages)


def _state_kernel(k_ref, w_ref, u_ref, g_ref, doc_ref, s0_ref, states_ref, sT_ref, *, C, N, prec):
    def body(n, s):
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        states_ref[n, :, :] = s.astype(states_ref.dtype)
        doc = chunk_parallel.load(doc_ref, (rows, slice(None)))
        return chunk_math.state_step(k_ref[rows, :], w_ref[rows, :], u_ref[rows, :], g_ref[rows, :], s, prec, doc)

    sT_ref[...] = jax.lax.fori_loop(0, N, body, s0_ref[...].astype(_F32))


def _dstate_kernel(
    q_ref, k_ref, w_ref, g_ref, doc_ref, do_ref, dvl_ref, dsT_ref, dvn_ref, ds_after_ref, ds0_ref, *, C, N, prec
):
    def body(i, ds):
        n = N - 1 - i
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        ds_after_ref[n, :, :] = ds.astype(ds_after_ref.dtype)
        q, k, w, g, do, dvl = (r[rows, :] for r in (q_ref, k_ref, w_ref, g_ref, do_ref, dvl_ref))
        doc = chunk_parallel.load(doc_ref, (rows, slice(None)))
        dvn, ds = chunk_math.dstate_step(q, k, w, g, do, dvl, ds, prec, doc)
        dvn_ref[rows, :] = dvn
        return ds

    ds0_ref[...] = jax.lax.fori_loop(0, N, body, dsT_ref[...].astype(_F32))


def _seq_specs(Tp, Kp, N, bv):
    """Block specs of the (B, H, V/bv) sequential grid: whole-sequence (T,K) and (T,bv) slabs, states, G."""
    full_k = pl.BlockSpec((None, None, Tp, Kp), lambda b, h, j: (b, h, 0, 0))
    tile_v = pl.BlockSpec((None, None, Tp, bv), lambda b, h, j: (b, h, 0, j))
    state = pl.BlockSpec((None, None, Kp, bv), lambda b, h, j: (b, h, 0, j))
    states = pl.BlockSpec((None, None, N, Kp, bv), lambda b, h, j: (b, h, 0, 0, j))
    g_spec = pl.BlockSpec((None, None, Tp, 1), lambda b, h, j: (b, h, 0, 0))
    return full_k, tile_v, state, states, g_spec


def fwd_call(q, k, w, u, g, doc, s0, *, prec, chunk_size=64, interpret=False, block_v=None):
    """(o [B,H,Tp,Vp] operand dtype, s_final [B,H,Kp,Vp] fp32, states [B,H,N,Kp,Vp] operand dtype)."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C, N = chunk_size, Tp // chunk_size
    cfg = gpu_config(Kp, Vp, block_v)
    bv = cfg.block_v_seq
    full_k, tile_v, state, states_spec, g_spec = _seq_specs(Tp, Kp, N, bv)
    kernel, operands, in_specs = chunk_parallel.with_documents(
        functools.partial(_state_kernel, C=C, N=N, prec=prec),
        [k, w, u, g, s0],
        [full_k, full_k, tile_v, g_spec, state],
        doc,
        g_spec,
        4,
    )
    states, s_final = pl.pallas_call(
        kernel,
        grid=(B, H, Vp // bv),
        in_specs=in_specs,
        out_specs=[states_spec, state],
        out_shape=[jax.ShapeDtypeStruct((B, H, N, Kp, Vp), q.dtype), jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32)],
        compiler_params=_params(cfg.warps_seq, cfg.stages_seq),
        interpret=interpret,
        name="gated_delta_state",
    )(*operands)
    o = chunk_parallel.output_call(
        q,
        k,
        w,
        u,
        g,
        doc,
        states,
        chunk_size=C,
        block_v=cfg.block_v_par,
        prec=prec,
        compiler_params=_params(cfg.warps_par),
        interpret=interpret,
    )
    return o, s_final, states


def bwd_call(q, k, w, u, g, doc, states, do, dsT, *, prec, chunk_size=64, interpret=False, block_v=None):
    """(dq, dk, dw, du, dg, ds0), fp32, from the stored chunk-start states."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C, N = chunk_size, Tp // chunk_size
    cfg = gpu_config(Kp, Vp, block_v)
    bv = cfg.block_v_seq
    par = dict(chunk_size=C, block_v=cfg.block_v_par, prec=prec, compiler_params=_params(cfg.warps_par))
    dvl = chunk_parallel.dv_local_call(q, k, g, doc, do, interpret=interpret, **par)
    full_k, tile_v, state, states_spec, g_spec = _seq_specs(Tp, Kp, N, bv)
    kernel, operands, in_specs = chunk_parallel.with_documents(
        functools.partial(_dstate_kernel, C=C, N=N, prec=prec),
        [q, k, w, g, do, dvl, dsT],
        [full_k, full_k, full_k, g_spec, tile_v, tile_v, state],
        doc,
        g_spec,
        4,
    )
    dvn, ds_after, ds0 = pl.pallas_call(
        kernel,
        grid=(B, H, Vp // bv),
        in_specs=in_specs,
        out_specs=[tile_v, states_spec, state],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, Tp, Vp), _F32),
            jax.ShapeDtypeStruct((B, H, N, Kp, Vp), q.dtype),
            jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32),
        ],
        compiler_params=_params(cfg.warps_seq, cfg.stages_seq),
        interpret=interpret,
        name="gated_delta_dstate",
    )(*operands)
    dq, dk, dw, dg = chunk_parallel.grads_call(
        q, k, w, u, g, doc, states, do, dvn, ds_after, interpret=interpret, **par
    )
    return dq, dk, dw, dvn, dg, ds0


@functools.cache
def rule(chunk_size=64, interpret=False, block_v=None):
    """The custom_vjp rule for one static configuration (cached so jit sees one function)."""
    kw = dict(chunk_size=chunk_size, interpret=interpret, block_v=block_v)
    return chunk_math.make_rule(functools.partial(fwd_call, **kw), functools.partial(bwd_call, **kw))


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
    segment_ids=None,
    interpret=False,
    block_v=None,
    prec=None,
):
    if prec is None and jnp.dtype(q.dtype) == jnp.float32 and not interpret:
        prec = FP32_DOTS
    return chunk_math.chunked_gated_delta_rule(
        rule(chunk_size, interpret, block_v),
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
