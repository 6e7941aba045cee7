"""Public entry point: `flash_attention(q, k, v, ...)` dispatching to a reference, XLA or Pallas backend."""

from __future__ import annotations

from pallas_kernels.dispatch import check_implementation, implementations, platform_of, resolve
from pallas_kernels.flash_attention._common import BlockSizes, check_inputs, check_segment_ids
from pallas_kernels.flash_attention.cudnn import cudnn_unsupported
from pallas_kernels.flash_attention.splash import splash_unsupported

IMPLEMENTATIONS = implementations("flash_attention")

__all__ = ["IMPLEMENTATIONS", "flash_attention"]


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_offset: int | None = None,
    segment_ids=None,
    kv_segment_ids=None,
    implementation: str = "auto",
    block_sizes: BlockSizes | None = None,
):
    """Multi-head / grouped-query attention without materialising the [T, S] score matrix.

    out[b, i, h] = Σ_{j visible} softmax_j(scale · q[b,i,h]·k[b,j,h//G]) v[b,j,h//G]  (softmax in fp32)

    Key j is visible to query i iff (not causal or j <= i + q_offset) and, with segment ids,
    segment_ids[b, i] == kv_segment_ids[b, j] (packed documents attend only within themselves).

    Args:
      q: [B, T, Hq, D] queries. k, v: [B, S, Hkv, D]; Hq must be a multiple of Hkv (G = Hq // Hkv;
        query head h uses KV head h // G).
      causal: query i attends keys j <= i + q_offset only.
      scale: logit scale, default 1/sqrt(D).
      q_offset: position of query 0 among the keys; default S - T (the queries are the last T key
        positions: prefill continuation / decode). Must be >= 0. Ignored when not causal.
      segment_ids: optional [B, T] integer segment (document) id of each query; any int32 values, sorted or
        not (packed rows: 1, 2, ... per document, 0 for padding). A query with no visible key at all (only
        possible non-causal or with kv_segment_ids) gets output 0 and zero gradients.
      kv_segment_ids: optional [B, S] segment id of each key; defaults to segment_ids when S == T (required
        otherwise, e.g. a chunk of queries continuing a cached prefix). Needs segment_ids. The Pallas kernels
        skip every (query tile, key tile) pair whose segment ranges do not meet.
      implementation: "auto" (on a TPU splash where it covers the call, else our Mosaic kernel; on a GPU cuDNN
        where it covers the call, else our Triton kernel; "xla" on CPU), "xla" (blockwise XLA), "pallas" (the
        Pallas kernel of this platform; interpret mode on CPU), "pallas_gpu", "pallas_tpu" (a specific kernel of
        ours; interpret mode on CPU), "splash" (Google's splash attention TPU kernel, see flash_attention.splash
        for what it covers; interpret mode on CPU), "cudnn" (NVIDIA's cuDNN fused attention, GPU only, see
        flash_attention.cudnn for what it covers), or "reference" (materialises the scores; for testing).
      block_sizes: BlockSizes; default per backend and head dim (BlockSizes.default). Not used by splash
        (its tiles follow the lengths).
    Returns:
      [B, T, Hq, D] in q.dtype. Differentiable (recomputing backward) for every implementation.
    """
    check_implementation("flash_attention", implementation)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    scale, q_offset = check_inputs(q, k, v, causal=causal, scale=scale, q_offset=q_offset)
    q_seg, kv_seg = check_segment_ids(
        segment_ids, kv_segment_ids, batch=q.shape[0], q_len=q.shape[1], kv_len=k.shape[1]
    )
    segments = {} if q_seg is None else dict(segment_ids=q_seg, kv_segment_ids=kv_seg)

    requested = implementation
    implementation, interpret = resolve("flash_attention", implementation, platform_of(q))
    if implementation in ("pallas_tpu", "splash"):
        # kv_segment_ids passed as the very array of segment_ids is the self-attention case splash covers.
        why_not = splash_unsupported(
            q, k, kv_segment_ids_given=not (kv_segment_ids is None or kv_segment_ids is segment_ids)
        )
        if implementation == "splash" and why_not:
            raise ValueError(f"flash_attention(implementation='splash'): {why_not}")
        if requested == "auto" and why_not is None:
            implementation = "splash"
    if implementation == "cudnn" or (requested == "auto" and implementation == "pallas_gpu"):
        why_not = cudnn_unsupported(q, k, causal=causal, q_offset=q_offset, segments_given=q_seg is not None)
        if implementation == "cudnn" and why_not:
            raise ValueError(f"flash_attention(implementation='cudnn'): {why_not}")
        if requested == "auto" and why_not is None:
            implementation = "cudnn"
    if implementation == "cudnn":
        from pallas_kernels.flash_attention.cudnn import flash_attention_cudnn

        return flash_attention_cudnn(q, k, v, causal=causal, scale=scale, q_offset=q_offset)
    if implementation == "splash":
        from pallas_kernels.flash_attention.splash import flash_attention_splash

        return flash_attention_splash(
            q, k, v, causal=causal, scale=scale, q_offset=q_offset, segment_ids=q_seg, interpret=interpret
        )
    if implementation == "reference":
        from pallas_kernels.flash_attention.reference import attention_reference

        return attention_reference(q, k, v, causal=causal, scale=scale, q_offset=q_offset, **segments)
    if implementation == "xla":
        from pallas_kernels.flash_attention.xla import flash_attention_xla

        return flash_attention_xla(
            q,
            k,
            v,
            causal=causal,
            scale=scale,
            q_offset=q_offset,
            block_sizes=block_sizes or BlockSizes.default("xla"),
            **segments,
        )
    native = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}[implementation]
    if native == "gpu":
        from pallas_kernels.flash_attention.pallas_gpu import flash_attention_gpu as kernel
    else:
        from pallas_kernels.flash_attention.pallas_tpu import flash_attention_tpu as kernel
    return kernel(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        q_offset=q_offset,
        block_sizes=block_sizes or BlockSizes.default(native, head_dim=q.shape[-1], dtype=q.dtype),
        interpret=interpret,
        **segments,
    )
