"""Pallas flash attention for GPUs (Triton lowering), forward and recomputing backward.

Kernels (one program per (batch, head, tile); K/V of the whole sequence are passed as one block, which
the Triton lowering turns into a pointer, and are read tile by tile inside a `lax.fori_loop`):
  forward  grid (B, Hq, T/bq):  online softmax over key tiles, in base 2 (exp2 is the native GPU
           instruction): s₂ = log2(e)·scale·q kᵀ, m' = max(m, rowmax s₂), l' = 2^{m-m'} l + Σ 2^{s₂-m'},
           acc' = 2^{m-m'} acc + 2^{s₂-m'} v;  o = acc / l,  lse = ln2 · (m + log2 l).
  dq       grid (B, Hq, T/bq):  P = 2^{s₂ - lse·log2 e},  dS = P ∘ (dO vᵀ − Δ),  dq = scale Σ_j dS k_j.
  dk/dv    grid (B, Hkv, S/bk): dv = Σ_{g,i} Pᵀ dO,  dk = scale Σ_{g,i} dSᵀ q — the G query heads of a
           KV group are summed inside the program (GQA without repeating K/V or a separate reduction).
Causal tiles are skipped through the loop bounds; tiles that straddle the diagonal or the padded tail
of the keys run in a second loop with the mask, fully visible tiles run unmasked.
Only documented Pallas features are used (program_id, ref indexing with pl.ds, jnp.dot with fp32
accumulation, lax.fori_loop), so the same code runs with interpret=True on a CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.flash_attention._common import MASK_VALUE, cdiv, round_up

_F32 = jnp.float32
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _visible(q_pos, k_pos, *, causal, q_offset, kv_len):
    ok = k_pos[None, :] < kv_len
    if causal:
        ok = ok & (k_pos[None, :] <= q_pos[:, None] + q_offset)
    return ok


def _k_tile_bounds(i, *, bq, bk, causal, q_offset, kv_len):
    """(n_full, n_end) for query tile i: key tiles [0, n_full) need no mask, [n_full, n_end) do."""
    n_keys_full, n_keys = kv_len // bk, cdiv(kv_len, bk)
    if not causal:
        return n_keys_full, n_keys
    # Tile j is fully visible iff its last key (j+1)·bk-1 <= the tile's first query i·bq + q_offset.
    n_full = jnp.minimum(lax.div(i * bq + q_offset + 1, bk), n_keys_full)
    n_end = jnp.minimum(lax.div(i * bq + bq - 1 + q_offset, bk) + 1, n_keys)
    return n_full, n_end


def _q_tile_bounds(j, *, bq, bk, nq, causal, q_offset, kv_len):
    """(lo, mid) for key tile j: query tiles [lo, mid) need the mask, [mid, nq) do not."""
    ragged = (j + 1) * bk > kv_len  # this key tile holds padding: mask every query tile
    if not causal:
        return 0, jnp.where(ragged, nq, 0)
    lo = lax.div(jnp.maximum(j * bk - q_offset, 0), bq)
    # Query tile i sees all of key tile j iff i·bq + q_offset >= (j+1)·bk - 1.
    mid = lax.div(jnp.maximum((j + 1) * bk - 1 - q_offset, 0) + bq - 1, bq)
    mid = jnp.minimum(jnp.maximum(mid, lo), nq)
    return lo, jnp.where(ragged, nq, mid)


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, causal, q_offset, kv_len, bq, bk):
    i = pl.program_id(2)
    q = q_ref[...]  # [bq, D]; stays in registers for the whole loop
    q_pos = i * bq + jnp.arange(bq)

    def body(j, carry, masked):
        m, l, acc = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s = jnp.dot(q, k.T, preferred_element_type=_F32) * (scale * _LOG2E)
        if masked:
            vis = _visible(q_pos, start + jnp.arange(bk), causal=causal, q_offset=q_offset, kv_len=kv_len)
            s = jnp.where(vis, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = corr * l + jnp.sum(p, axis=1)
        acc = corr[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=_F32)
        return m_new, l, acc

    carry = (jnp.full((bq,), -jnp.inf, _F32), jnp.zeros((bq,), _F32), jnp.zeros((bq, q.shape[-1]), _F32))
    n_full, n_end = _k_tile_bounds(i, bq=bq, bk=bk, causal=causal, q_offset=q_offset, kv_len=kv_len)
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    m, l, acc = lax.fori_loop(n_full, n_end, functools.partial(body, masked=True), carry)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log2(l)) * _LN2


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, causal, q_offset, kv_len, bq, bk):
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse2 = lse_ref[...] * _LOG2E
    delta = delta_ref[...]
    q_pos = i * bq + jnp.arange(bq)

    def body(j, dq, masked):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        p = jnp.exp2(jnp.dot(q, k.T, preferred_element_type=_F32) * (scale * _LOG2E) - lse2[:, None])
        if masked:
            vis = _visible(q_pos, start + jnp.arange(bk), causal=causal, q_offset=q_offset, kv_len=kv_len)
            p = jnp.where(vis, p, 0.0)
        dp = jnp.dot(do, v.T, preferred_element_type=_F32)
        ds = p * (dp - delta[:, None])
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=_F32)

    n_full, n_end = _k_tile_bounds(i, bq=bq, bk=bk, causal=causal, q_offset=q_offset, kv_len=kv_len)
    dq = jnp.zeros(q.shape, _F32)
    dq = lax.fori_loop(0, n_full, functools.partial(body, masked=False), dq)
    dq = lax.fori_loop(n_full, n_end, functools.partial(body, masked=True), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
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
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]  # [bk, D]
    k_pos = j * bk + jnp.arange(bk)

    def body(i, carry, masked):
        dk, dv = carry
        start = pl.multiple_of(i * bq, bq)
        q_pos = start + jnp.arange(bq)
        for g in range(groups):  # the G query heads that read this KV head (static unroll)
            q = q_ref[pl.ds(start, bq), g, :]
            do = do_ref[pl.ds(start, bq), g, :]
            lse2 = lse_ref[g, pl.ds(start, bq)] * _LOG2E
            delta = delta_ref[g, pl.ds(start, bq)]
            p = jnp.exp2(jnp.dot(q, k.T, preferred_element_type=_F32) * (scale * _LOG2E) - lse2[:, None])
            if masked:
                vis = _visible(q_pos, k_pos, causal=causal, q_offset=q_offset, kv_len=kv_len)
                p = jnp.where(vis, p, 0.0)
            dv = dv + jnp.dot(p.astype(do.dtype).T, do, preferred_element_type=_F32)
            dp = jnp.dot(do, v.T, preferred_element_type=_F32)
            ds = p * (dp - delta[:, None])
            dk = dk + jnp.dot(ds.astype(q.dtype).T, q, preferred_element_type=_F32)
        return dk, dv

    lo, mid = _q_tile_bounds(j, bq=bq, bk=bk, nq=nq, causal=causal, q_offset=q_offset, kv_len=kv_len)
    zeros = jnp.zeros(k.shape, _F32)
    carry = lax.fori_loop(lo, mid, functools.partial(body, masked=True), (zeros, zeros))
    dk, dv = lax.fori_loop(mid, nq, functools.partial(body, masked=False), carry)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(bs, d):
    # 4 warps cover a 64-wide head comfortably; 128-wide tiles need 8 to keep registers from spilling.
    return plgpu.CompilerParams(num_warps=bs["num_warps"] or (4 if d <= 64 else 8), num_stages=bs["num_stages"] or 2)


def _forward(q, k, v, cfg):
    """Padded inputs q [B,Tp,Hq,Dp], k/v [B,Sp,Hkv,Dp] -> (o like q, lse [B,Hq,Tp] fp32)."""
    b, tp, hq, d = q.shape
    sp, hkv = k.shape[1], k.shape[2]
    groups = hq // hkv
    bq, bk = cfg["fwd"]
    kernel = functools.partial(
        _fwd_kernel,
        scale=cfg["scale"],
        causal=cfg["causal"],
        q_offset=cfg["q_offset"],
        kv_len=cfg["kv_len"],
        bq=bq,
        bk=bk,
    )
    q_spec = pl.BlockSpec((None, bq, None, d), lambda b_, h, i: (b_, i, h, 0))
    kv_spec = pl.BlockSpec((None, sp, None, d), lambda b_, h, i: (b_, 0, lax.div(h, groups), 0))
    return pl.pallas_call(
        kernel,
        grid=(b, hq, tp // bq),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda b_, h, i: (b_, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, tp), _F32)],
        compiler_params=_params(cfg, d),
        interpret=cfg["interpret"],
        name="flash_attention_fwd",
    )(q, k, v)


def _backward(q, k, v, o, lse, do, cfg):
    b, tp, hq, d = q.shape
    sp, hkv = k.shape[1], k.shape[2]
    groups = hq // hkv
    common = dict(scale=cfg["scale"], causal=cfg["causal"], q_offset=cfg["q_offset"], kv_len=cfg["kv_len"])
    # Δ = rowsum(dO ∘ O), [B, Hq, Tp] fp32: a cheap fused XLA reduction.
    delta = jnp.einsum("bthd,bthd->bht", do.astype(_F32), o.astype(_F32))

    bq, bk = cfg["dq"]
    q_spec = pl.BlockSpec((None, bq, None, d), lambda b_, h, i: (b_, i, h, 0))
    kv_spec = pl.BlockSpec((None, sp, None, d), lambda b_, h, i: (b_, 0, lax.div(h, groups), 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda b_, h, i: (b_, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, **common),
        grid=(b, hq, tp // bq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(cfg, d),
        interpret=cfg["interpret"],
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta)

    bq, bk = cfg["dkv"]
    # Free reshapes: the G query heads of KV head h are contiguous (h·G .. h·G+G-1).
    q5 = q.reshape(b, tp, hkv, groups, d)
    do5 = do.reshape(b, tp, hkv, groups, d)
    lse4 = lse.reshape(b, hkv, groups, tp)
    delta4 = delta.reshape(b, hkv, groups, tp)
    qg_spec = pl.BlockSpec((None, tp, None, groups, d), lambda b_, h, j: (b_, 0, h, 0, 0))
    rowg_spec = pl.BlockSpec((None, None, groups, tp), lambda b_, h, j: (b_, h, 0, 0))
    k_spec = pl.BlockSpec((None, bk, None, d), lambda b_, h, j: (b_, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, bq=bq, bk=bk, nq=tp // bq, groups=groups, **common),
        grid=(b, hkv, sp // bk),
        in_specs=[qg_spec, k_spec, k_spec, qg_spec, rowg_spec, rowg_spec],
        out_specs=[k_spec, k_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(cfg, d),
        interpret=cfg["interpret"],
        name="flash_attention_dkv",
    )(q5, k, v, do5, lse4, delta4)
    return dq, dk, dv


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
    # Triton tiles must be powers of two, and tl.dot needs at least 16 rows; never exceed the data.
    return max(16, min(pl.next_power_of_2(block), pl.next_power_of_2(length)))


def flash_attention_gpu(q, k, v, *, causal: bool, scale: float, q_offset: int, block_sizes, interpret: bool = False):
    """q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D]. Arguments already validated by the API.

    T and S are zero-padded to tile multiples (padded keys are masked by length, padded query rows are
    sliced off and get zero cotangents), and D to a power of two (zero columns change no dot product).
    """
    b, t, hq, d = q.shape
    s = k.shape[1]
    bs = block_sizes
    fwd = (_tile(bs.block_q, t), _tile(bs.block_k, s))
    dq = tuple(_tile(x, n) for x, n in zip(bs.dq, (t, s)))
    dkv = tuple(_tile(x, n) for x, n in zip(bs.dkv, (t, s)))
    tp = round_up(t, max(fwd[0], dq[0], dkv[0]))  # all powers of two: the max is a common multiple
    sp = round_up(s, max(fwd[1], dq[1], dkv[1]))
    dp = max(16, pl.next_power_of_2(d))
    q_ = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, dp - d)))
    k_ = jnp.pad(k, ((0, 0), (0, sp - s), (0, 0), (0, dp - d)))
    v_ = jnp.pad(v, ((0, 0), (0, sp - s), (0, 0), (0, dp - d)))
    cfg = (
        ("scale", float(scale)),
        ("causal", bool(causal)),
        ("q_offset", int(q_offset)),
        ("kv_len", s),
        ("fwd", fwd),
        ("dq", dq),
        ("dkv", dkv),
        ("num_warps", bs.num_warps),
        ("num_stages", bs.num_stages),
        ("interpret", bool(interpret)),
    )
    return _attention(q_, k_, v_, cfg)[:, :t, :, :d]
