"""Google's splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) behind ``flash_attention``.

Splash is the TPU kernel maintained with JAX: it masks only the tiles a mask cuts (whole visible tiles skip the
mask, whole hidden ones are skipped by its block-sparse schedule) and keeps lse and segment ids lane-dense. This
module adapts our call to it:

  out[b] = splash(scale · q[b]ᵀ, k[b]ᵀ, v[b]ᵀ)   per batch row (``jax.vmap``), [H, T, D] head-major layout,

with GQA native to splash's multi-head kernel (query head h reads KV head h // G, our convention), the causal
mask ``CausalMask(offset=q_offset)`` (query i sees key j ≤ i + q_offset) and packed documents as splash's
``SegmentIds``. Splash has no logit scale: q is scaled before the call (in q's dtype), so the gradient of q comes
back through that product.

What splash does not cover (:func:`splash_unsupported` says which, ``auto`` then picks our kernel):
  * lengths that are not multiples of 128 (splash tiles are whole multiples of the 128-lane width; our kernel
    pads ragged lengths);
  * key segment ids of their own (``kv_segment_ids`` given: context parallelism's rotated keys, a chunk of queries
    continuing a cached prefix), where a query can have no visible key at all — splash requires every row of the
    mask to see a key (its softmax would divide by 0), our kernel outputs 0 there;
  * head dims that are not a multiple of 128 (the lane width; splash's tiles keep the head dim whole);
  * half-precision inputs under a global ``jax_default_matmul_precision`` above the default ("highest", ...):
    splash's dots take that precision and Mosaic cannot legalise an fp32 contract precision on bf16 operands (our
    kernel pins DEFAULT precision for half-precision dots, whose products are exact on the MXU anyway).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_LANES = 128
_TILES = (512, 256, 128)
_HALF_PRECISION_OK = (
    "none",
    "default",
    "bfloat16",
    "fastest",
)  # global settings that leave bf16 dots at DEFAULT  # largest first: splash's per-step overhead favours big tiles where the length allows


def splash_unsupported(q, k, *, kv_segment_ids_given: bool) -> str | None:
    """Why splash cannot compute this call (a sentence naming the fix), or None when it can."""
    t, s, d = q.shape[1], k.shape[1], q.shape[-1]
    if t % _LANES or s % _LANES:
        return f"query/key lengths {t}/{s} are not multiples of {_LANES} (pad them, or use implementation='pallas')"
    if d % _LANES:
        return f"head dim {d} is not a multiple of {_LANES} (use implementation='pallas')"
    precision = jax.config.jax_default_matmul_precision
    if q.dtype.itemsize < 4 and str(precision).lower() not in _HALF_PRECISION_OK:
        return (
            f"jax_default_matmul_precision={precision!r} with {q.dtype} inputs: Mosaic cannot compile splash's dots "
            "at that precision (set it to 'default' around the call, or use implementation='pallas')"
        )
    if kv_segment_ids_given:
        return (
            "kv_segment_ids of their own can leave a query with no visible key, which splash cannot compute "
            "(use implementation='pallas')"
        )
    return None


def _tile(n: int) -> int:
    return next(b for b in _TILES if n % b == 0)


@functools.lru_cache(maxsize=64)
def _kernel(t: int, s: int, hq: int, causal: bool, q_offset: int, interpret: bool):
    """A splash kernel for one (lengths, heads, mask) shape; built once (its mask schedule is computed in numpy)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    one = sm.CausalMask((t, s), offset=q_offset) if causal else sm.FullMask((t, s))
    bq, bk = _tile(t), _tile(s)
    blocks = sk.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    return sk.make_splash_mha(
        sm.MultiHeadMask([one] * hq), block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def flash_attention_splash(q, k, v, *, causal: bool, scale: float, q_offset: int, segment_ids=None, interpret=False):
    """Splash attention on [B, T, Hq, D] / [B, S, Hkv, D] inputs (checked by the caller, see splash_unsupported);
    ``segment_ids`` [B, T] apply to queries and keys alike (S == T). Returns [B, T, Hq, D] in q.dtype."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, hq, _ = q.shape
    kernel = _kernel(t, k.shape[1], hq, bool(causal), int(q_offset) if causal else 0, bool(interpret))
    heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, T, H, D] -> [B, H, T, D]
    qs = heads_major((q.astype(jnp.float32) * scale).astype(q.dtype))
    ks, vs = heads_major(k), heads_major(v)
    if segment_ids is None:
        out = jax.vmap(kernel)(qs, ks, vs)
    else:
        ids = segment_ids.astype(jnp.int32)
        out = jax.vmap(lambda q, k, v, i: kernel(q, k, v, segment_ids=sk.SegmentIds(q=i, kv=i)))(qs, ks, vs, ids)
    return heads_major(out).astype(q.dtype)
