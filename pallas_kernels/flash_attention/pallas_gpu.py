"""Pallas flash attention for GPUs (Triton lowering), forward and recomputing backward.

Kernels (K/V, or Q/dO for dk/dv, of the whole sequence are passed as one block, which the Triton lowering
turns into a pointer, and are read tile by tile inside a `lax.fori_loop` that Triton software-pipelines):
  forward  grid (T/bq, Hq, B):  online softmax over key tiles, in base 2 (exp2 is the native GPU
           instruction): s₂ = log2(e)·scale·q kᵀ, m' = max(m, rowmax s₂), l' = 2^{m-m'} l + Σ 2^{s₂-m'},
           acc' = 2^{m-m'} acc + 2^{s₂-m'} v;  o = acc / l,  lse = ln2 · (m + log2 l).
  dq       grid (T/bq, Hq, B):  P = 2^{s₂ - lse·log2 e},  dS = P ∘ (dO vᵀ − Δ),  dq = scale Σ_j dS k_j.
  dk/dv    grid (S/bk, Hkv·R, B): dv = Σ_{g,i} Pᵀ dO,  dk = scale Σ_{g,i} dSᵀ q, where (g, i) runs over the
           query heads g of the program's share of the KV head's group and the query tiles i, flattened into
           ONE loop (n → g = n // n_i, i = n mod n_i), so the G heads are neither unrolled (shared memory and
           code size would grow with G) nor restarted as separate pipelines. R splits the group across R
           programs when B·Hkv·S/bk alone would leave SMs idle; their f32 partial dk/dv are summed by XLA.
Query tiles run heaviest-first (causal rows near the end see the most keys), so the last wave is short.
Causal tiles are skipped through the loop bounds; tiles that straddle the diagonal or the padded tail
of the keys run in a second loop with the mask, fully visible tiles run unmasked. In dk/dv the key-length
mask is not needed: a padded key's dk/dv row depends on that key alone and is sliced off.
Segment ids (packed documents): each kernel also gets the ids of its own rows as a tile, the ids of the whole
other side as one block (read tile by tile, like K/V), and per program a span [lo, hi) of the tiles it loops
over: XLA computes, before the call, each tile's [min, max] id and (_common.segment_tile_spans) the first and
last tile of the other side whose range meets it. The loops above are clipped to that span, so a tile pair
whose ranges cannot meet is never loaded (for sorted ids the span is exactly the tiles holding a shared
document; unsorted ids inside the span are computed under the mask, which is what makes any ids correct).
Clipping the loop bounds keeps the loop bodies free of branches, which Triton's software pipelining needs.
With ids every computed tile applies the id mask (q_seg == kv_seg), the unmasked loops included, and a query
with no visible key (m never above MASK_VALUE) outputs 0. Without ids the kernels take no extra operands.
Each pass zero-pads T and S to its own tiles only. Operands enter the dots in the input dtype (bf16 tensor
cores for bf16 inputs) with f32 accumulation. Only documented Pallas features are used (program_id, ref
indexing with pl.ds, jnp.dot with f32 accumulation, lax.fori_loop), so the same code runs with interpret=True
on a CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import pallas_triton
from pallas_kernels.flash_attention._common import (
    MASK_VALUE,
    cdiv,
    has_visible_key,
    pad_axis,
    round_up,
    segment_tile_spans,
)

plgpu = pallas_triton()

_F32 = jnp.float32
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Enough thread blocks for two waves over an H100/H200's 132 SMs: below that, dk/dv splits the query heads of a
# KV group across programs.
_TARGET_PROGRAMS = 2 * 132


def _visible(q_pos, k_pos, *, causal, q_offset, kv_len):
    ok = k_pos[None, :] < kv_len
    if causal:
        ok = ok & (k_pos[None, :] <= q_pos[:, None] + q_offset)
    return ok


def _and_same_segment(vis, q_seg, k_seg):
    """``vis`` (a [bq, bk] mask or None) restricted to pairs of the same segment; None without segment ids."""
    if q_seg is None:
        return vis
    same = q_seg[:, None] == k_seg[None, :]
    return same if vis is None else vis & same


def _clip(lo, hi, span_ref):
    """Loop bounds [lo, hi) clipped to the program's segment span (span_ref [2] int32: first, one-past-last)."""
    if span_ref is None:
        return lo, hi
    return jnp.maximum(lo, span_ref[0]), jnp.minimum(hi, span_ref[1])


def _k_tile_bounds(i, *, bq, bk, causal, q_offset, kv_len):
    """(n_full, n_end) for query tile i: key tiles [0, n_full) need no mask, [n_full, n_end) do."""
    n_keys_full, n_keys = kv_len // bk, cdiv(kv_len, bk)
    if not causal:
        return n_keys_full, n_keys
    # Tile j is fully visible iff its last key (j+1)·bk-1 <= the tile's first query i·bq + q_offset.
    n_full = jnp.minimum(lax.div(i * bq + q_offset + 1, bk), n_keys_full)
    n_end = jnp.minimum(lax.div(i * bq + bq - 1 + q_offset, bk) + 1, n_keys)
    return n_full, n_end


def _q_tile_bounds(j, *, bq, bk, nq, q_offset):
    """(lo, mid) for key tile j under the causal mask: query tiles [lo, mid) need it, [mid, nq) see all keys."""
    lo = lax.div(jnp.maximum(j * bk - q_offset, 0), bq)
    # Query tile i sees all of key tile j iff i·bq + q_offset >= (j+1)·bk - 1.
    mid = lax.div(jnp.maximum((j + 1) * bk - 1 - q_offset, 0) + bq - 1, bq)
    return jnp.minimum(lo, nq), jnp.minimum(jnp.maximum(mid, lo), nq)


def _heaviest_first(nq):
    """Query tile of this program: grid axis 0 reversed, so causal tiles with the most keys start first."""
    return nq - 1 - pl.program_id(0)


def _segment_refs(refs, n_in: int, segmented: bool):
    """Split a kernel's refs into (its n_in usual inputs, (own-tile ids, other side's ids, span) or Nones, outputs)."""
    if not segmented:
        return refs[:n_in], (None, None, None), refs[n_in:]
    return refs[:n_in], refs[n_in : n_in + 3], refs[n_in + 3 :]


def _fwd_kernel(*refs, scale, causal, q_offset, kv_len, bq, bk, nq, segmented):
    (q_ref, k_ref, v_ref), (qs_ref, ks_ref, span_ref), (o_ref, lse_ref) = _segment_refs(refs, 3, segmented)
    i = _heaviest_first(nq)
    q = q_ref[...]  # [bq, D]; stays in registers for the whole loop
    q_pos = i * bq + jnp.arange(bq)
    q_seg = None if qs_ref is None else qs_ref[...]

    def body(j, carry, masked):
        m, l, acc = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s = jnp.dot(q, k.T, preferred_element_type=_F32) * (scale * _LOG2E)
        vis = None
        if masked:
            vis = _visible(q_pos, start + jnp.arange(bk), causal=causal, q_offset=q_offset, kv_len=kv_len)
        vis = _and_same_segment(vis, q_seg, None if ks_ref is None else ks_ref[pl.ds(start, bk)])
        if vis is not None:
            s = jnp.where(vis, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = corr * l + jnp.sum(p, axis=1)
        acc = corr[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=_F32)
        return m_new, l, acc

    carry = (jnp.full((bq,), -jnp.inf, _F32), jnp.zeros((bq,), _F32), jnp.zeros((bq, q.shape[-1]), _F32))
    n_full, n_end = _k_tile_bounds(i, bq=bq, bk=bk, causal=causal, q_offset=q_offset, kv_len=kv_len)
    carry = lax.fori_loop(*_clip(0, n_full, span_ref), functools.partial(body, masked=False), carry)
    m, l, acc = lax.fori_loop(*_clip(n_full, n_end, span_ref), functools.partial(body, masked=True), carry)
    if segmented:  # a query whose segment has no key it may see outputs 0 (l may be 0: never divide by it)
        o_ref[...] = jnp.where(has_visible_key(m)[:, None], acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0).astype(
            o_ref.dtype
        )
    else:
        o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log2(l)) * _LN2


def _dq_kernel(*refs, scale, causal, q_offset, kv_len, bq, bk, nq, segmented):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (qs_ref, ks_ref, span_ref), (dq_ref,) = _segment_refs(
        refs, 6, segmented
    )
    i = _heaviest_first(nq)
    q, do = q_ref[...], do_ref[...]
    lse2 = lse_ref[...] * _LOG2E
    delta = delta_ref[...]
    q_pos = i * bq + jnp.arange(bq)
    q_seg = None if qs_ref is None else qs_ref[...]

    def body(j, dq, masked):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        p = jnp.exp2(jnp.dot(q, k.T, preferred_element_type=_F32) * (scale * _LOG2E) - lse2[:, None])
        vis = None
        if masked:
            vis = _visible(q_pos, start + jnp.arange(bk), causal=causal, q_offset=q_offset, kv_len=kv_len)
        vis = _and_same_segment(vis, q_seg, None if ks_ref is None else ks_ref[pl.ds(start, bk)])
        if vis is not None:
            p = jnp.where(vis, p, 0.0)
        dp = jnp.dot(do, v.T, preferred_element_type=_F32)
        ds = p * (dp - delta[:, None])
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=_F32)

    n_full, n_end = _k_tile_bounds(i, bq=bq, bk=bk, causal=causal, q_offset=q_offset, kv_len=kv_len)
    dq = jnp.zeros(q.shape, _F32)
    dq = lax.fori_loop(*_clip(0, n_full, span_ref), functools.partial(body, masked=False), dq)
    dq = lax.fori_loop(*_clip(n_full, n_end, span_ref), functools.partial(body, masked=True), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, scale, causal, q_offset, bq, bk, nq, heads, segmented):
    """q_ref/do_ref [Tp, heads, D] and lse_ref/delta_ref [heads, Tp]: this program's query heads of the group."""
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (ks_ref, qs_ref, span_ref), (dk_ref, dv_ref) = _segment_refs(
        refs, 6, segmented
    )
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]  # [bk, D]
    k_pos = j * bk + jnp.arange(bk)
    k_seg = None if ks_ref is None else ks_ref[...]

    def body(n, carry, *, first, count, masked):
        dk, dv = carry
        g = lax.div(n, count)
        start = pl.multiple_of((first + lax.rem(n, count)) * bq, bq)
        q = q_ref[pl.ds(start, bq), g, :]
        do = do_ref[pl.ds(start, bq), g, :]
        lse2 = lse_ref[g, pl.ds(start, bq)] * _LOG2E
        delta = delta_ref[g, pl.ds(start, bq)]
        p = jnp.exp2(jnp.dot(q, k.T, preferred_element_type=_F32) * (scale * _LOG2E) - lse2[:, None])
        vis = None
        if masked:
            q_pos = start + jnp.arange(bq)
            vis = k_pos[None, :] <= q_pos[:, None] + q_offset
        vis = _and_same_segment(vis, None if qs_ref is None else qs_ref[pl.ds(start, bq)], k_seg)
        if vis is not None:
            p = jnp.where(vis, p, 0.0)
        dv = dv + jnp.dot(p.astype(do.dtype).T, do, preferred_element_type=_F32)
        dp = jnp.dot(do, v.T, preferred_element_type=_F32)
        ds = p * (dp - delta[:, None])
        dk = dk + jnp.dot(ds.astype(q.dtype).T, q, preferred_element_type=_F32)
        return dk, dv

    zeros = jnp.zeros(k.shape, _F32)
    carry = (zeros, zeros)
    if span_ref is not None:
        # With segment ids every tile is masked anyway: one loop over the span, applying the causal mask too. (Split
        # at the diagonal as below, the id mask alone in the long loop made ptxas spill at d=128.)
        lo = _q_tile_bounds(j, bq=bq, bk=bk, nq=nq, q_offset=q_offset)[0] if causal else 0
        first, last = _clip(lo, nq, span_ref)
        count = jnp.maximum(last - first, 0)
        dk, dv = lax.fori_loop(
            0, heads * count, functools.partial(body, first=first, count=count, masked=causal), carry
        )
    else:
        if causal:
            lo, mid = _q_tile_bounds(j, bq=bq, bk=bk, nq=nq, q_offset=q_offset)
            diagonal = functools.partial(body, first=lo, count=mid - lo, masked=True)
            carry = lax.fori_loop(0, heads * (mid - lo), diagonal, carry)
        else:
            mid = 0
        below = functools.partial(body, first=mid, count=nq - mid, masked=False)
        dk, dv = lax.fori_loop(0, heads * (nq - mid), below, carry)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(launch):
    num_warps, num_stages = launch
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _group_splits(groups: int, programs: int) -> int:
    """Smallest divisor R of the group size with R·programs >= _TARGET_PROGRAMS (the whole group if none)."""
    for r in range(1, groups + 1):
        if groups % r == 0 and r * programs >= _TARGET_PROGRAMS:
            return r
    return groups


def _segment_operands(q_seg, kv_seg, *, bq, bk, tp, sp, per_query_tile: bool):
    """Extra operands of a kernel with segment ids: ids padded to tp / sp, and the spans [B, n, 2] int32 of the
    other side's tiles met by each of this kernel's program tiles (query tiles, or key tiles for dk/dv)."""
    (k_lo, k_hi), (q_lo, q_hi) = segment_tile_spans(q_seg, kv_seg, bq=bq, bk=bk, tp=tp, sp=sp)
    spans = jnp.stack((k_lo, k_hi) if per_query_tile else (q_lo, q_hi), axis=-1)
    return pad_axis(q_seg, 1, tp), pad_axis(kv_seg, 1, sp), spans


def _forward(q, k, v, q_seg, kv_seg, cfg):
    """q [B,T,Hq,D], k/v [B,S,Hkv,D] (D a power of two), ids [B,T] / [B,S] or None -> (o like q, lse [B,Hq,T] f32)."""
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    groups = hq // hkv
    bq, bk = cfg["fwd"]
    tp, sp = round_up(t, bq), round_up(s, bk)
    nq = tp // bq
    kernel = functools.partial(
        _fwd_kernel,
        scale=cfg["scale"],
        causal=cfg["causal"],
        q_offset=cfg["q_offset"],
        kv_len=s,
        bq=bq,
        bk=bk,
        nq=nq,
        segmented=q_seg is not None,
    )
    q_spec = pl.BlockSpec((None, bq, None, d), lambda i, h, b_: (b_, nq - 1 - i, h, 0))
    kv_spec = pl.BlockSpec((None, sp, None, d), lambda i, h, b_: (b_, 0, lax.div(h, groups), 0))
    operands, in_specs = [pad_axis(q, 1, tp), pad_axis(k, 1, sp), pad_axis(v, 1, sp)], [q_spec, kv_spec, kv_spec]
    if q_seg is not None:
        operands += _segment_operands(q_seg, kv_seg, bq=bq, bk=bk, tp=tp, sp=sp, per_query_tile=True)
        in_specs += [
            pl.BlockSpec((None, bq), lambda i, h, b_: (b_, nq - 1 - i)),
            pl.BlockSpec((None, sp), lambda i, h, b_: (b_, 0)),
            pl.BlockSpec((None, None, 2), lambda i, h, b_: (b_, nq - 1 - i, 0)),
        ]
    o, lse = pl.pallas_call(
        kernel,
        grid=(nq, hq, b),
        in_specs=in_specs,
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, h, b_: (b_, h, nq - 1 - i))],
        out_shape=[jax.ShapeDtypeStruct((b, tp, hq, d), q.dtype), jax.ShapeDtypeStruct((b, hq, tp), _F32)],
        compiler_params=_params(cfg["fwd_launch"]),
        interpret=cfg["interpret"],
        name="flash_attention_fwd",
    )(*operands)
    return o[:, :t], lse[:, :, :t]


def _backward(q, k, v, q_seg, kv_seg, o, lse, do, cfg):
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    groups = hq // hkv
    common = dict(scale=cfg["scale"], causal=cfg["causal"], q_offset=cfg["q_offset"], segmented=q_seg is not None)
    # Δ = rowsum(dO ∘ O), [B, Hq, T] f32: a cheap fused XLA reduction (HIGHEST: not a TF32 dot on a GPU).
    delta = jnp.einsum("bthd,bthd->bht", do.astype(_F32), o.astype(_F32), precision=lax.Precision.HIGHEST)
    # Padded query rows have q = dO = 0 and Δ = lse = 0, so they add nothing to any gradient.

    bq, bk = cfg["dq"]
    tp, sp = round_up(t, bq), round_up(s, bk)
    nq = tp // bq
    q_spec = pl.BlockSpec((None, bq, None, d), lambda i, h, b_: (b_, nq - 1 - i, h, 0))
    kv_spec = pl.BlockSpec((None, sp, None, d), lambda i, h, b_: (b_, 0, lax.div(h, groups), 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, h, b_: (b_, h, nq - 1 - i))
    operands = [pad_axis(q, 1, tp), pad_axis(k, 1, sp), pad_axis(v, 1, sp), pad_axis(do, 1, tp)]
    operands += [pad_axis(lse, 2, tp), pad_axis(delta, 2, tp)]
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    if q_seg is not None:
        operands += _segment_operands(q_seg, kv_seg, bq=bq, bk=bk, tp=tp, sp=sp, per_query_tile=True)
        in_specs += [
            pl.BlockSpec((None, bq), lambda i, h, b_: (b_, nq - 1 - i)),
            pl.BlockSpec((None, sp), lambda i, h, b_: (b_, 0)),
            pl.BlockSpec((None, None, 2), lambda i, h, b_: (b_, nq - 1 - i, 0)),
        ]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, nq=nq, kv_len=s, **common),
        grid=(nq, hq, b),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((b, tp, hq, d), q.dtype),
        compiler_params=_params(cfg["bwd_launch"]),
        interpret=cfg["interpret"],
        name="flash_attention_dq",
    )(*operands)[:, :t]

    bq, bk = cfg["dkv"]
    tp, sp = round_up(t, bq), round_up(s, bk)
    nk = sp // bk
    splits = _group_splits(groups, b * hkv * nk)
    heads = groups // splits
    # Free reshapes: the G query heads of KV head h are contiguous (h·G .. h·G+G-1); program (j, h·R + r, b)
    # takes heads r·(G/R) .. (r+1)·(G/R) - 1 of that group.
    q5 = pad_axis(q, 1, tp).reshape(b, tp, hkv, groups, d)
    do5 = pad_axis(do, 1, tp).reshape(b, tp, hkv, groups, d)
    lse4 = pad_axis(lse, 2, tp).reshape(b, hkv, groups, tp)
    delta4 = pad_axis(delta, 2, tp).reshape(b, hkv, groups, tp)
    qg_spec = pl.BlockSpec(
        (None, tp, None, heads, d), lambda j, hr, b_: (b_, 0, lax.div(hr, splits), lax.rem(hr, splits), 0)
    )
    rowg_spec = pl.BlockSpec(
        (None, None, heads, tp), lambda j, hr, b_: (b_, lax.div(hr, splits), lax.rem(hr, splits), 0)
    )
    k_spec = pl.BlockSpec((None, bk, None, d), lambda j, hr, b_: (b_, j, lax.div(hr, splits), 0))
    if splits == 1:
        out_spec = k_spec
        out_shape = jax.ShapeDtypeStruct((b, sp, hkv, d), k.dtype)
    else:  # f32 partial sums, one per share of the group
        out_spec = pl.BlockSpec(
            (None, None, bk, None, d), lambda j, hr, b_: (lax.rem(hr, splits), b_, j, lax.div(hr, splits), 0)
        )
        out_shape = jax.ShapeDtypeStruct((splits, b, sp, hkv, d), _F32)
    operands = [q5, pad_axis(k, 1, sp), pad_axis(v, 1, sp), do5, lse4, delta4]
    in_specs = [qg_spec, k_spec, k_spec, qg_spec, rowg_spec, rowg_spec]
    if q_seg is not None:
        q_ids, kv_ids, spans = _segment_operands(q_seg, kv_seg, bq=bq, bk=bk, tp=tp, sp=sp, per_query_tile=False)
        operands += [kv_ids, q_ids, spans]
        in_specs += [
            pl.BlockSpec((None, bk), lambda j, hr, b_: (b_, j)),
            pl.BlockSpec((None, tp), lambda j, hr, b_: (b_, 0)),
            pl.BlockSpec((None, None, 2), lambda j, hr, b_: (b_, j, 0)),
        ]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, bq=bq, bk=bk, nq=tp // bq, heads=heads, **common),
        grid=(nk, hkv * splits, b),
        in_specs=in_specs,
        out_specs=[out_spec, out_spec],
        out_shape=[out_shape, out_shape],
        compiler_params=_params(cfg["bwd_launch"]),
        interpret=cfg["interpret"],
        name="flash_attention_dkv",
    )(*operands)
    if splits > 1:
        dk, dv = dk.sum(0).astype(k.dtype), dv.sum(0).astype(v.dtype)
    return dq, dk[:, :s], dv[:, :s]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, q_seg, kv_seg, cfg):
    return _forward(q, k, v, q_seg, kv_seg, dict(cfg))[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, cfg):
    o, lse = _forward(q, k, v, q_seg, kv_seg, dict(cfg))
    return o, (q, k, v, q_seg, kv_seg, o, lse)


def _attention_bwd(cfg, res, do):
    return *_backward(*res, do, dict(cfg)), None, None  # integer segment ids take no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def _tile(block: int, length: int) -> int:
    # Triton tiles must be powers of two, and tl.dot needs at least 16 rows; never exceed the data.
    return max(16, min(pl.next_power_of_2(block), pl.next_power_of_2(length)))


def flash_attention_gpu(
    q,
    k,
    v,
    *,
    causal: bool,
    scale: float,
    q_offset: int,
    block_sizes,
    interpret: bool = False,
    segment_ids=None,
    kv_segment_ids=None,
):
    """q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D]. Arguments already validated by the API; segment ids are int32
    [B,T] and [B,S] (both or neither).

    Each kernel zero-pads T and S to multiples of its own tiles (padded keys are masked by length, padded
    query rows are sliced off and get zero cotangents), and D is padded to a power of two here (zero
    columns change no dot product).
    """
    t, d = q.shape[1], q.shape[3]
    s = k.shape[1]
    bs = block_sizes
    dp = max(16, pl.next_power_of_2(d))
    cfg = (
        ("scale", float(scale)),
        ("causal", bool(causal)),
        ("q_offset", int(q_offset)),
        ("fwd", (_tile(bs.block_q, t), _tile(bs.block_k, s))),
        ("dq", tuple(_tile(x, n) for x, n in zip(bs.dq, (t, s)))),
        ("dkv", tuple(_tile(x, n) for x, n in zip(bs.dkv, (t, s)))),
        ("fwd_launch", (bs.num_warps, bs.num_stages)),
        ("bwd_launch", bs.bwd_launch),
        ("interpret", bool(interpret)),
    )
    q_, k_, v_ = (pad_axis(x, 3, dp) for x in (q, k, v))
    return _attention(q_, k_, v_, segment_ids, kv_segment_ids, cfg)[..., :d]
