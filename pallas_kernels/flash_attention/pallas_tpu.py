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

Segment ids (packed documents) arrive as (bq, 1) query tiles and (1, bk) key tiles (the mask is their
broadcast comparison, (bq, 1) == (1, bk)), plus six int32 vectors of scalar prefetch (SMEM) computed by XLA
before the call: each query tile's and key tile's [min, max] id and, per program tile, the span of tiles of the
other side whose ranges meet it (_common.segment_tile_spans). A grid step runs only if its tile pair's ranges
meet (correct for any ids; for sorted ids that is exactly the pairs sharing a document), and the index maps
clamp the streamed tiles into the span, so the pipeline fetches nothing outside it. A query with no visible key
outputs 0. Without ids the kernels and grids are exactly those above.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_attention._common import (
    MASK_VALUE,
    has_visible_key,
    pad_axis,
    round_up,
    segment_tile_ranges,
    segment_tile_spans,
)

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ
_TN = (((0,), (0,)), ((), ()))  # aᵀ @ b
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _dot(a, b, dims=_NN):
    """fp32-accumulated a·b. Half-precision operands run at DEFAULT precision whatever the global setting: their
    products are exact on the MXU already, and Mosaic cannot legalise an fp32 contract precision on bf16 operands
    (``jax_default_matmul_precision="highest"`` would otherwise make the kernel fail to compile). fp32 operands
    follow the global setting."""
    precision = lax.Precision.DEFAULT if a.dtype.itemsize < 4 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


def _visible(i, j, bq, bk, *, causal, q_offset, kv_len, seg_refs=None):
    """[bq, bk] mask of query tile i vs key tile j (2-D iotas: Mosaic has no 1-D vector layout); with segment
    ids seg_refs = (query ids [bq, 1], key ids [1, bk]) adds their equality."""
    k_pos = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    ok = k_pos < kv_len
    if causal:
        q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        ok = ok & (k_pos <= q_pos + q_offset)
    if seg_refs is not None:
        ok = ok & (seg_refs[0][...] == seg_refs[1][...])
    return ok


class _Segments:
    """Scalar-prefetch refs of one kernel with segment ids: q_min, q_max [B·nq], k_min, k_max [B·nk] (the id range
    of each query / key tile) and lo, hi (per program tile, the span of the other side's tiles that meet it)."""

    def __init__(self, refs, *, nq, nk):
        self.q_min, self.q_max, self.k_min, self.k_max, self.lo, self.hi = refs
        self.nq, self.nk = nq, nk

    def meet(self, b, i, j):
        """Query tile i and key tile j of row b hold intersecting id ranges (else no pair can be visible)."""
        qi, kj = b * self.nq + i, b * self.nk + j
        return (self.q_min[qi] <= self.k_max[kj]) & (self.k_min[kj] <= self.q_max[qi])

    def clamp(self, x, b, t, n):
        """Tile index x clamped into the span of program tile t (of n per row): streamed tiles never leave it."""
        lo, hi = self.lo[b * n + t], self.hi[b * n + t]
        return jnp.minimum(jnp.maximum(x, lo), jnp.maximum(hi - 1, lo))


def _segment_prefetch(q_seg, kv_seg, *, bq, bk, tp, sp, per_query_tile: bool):
    """The six scalar-prefetch vectors of _Segments and the padded id operands: [B, tp, 1], and [B, sp/bk, 1, bk] so
    that a key tile's (1, bk) block spans its array's last two dims whatever bk is (Mosaic's block rule)."""
    (q_min, q_max), (k_min, k_max) = segment_tile_ranges(q_seg, bq, tp), segment_tile_ranges(kv_seg, bk, sp)
    spans = segment_tile_spans(q_seg, kv_seg, bq=bq, bk=bk, tp=tp, sp=sp)[0 if per_query_tile else 1]
    prefetch = [x.reshape(-1) for x in (q_min, q_max, k_min, k_max, *spans)]
    kv_ids = pad_axis(kv_seg, 1, sp).reshape(kv_seg.shape[0], sp // bk, 1, bk)
    return prefetch, [pad_axis(q_seg, 1, tp)[:, :, None], kv_ids]


def _split_refs(refs, n_in, segmented):
    """(prefetch refs or None, the n_in usual inputs, the id tiles or None, the rest: outputs and scratch)."""
    if not segmented:
        return None, refs[:n_in], None, refs[n_in:]
    return refs[:6], refs[6 : 6 + n_in], refs[6 + n_in : 8 + n_in], refs[8 + n_in :]


def _last_k_tile(i, *, bq, bk, nk, causal, q_offset):
    """Index of the last key tile query tile i needs."""
    if not causal:
        return nk - 1
    return jnp.minimum((i * bq + bq - 1 + q_offset) // bk, nk - 1)


def _first_q_tile(j, *, bq, bk, causal, q_offset):
    if not causal:
        return 0
    return jnp.maximum(j * bk - q_offset, 0) // bq


def _fwd_kernel(*refs, scale, causal, q_offset, kv_len, bq, bk, nq, nk, segmented):
    pf, (q_ref, k_ref, v_ref), seg_refs, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _split_refs(refs, 3, segmented)
    i, j = pl.program_id(2), pl.program_id(3)
    run = j <= _last_k_tile(i, bq=bq, bk=bk, nk=nk, causal=causal, q_offset=q_offset)
    if segmented:
        run = run & _Segments(pf, nq=nq, nk=nk).meet(pl.program_id(0), i, j)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, _F32)
        l_sc[...] = jnp.zeros(l_sc.shape, _F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    @pl.when(run)
    def _step():
        s = _dot(q_ref[...], k_ref[...], _NT) * scale
        vis = _visible(i, j, bq, bk, causal=causal, q_offset=q_offset, kv_len=kv_len, seg_refs=seg_refs)
        s = jnp.where(vis, s, MASK_VALUE)
        m_prev = m_sc[...]  # [bq, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = corr * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_sc[...] = corr * acc_sc[...] + _dot(p.astype(v.dtype), v)
        m_sc[...] = m_new

    @pl.when(j == nk - 1)
    def _finish():
        if segmented:  # a query whose segment has no key it may see outputs 0 (l may be 0: never divide by it)
            l = l_sc[...]
            out = jnp.where(has_visible_key(m_sc[...]), acc_sc[...] / jnp.where(l > 0, l, 1.0), 0.0)
            o_ref[...] = out.astype(o_ref.dtype)
        else:
            o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])


def _dq_kernel(*refs, scale, causal, q_offset, kv_len, bq, bk, nq, nk, segmented):
    pf, ins, seg_refs, (dq_ref, dq_sc) = _split_refs(refs, 6, segmented)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    i, j = pl.program_id(2), pl.program_id(3)
    run = j <= _last_k_tile(i, bq=bq, bk=bk, nk=nk, causal=causal, q_offset=q_offset)
    if segmented:
        run = run & _Segments(pf, nq=nq, nk=nk).meet(pl.program_id(0), i, j)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, _F32)

    @pl.when(run)
    def _step():
        k = k_ref[...]
        s = _dot(q_ref[...], k, _NT) * scale
        vis = _visible(i, j, bq, bk, causal=causal, q_offset=q_offset, kv_len=kv_len, seg_refs=seg_refs)
        p = jnp.where(vis, jnp.exp(s - lse_ref[...]), 0.0)
        dp = _dot(do_ref[...], v_ref[...], _NT)
        ds = p * (dp - delta_ref[...])
        dq_sc[...] += _dot(ds.astype(k.dtype), k)

    @pl.when(j == nk - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, scale, causal, q_offset, kv_len, bq, bk, nq, nk, groups, segmented):
    pf, ins, seg_refs, (dk_ref, dv_ref, dk_sc, dv_sc) = _split_refs(refs, 6, segmented)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    run = i >= _first_q_tile(j, bq=bq, bk=bk, causal=causal, q_offset=q_offset)
    if segmented:
        run = run & _Segments(pf, nq=nq, nk=nk).meet(pl.program_id(0), i, j)

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, _F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, _F32)

    @pl.when(run)
    def _step():
        q, do = q_ref[...], do_ref[...]
        s = _dot(q, k_ref[...], _NT) * scale
        vis = _visible(i, j, bq, bk, causal=causal, q_offset=q_offset, kv_len=kv_len, seg_refs=seg_refs)
        p = jnp.where(vis, jnp.exp(s - lse_ref[...]), 0.0)  # [bq, bk]
        dv_sc[...] += _dot(p.astype(do.dtype), do, _TN)
        dp = _dot(do, v_ref[...], _NT)
        ds = p * (dp - delta_ref[...])
        dk_sc[...] += _dot(ds.astype(q.dtype), q, _TN)

    @pl.when((g == groups - 1) & (i == nq - 1))
    def _finish():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _params(n_parallel: int, n_arbitrary: int):
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_parallel + ("arbitrary",) * n_arbitrary)


def _pallas_call(kernel, *, prefetch, grid, in_specs, out_specs, scratch_shapes, **kwargs):
    """pl.pallas_call with a plain grid, or (segment ids) with the scalar-prefetch operands placed first."""
    if not prefetch:
        return pl.pallas_call(
            kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch_shapes, **kwargs
        )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch_shapes,
    )
    return functools.partial(pl.pallas_call(kernel, grid_spec=grid_spec, **kwargs), *prefetch)


def _forward(q, k, v, q_seg, kv_seg, cfg):
    """q [B,Hq,T,D], k/v [B,Hkv,S,D], ids [B,T] / [B,S] or None -> (o like q, lse [B,Hq,T,1] fp32); T and S padded
    to this pass's tiles."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    groups = hq // hkv
    bq, bk = cfg["fwd"]
    tp, sp = round_up(t, bq), round_up(s, bk)
    nq, nk = tp // bq, sp // bk
    segmented = q_seg is not None
    last = functools.partial(_last_k_tile, bq=bq, bk=bk, nk=nk, causal=cfg["causal"], q_offset=cfg["q_offset"])

    def kv_tile(b_, i, j, pf):  # the key tile streamed at step j: never past the causal end nor out of the span
        j = jnp.minimum(j, last(i))
        return _Segments(pf, nq=nq, nk=nk).clamp(j, b_, i, nq) if pf else j

    q_spec = pl.BlockSpec((None, None, bq, d), lambda b_, h, i, j, *pf: (b_, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b_, h, i, j, *pf: (b_, h // groups, kv_tile(b_, i, j, pf), 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b_, h, i, j, *pf: (b_, h, i, 0))
    in_specs, operands = [q_spec, kv_spec, kv_spec], [pad_axis(q, 2, tp), pad_axis(k, 2, sp), pad_axis(v, 2, sp)]
    prefetch = []
    if segmented:
        prefetch, ids = _segment_prefetch(q_seg, kv_seg, bq=bq, bk=bk, tp=tp, sp=sp, per_query_tile=True)
        operands += ids
        in_specs += [
            pl.BlockSpec((None, bq, 1), lambda b_, h, i, j, *pf: (b_, i, 0)),
            pl.BlockSpec((None, None, 1, bk), lambda b_, h, i, j, *pf: (b_, kv_tile(b_, i, j, pf), 0, 0)),
        ]
    kernel = functools.partial(
        _fwd_kernel,
        scale=cfg["scale"],
        causal=cfg["causal"],
        q_offset=cfg["q_offset"],
        kv_len=s,
        bq=bq,
        bk=bk,
        nq=nq,
        nk=nk,
        segmented=segmented,
    )
    o, lse = _pallas_call(
        kernel,
        prefetch=prefetch,
        grid=(b, hq, nq, nk),
        in_specs=in_specs,
        out_specs=[q_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((b, hq, tp, d), q.dtype), jax.ShapeDtypeStruct((b, hq, tp, 1), _F32)],
        scratch_shapes=[pltpu.VMEM((bq, 1), _F32), pltpu.VMEM((bq, 1), _F32), pltpu.VMEM((bq, d), _F32)],
        compiler_params=_params(3, 1),
        interpret=cfg["interpret"],
        name="flash_attention_fwd",
    )(*operands)
    return o[:, :, :t], lse[:, :, :t]


def _padded(q, k, v, do, lse, delta, *, tp, sp):
    """The backward kernels' operands with queries padded to tp rows and keys to sp."""
    return [pad_axis(q, 2, tp), pad_axis(k, 2, sp), pad_axis(v, 2, sp), *(pad_axis(x, 2, tp) for x in (do, lse, delta))]


def _backward(q, k, v, q_seg, kv_seg, o, lse, do, cfg):
    """Unpadded q/o/do [B,Hq,T,D], k/v [B,Hkv,S,D], lse [B,Hq,T,1]; each kernel pads T and S to its own tiles."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    groups = hq // hkv
    segmented = q_seg is not None
    common = dict(scale=cfg["scale"], causal=cfg["causal"], q_offset=cfg["q_offset"], kv_len=s, segmented=segmented)
    delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1, keepdims=True)  # [B,Hq,T,1]
    # Padded query rows have q = dO = 0 and Δ = lse = 0, so they add nothing to any gradient.

    bq, bk = cfg["dq"]
    tp, sp = round_up(t, bq), round_up(s, bk)
    nq, nk = tp // bq, sp // bk
    last = functools.partial(_last_k_tile, bq=bq, bk=bk, nk=nk, causal=cfg["causal"], q_offset=cfg["q_offset"])

    def kv_tile(b_, i, j, pf):
        j = jnp.minimum(j, last(i))
        return _Segments(pf, nq=nq, nk=nk).clamp(j, b_, i, nq) if pf else j

    q_spec = pl.BlockSpec((None, None, bq, d), lambda b_, h, i, j, *pf: (b_, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b_, h, i, j, *pf: (b_, h // groups, kv_tile(b_, i, j, pf), 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b_, h, i, j, *pf: (b_, h, i, 0))
    in_specs, operands = (
        [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        _padded(q, k, v, do, lse, delta, tp=tp, sp=sp),
    )
    prefetch = []
    if segmented:
        prefetch, ids = _segment_prefetch(q_seg, kv_seg, bq=bq, bk=bk, tp=tp, sp=sp, per_query_tile=True)
        operands += ids
        in_specs += [
            pl.BlockSpec((None, bq, 1), lambda b_, h, i, j, *pf: (b_, i, 0)),
            pl.BlockSpec((None, None, 1, bk), lambda b_, h, i, j, *pf: (b_, kv_tile(b_, i, j, pf), 0, 0)),
        ]
    dq = _pallas_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, nq=nq, nk=nk, **common),
        prefetch=prefetch,
        grid=(b, hq, nq, nk),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((b, hq, tp, d), q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, d), _F32)],
        compiler_params=_params(3, 1),
        interpret=cfg["interpret"],
        name="flash_attention_dq",
    )(*operands)[:, :, :t]

    bq, bk = cfg["dkv"]
    tp, sp = round_up(t, bq), round_up(s, bk)
    nq, nk = tp // bq, sp // bk
    first = functools.partial(_first_q_tile, bq=bq, bk=bk, causal=cfg["causal"], q_offset=cfg["q_offset"])

    def q_tile(b_, j, i, pf):  # the query tile streamed at step i: never before the causal start nor out of the span
        i = jnp.maximum(i, first(j))
        return _Segments(pf, nq=nq, nk=nk).clamp(i, b_, j, nk) if pf else i

    qg_spec = pl.BlockSpec(
        (None, None, bq, d), lambda b_, h, j, g, i, *pf: (b_, h * groups + g, q_tile(b_, j, i, pf), 0)
    )
    rowg_spec = pl.BlockSpec(
        (None, None, bq, 1), lambda b_, h, j, g, i, *pf: (b_, h * groups + g, q_tile(b_, j, i, pf), 0)
    )
    k_spec = pl.BlockSpec((None, None, bk, d), lambda b_, h, j, g, i, *pf: (b_, h, j, 0))
    in_specs, operands = (
        [qg_spec, k_spec, k_spec, qg_spec, rowg_spec, rowg_spec],
        _padded(q, k, v, do, lse, delta, tp=tp, sp=sp),
    )
    prefetch = []
    if segmented:
        prefetch, ids = _segment_prefetch(q_seg, kv_seg, bq=bq, bk=bk, tp=tp, sp=sp, per_query_tile=False)
        operands += ids
        in_specs += [
            pl.BlockSpec((None, bq, 1), lambda b_, h, j, g, i, *pf: (b_, q_tile(b_, j, i, pf), 0)),
            pl.BlockSpec((None, None, 1, bk), lambda b_, h, j, g, i, *pf: (b_, j, 0, 0)),
        ]
    dk, dv = _pallas_call(
        functools.partial(_dkv_kernel, bq=bq, bk=bk, nq=nq, nk=nk, groups=groups, **common),
        prefetch=prefetch,
        grid=(b, hkv, nk, groups, nq),
        in_specs=in_specs,
        out_specs=[k_spec, k_spec],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, sp, d), k.dtype), jax.ShapeDtypeStruct((b, hkv, sp, d), v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, d), _F32), pltpu.VMEM((bk, d), _F32)],
        compiler_params=_params(3, 2),
        interpret=cfg["interpret"],
        name="flash_attention_dkv",
    )(*operands)
    return dq, dk[:, :, :s], dv[:, :, :s]


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
    if block % 8:
        raise ValueError(f"TPU block sizes must be multiples of 8 (sublane tiling), got {block}")
    return min(block, round_up(length, 8))


def flash_attention_tpu(
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
    return _attention(q_, k_, v_, segment_ids, kv_segment_ids, cfg).transpose(0, 2, 1, 3)
