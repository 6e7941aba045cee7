"""Pallas flash attention for TPUs (Mosaic), forward and recomputing backward.

TPU grids run in order, so the reduction axis is a grid axis marked "arbitrary" and the running state
lives in VMEM scratch across its steps (inputs are [B, H, T, D] so a tile's last two dims are (rows, D)):
  forward  grid (B, Hq, T/bq, S/bk): m, l, acc scratch; online softmax
           m' = max(m, rowmax s), l' = e^{m-m'} l + Σ e^{s-m'}, acc' = e^{m-m'} acc + e^{s-m'} v,
           written out (o = acc/l, lse = m + log l) on the last key step.
  dq       grid (B, Hq, T/bq, S/bk): dq += dS k with P = e^{s-lse}, dS = P ∘ (dO vᵀ − Δ).
  dk/dv    grid (B, Hkv, S/bk, G, T/bq): dk += dSᵀ q, dv += Pᵀ dO, summed over the G query heads of
           the KV head and over query tiles (both "arbitrary").
Causal tiles above the diagonal are skipped with `pl.when`, and their index maps are clamped to the
last needed tile so the pipeline does not even fetch them (an unchanged block index is not re-copied).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_attention._common import MASK_VALUE, pad_axis, round_up

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ
_TN = (((0,), (0,)), ((), ()))  # aᵀ @ b


def _visible(i, j, bq, bk, *, causal, q_offset, kv_len):
    """[bq, bk] mask of query tile i vs key tile j (2-D iotas: Mosaic has no 1-D vector layout)."""
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    ok = k_pos < kv_len
    if causal:
        q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        ok = ok & (k_pos <= q_pos + q_offset)
    return ok


def _last_k_tile(i, *, bq, bk, nk, causal, q_offset):
    """Index of the last key tile query tile i needs."""
    if not causal:
        return nk - 1
    return jnp.minimum((i * bq + bq - 1 + q_offset) // bk, nk - 1)


def _first_q_tile(j, *, bq, bk, causal, q_offset):
    if not causal:
        return 0
    return jnp.maximum(j * bk - q_offset, 0) // bq


def _fwd_kernel(
    q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, scale, causal, q_offset, kv_len, bq, bk, nk
):
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, _F32)
        l_sc[...] = jnp.zeros(l_sc.shape, _F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    @pl.when(j <= _last_k_tile(i, bq=bq, bk=bk, nk=nk, causal=causal, q_offset=q_offset))
    def _step():
        s = lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=_F32) * scale
        s = jnp.where(_visible(i, j, bq, bk, causal=causal, q_offset=q_offset, kv_len=kv_len), s, MASK_VALUE)
        m_prev = m_sc[...]  # [bq, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = corr * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_sc[...] = corr * acc_sc[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=_F32)
        m_sc[...] = m_new

    @pl.when(j == nk - 1)
    def _finish():
        o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_sc, *, scale, causal, q_offset, kv_len, bq, bk, nk
):
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, _F32)

    @pl.when(j <= _last_k_tile(i, bq=bq, bk=bk, nk=nk, causal=causal, q_offset=q_offset))
    def _step():
        k = k_ref[...]
        s = lax.dot_general(q_ref[...], k, _NT, preferred_element_type=_F32) * scale
        vis = _visible(i, j, bq, bk, causal=causal, q_offset=q_offset, kv_len=kv_len)
        p = jnp.where(vis, jnp.exp(s - lse_ref[...]), 0.0)
        dp = lax.dot_general(do_ref[...], v_ref[...], _NT, preferred_element_type=_F32)
        ds = p * (dp - delta_ref[...])
        dq_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=_F32)

    @pl.when(j == nk - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    dk_sc,
    dv_sc,
    *,
    scale,
    causal,
    q_offset,
    kv_len,
    bq,
    bk,
    nq,
    groups,
):
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, _F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, _F32)

    @pl.when(i >= _first_q_tile(j, bq=bq, bk=bk, causal=causal, q_offset=q_offset))
    def _step():
        q, do = q_ref[...], do_ref[...]
        s = lax.dot_general(q, k_ref[...], _NT, preferred_element_type=_F32) * scale
        vis = _visible(i, j, bq, bk, causal=causal, q_offset=q_offset, kv_len=kv_len)
        p = jnp.where(vis, jnp.exp(s - lse_ref[...]), 0.0)  # [bq, bk]
        dv_sc[...] += lax.dot_general(p.astype(do.dtype), do, _TN, preferred_element_type=_F32)
        dp = lax.dot_general(do, v_ref[...], _NT, preferred_element_type=_F32)
        ds = p * (dp - delta_ref[...])
        dk_sc[...] += lax.dot_general(ds.astype(q.dtype), q, _TN, preferred_element_type=_F32)

    @pl.when((g == groups - 1) & (i == nq - 1))
    def _finish():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _params(n_parallel: int, n_arbitrary: int):
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_parallel + ("arbitrary",) * n_arbitrary)


def _forward(q, k, v, cfg):
    """q [B,Hq,T,D], k/v [B,Hkv,S,D] -> (o like q, lse [B,Hq,T,1] fp32); T and S padded to this pass's tiles."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    groups = hq // hkv
    bq, bk = cfg["fwd"]
    tp, sp = round_up(t, bq), round_up(s, bk)
    nk = sp // bk
    last = functools.partial(_last_k_tile, bq=bq, bk=bk, nk=nk, causal=cfg["causal"], q_offset=cfg["q_offset"])
    q_spec = pl.BlockSpec((None, None, bq, d), lambda b_, h, i, j: (b_, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b_, h, i, j: (b_, h // groups, jnp.minimum(j, last(i)), 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b_, h, i, j: (b_, h, i, 0))
    kernel = functools.partial(
        _fwd_kernel,
        scale=cfg["scale"],
        causal=cfg["causal"],
        q_offset=cfg["q_offset"],
        kv_len=s,
        bq=bq,
        bk=bk,
        nk=nk,
    )
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, hq, tp // bq, nk),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((b, hq, tp, d), q.dtype), jax.ShapeDtypeStruct((b, hq, tp, 1), _F32)],
        scratch_shapes=[pltpu.VMEM((bq, 1), _F32), pltpu.VMEM((bq, 1), _F32), pltpu.VMEM((bq, d), _F32)],
        compiler_params=_params(3, 1),
        interpret=cfg["interpret"],
        name="flash_attention_fwd",
    )(pad_axis(q, 2, tp), pad_axis(k, 2, sp), pad_axis(v, 2, sp))
    return o[:, :, :t], lse[:, :, :t]


def _padded(q, k, v, do, lse, delta, *, tp, sp):
    """The backward kernels' operands with queries padded to tp rows and keys to sp."""
    return (pad_axis(q, 2, tp), pad_axis(k, 2, sp), pad_axis(v, 2, sp), *(pad_axis(x, 2, tp) for x in (do, lse, delta)))


def _backward(q, k, v, o, lse, do, cfg):
    """Unpadded q/o/do [B,Hq,T,D], k/v [B,Hkv,S,D], lse [B,Hq,T,1]; each kernel pads T and S to its own tiles."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    groups = hq // hkv
    common = dict(scale=cfg["scale"], causal=cfg["causal"], q_offset=cfg["q_offset"], kv_len=s)
    delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1, keepdims=True)  # [B,Hq,T,1]
    # Padded query rows have q = dO = 0 and Δ = lse = 0, so they add nothing to any gradient.

    bq, bk = cfg["dq"]
    tp, sp = round_up(t, bq), round_up(s, bk)
    nk = sp // bk
    last = functools.partial(_last_k_tile, bq=bq, bk=bk, nk=nk, causal=cfg["causal"], q_offset=cfg["q_offset"])
    q_spec = pl.BlockSpec((None, None, bq, d), lambda b_, h, i, j: (b_, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b_, h, i, j: (b_, h // groups, jnp.minimum(j, last(i)), 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b_, h, i, j: (b_, h, i, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, nk=nk, **common),
        grid=(b, hq, tp // bq, nk),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((b, hq, tp, d), q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, d), _F32)],
        compiler_params=_params(3, 1),
        interpret=cfg["interpret"],
        name="flash_attention_dq",
    )(*_padded(q, k, v, do, lse, delta, tp=tp, sp=sp))[:, :, :t]

    bq, bk = cfg["dkv"]
    tp, sp = round_up(t, bq), round_up(s, bk)
    nq = tp // bq
    first = functools.partial(_first_q_tile, bq=bq, bk=bk, causal=cfg["causal"], q_offset=cfg["q_offset"])
    qg_spec = pl.BlockSpec(
        (None, None, bq, d), lambda b_, h, j, g, i: (b_, h * groups + g, jnp.maximum(i, first(j)), 0)
    )
    rowg_spec = pl.BlockSpec(
        (None, None, bq, 1), lambda b_, h, j, g, i: (b_, h * groups + g, jnp.maximum(i, first(j)), 0)
    )
    k_spec = pl.BlockSpec((None, None, bk, d), lambda b_, h, j, g, i: (b_, h, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, bq=bq, bk=bk, nq=nq, groups=groups, **common),
        grid=(b, hkv, sp // bk, groups, nq),
        in_specs=[qg_spec, k_spec, k_spec, qg_spec, rowg_spec, rowg_spec],
        out_specs=[k_spec, k_spec],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, sp, d), k.dtype), jax.ShapeDtypeStruct((b, hkv, sp, d), v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, d), _F32), pltpu.VMEM((bk, d), _F32)],
        compiler_params=_params(3, 2),
        interpret=cfg["interpret"],
        name="flash_attention_dkv",
    )(*_padded(q, k, v, do, lse, delta, tp=tp, sp=sp))
    return dq, dk[:, :, :s], dv[:, :, :s]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg):
    return _forward(q, k, v, dict(cfg))[0]


def _attention_fwd(q, k, v, cfg):
    o, lse = _forward(q, k, v, dict(cfg))
    return o, (q, k, v, o, lse)


def _attention_bwd(cfg, res, do):
    return _backward(*res, do, dict(cfg))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _tile(block: int, length: int) -> int:
    if block % 8:
        raise ValueError(f"TPU block sizes must be multiples of 8 (sublane tiling), got {block}")
    return min(block, round_up(length, 8))


def flash_attention_tpu(q, k, v, *, causal: bool, scale: float, q_offset: int, block_sizes, interpret: bool = False):
    """q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D]. Arguments already validated by the API.

    Transposes to [B, H, T, D] (tiles then end in (rows, D), what Mosaic wants); each kernel zero-pads T and S
    to multiples of its own tiles only (padded keys are masked by length; padded query rows get zero cotangents).
    """
    t, s = q.shape[1], k.shape[1]
    bs = block_sizes
    cfg = (
        ("scale", float(scale)),
        ("causal", bool(causal)),
        ("q_offset", int(q_offset)),
        ("fwd", (_tile(bs.block_q, t), _tile(bs.block_k, s))),
        ("dq", tuple(_tile(x, n) for x, n in zip(bs.dq, (t, s)))),
        ("dkv", tuple(_tile(x, n) for x, n in zip(bs.dkv, (t, s)))),
        ("interpret", bool(interpret)),
    )
    q_, k_, v_ = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    return _attention(q_, k_, v_, cfg).transpose(0, 2, 1, 3)
