"""Shared pieces of every flash-attention backend: argument checks, block sizes, masking constants.

Notation used throughout the package (layout is batch, time, heads, dim):
  q [B, T, Hq, D], k/v [B, S, Hkv, D], G = Hq // Hkv query heads per KV head (query head h reads
  KV head h // G, the HF `repeat_kv` convention). Causal: query i sees key j iff j <= i + q_offset.
  Packed documents: with segment ids q_seg [B, T] and kv_seg [B, S], query i of row b sees key j only
  if also q_seg[b, i] == kv_seg[b, j].
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

# A large finite negative instead of -inf: exp(MASK - m) underflows to exactly 0 but never produces
# NaN from (-inf) - (-inf) when a whole block of a row is masked.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def has_visible_key(m):
    """Rows whose running score max ``m`` came from a visible key (not from MASK_VALUE or the -inf start).

    Only segment ids can leave a query with no visible key (causally every query sees key 0); such a row must
    output 0, not the mean of the masked values that exp(MASK_VALUE - MASK_VALUE) = 1 would average.
    """
    return m > 0.5 * MASK_VALUE


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the blockwise / Pallas attention kernels.

    block_q, block_k: forward tiles along queries and keys. The *_dq and *_dkv fields are the tiles of
    the two backward kernels (None = use the forward tiles). num_warps / num_stages only matter for the
    Pallas Triton (GPU) lowering: those of the forward kernel, and *_bwd those of the two backward kernels
    (None = the forward's value; both None = Pallas' defaults, 4 warps and 3 stages).
    """

    block_q: int = 128
    block_k: int = 128
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    num_warps_bwd: int | None = None
    num_stages_bwd: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if val is not None and (not isinstance(val, int) or val <= 0):
                raise ValueError(f"BlockSizes.{f.name} must be a positive int or None, got {val!r}")

    @property
    def dq(self) -> tuple[int, int]:
        return (self.block_q_dq or self.block_q, self.block_k_dq or self.block_k)

    @property
    def dkv(self) -> tuple[int, int]:
        return (self.block_q_dkv or self.block_q, self.block_k_dkv or self.block_k)

    @property
    def bwd_launch(self) -> tuple[int | None, int | None]:
        """(num_warps, num_stages) of the backward kernels."""
        return (self.num_warps_bwd or self.num_warps, self.num_stages_bwd or self.num_stages)

    @classmethod
    def default(cls, backend: str, head_dim: int = 128, dtype=jnp.bfloat16) -> BlockSizes:
        """Per-backend defaults: 'xla' (blockwise XLA), 'gpu' (Pallas Triton, per head dim and input dtype),
        'tpu' (Pallas Mosaic)."""
        if backend == "xla":
            # Big tiles: XLA's per-iteration overhead dominates small ones; 512x512xHq fp32 scores stay small.
            return cls(block_q=512, block_k=512)
        if backend == "gpu":
            bucket = min(d for d in (64, 128, 256) if d >= min(head_dim, 256))
            return cls(**dict(zip(_GPU_FIELDS, _GPU_DEFAULTS[bucket, jnp.dtype(dtype).itemsize >= 4])))
        if backend == "tpu":
            # Multiples of the (8, 128) vreg tile; 512-wide tiles keep the MXU busy and VMEM well within limits.
            return cls(block_q=512, block_k=512, block_q_dq=256, block_k_dq=512, block_q_dkv=256, block_k_dkv=512)
        raise ValueError(f"unknown backend {backend!r}; expected 'xla', 'gpu' or 'tpu'")


# Pallas Triton tiles per (head dim up to 64 / 128 / 256, 4-byte inputs), FlashAttention-2 style: a tall query tile
# in the forward (the [bq, D] f32 accumulator lives in registers while K/V tiles stream through num_stages
# shared-memory buffers), square-ish tiles in the backward (dk/dv holds two [bk, D] f32 accumulators). f32 inputs
# double every shared-memory buffer, hence fewer stages and narrower tiles. Each row keeps every kernel within the
# H200's 232,448 B of shared memory per block (tests/test_compile_tier.py checks it; bench/RESULTS.md has the
# table), bf16 without register spills (f32 at d=128 spills a few hundred bytes in the backward).
_GPU_FIELDS = (
    "block_q",
    "block_k",
    "block_q_dq",
    "block_k_dq",
    "block_q_dkv",
    "block_k_dkv",
    "num_warps",
    "num_stages",
    "num_warps_bwd",
    "num_stages_bwd",
)
_GPU_DEFAULTS = {
    #           fwd q, k  dq q, k  dkv q, k  fwd warps, stages  bwd warps, stages
    (64, False): (128, 64, 64, 64, 64, 64, 8, 3, 4, 2),
    (64, True): (128, 64, 64, 32, 64, 32, 8, 3, 4, 2),
    (128, False): (128, 64, 64, 64, 64, 64, 8, 3, 8, 2),
    (128, True): (128, 64, 32, 64, 64, 64, 8, 2, 8, 2),
    (256, False): (64, 64, 32, 32, 32, 32, 8, 2, 8, 2),
    (256, True): (64, 32, 32, 32, 32, 32, 8, 2, 8, 1),
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def pad_axis(x, axis: int, size: int):
    """``x`` zero-padded at the end of ``axis`` to ``size`` (``x`` itself when already that long)."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def check_inputs(q, k, v, *, causal: bool, scale, q_offset):
    """Validates shapes/dtypes; returns (scale: float, q_offset: int) resolved to their defaults.

    scale defaults to 1/sqrt(D); q_offset defaults to S - T when causal (the T queries are the LAST T
    of the S key positions, as in KV-cache prefill-continuation or decode) and is unused otherwise.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, time, heads, head_dim], got shape {getattr(x, 'shape', None)}"
            )
    (b, t, hq, d), (bk, s, hkv, dk) = q.shape, k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    if bk != b:
        raise ValueError(f"batch mismatch: q has batch {b}, k/v have {bk}")
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has D={d}, k/v have D={dk}; project them to the same size")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if t == 0 or s == 0:
        raise ValueError(f"empty sequence: T={t}, S={s}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not causal:
        return scale, 0
    q_offset = s - t if q_offset is None else int(q_offset)
    if q_offset < 0:
        raise ValueError(
            f"causal attention with q_offset={q_offset} (T={t}, S={s}) would leave query 0 with no key to "
            "attend to; pass q_offset >= 0 (queries are positions q_offset..q_offset+T-1 of the keys)"
        )
    return scale, q_offset


def check_segment_ids(segment_ids, kv_segment_ids, *, batch: int, q_len: int, kv_len: int):
    """Validates packed-document segment ids; returns (q_seg [B, T], kv_seg [B, S]) as int32, or (None, None).

    kv_segment_ids defaults to segment_ids when the queries and keys are the same positions (S == T).
    """
    if segment_ids is None:
        if kv_segment_ids is not None:
            raise ValueError(
                "kv_segment_ids given without segment_ids: pass segment_ids [batch, q_len] for the queries too "
                "(or neither, for no document masking)"
            )
        return None, None
    if kv_segment_ids is None:
        if kv_len != q_len:
            raise ValueError(
                f"segment_ids cover the {q_len} queries but there are {kv_len} keys: pass kv_segment_ids "
                f"[batch, {kv_len}] with the segment of every key"
            )
        kv_segment_ids = segment_ids
    out = []
    for name, ids, length, what in (
        ("segment_ids", segment_ids, q_len, "T (queries)"),
        ("kv_segment_ids", kv_segment_ids, kv_len, "S (keys)"),
    ):
        shape, dtype = getattr(ids, "shape", None), getattr(ids, "dtype", None)
        if shape != (batch, length):
            raise ValueError(f"{name} must have shape [batch, {what}] = {(batch, length)}, got {shape}")
        if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array (one id per document), got dtype {dtype}")
        out.append(jnp.asarray(ids, jnp.int32))
    return tuple(out)


def segment_tile_ranges(seg, block: int, padded_len: int):
    """(min, max) segment id of each tile of ``block`` positions: two int32 [B, padded_len // block].

    The tail is padded with the row's last id (edge padding), which widens no tile's range; padded positions
    are masked by length or sliced off by the kernels, so their ids never decide a result.
    """
    pad = padded_len - seg.shape[1]
    tiles = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge").reshape(seg.shape[0], -1, block)
    return tiles.min(-1), tiles.max(-1)


def segment_tile_spans(q_seg, kv_seg, *, bq: int, bk: int, tp: int, sp: int):
    """For query tiles of bq rows and key tiles of bk (T padded to tp, S to sp), two pairs of int32 arrays:

      k_lo, k_hi [B, tp/bq]: key tiles [k_lo, k_hi) hold every key tile whose segment range meets query tile i's;
      q_lo, q_hi [B, sp/bk]: query tiles [q_lo, q_hi) hold every query tile whose range meets key tile j's.

    A tile pair outside these spans has disjoint [min, max] ranges, so no query and key of the same segment: it
    can be skipped for any ids. For sorted ids (packed rows) the ranges meet on a contiguous run of tiles, so the
    spans are exactly the tiles that need computing. An empty span is returned as [0, 0).
    """
    q_min, q_max = segment_tile_ranges(q_seg, bq, tp)
    k_min, k_max = segment_tile_ranges(kv_seg, bk, sp)
    meets = (q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None])  # [B, nq, nk]

    def span(hit):  # first and one-past-last True along the last axis; [0, 0) when none
        n = hit.shape[-1]
        lo = jnp.argmax(hit, axis=-1)
        hi = n - jnp.argmax(hit[..., ::-1], axis=-1)
        some = hit.any(-1)
        return jnp.where(some, lo, 0).astype(jnp.int32), jnp.where(some, hi, 0).astype(jnp.int32)

    k_lo, k_hi = span(meets)
    q_lo, q_hi = span(meets.swapaxes(1, 2))
    return (k_lo, k_hi), (q_lo, q_hi)
