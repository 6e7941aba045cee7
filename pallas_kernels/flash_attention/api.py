"""Public entry point: `flash_attention(q, k, v, ...)` dispatching to a reference, XLA or Pallas backend."""

from __future__ import annotations

from pallas_kernels.dispatch import IMPLEMENTATIONS, check_implementation, platform_of, resolve
from pallas_kernels.flash_attention._common import BlockSizes, check_inputs

__all__ = ["IMPLEMENTATIONS", "flash_attention"]


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_offset: int | None = None,
    implementation: str = "auto",
    block_sizes: BlockSizes | None = None,
):
    """Multi-head / grouped-query attention without materialising the [T, S] score matrix.

    out[b, i, h] = Σ_j softmax_j(scale · q[b,i,h]·k[b,j,h//G]) v[b,j,h//G]  (softmax in fp32)

    Args:
      q: [B, T, Hq, D] queries. k, v: [B, S, Hkv, D]; Hq must be a multiple of Hkv (G = Hq // Hkv;
        query head h uses KV head h // G).
      causal: query i attends keys j <= i + q_offset only.
      scale: logit scale, default 1/sqrt(D).
      q_offset: position of query 0 among the keys; default S - T (the queries are the last T key
        positions: prefill continuation / decode). Must be >= 0. Ignored when not causal.
      implementation: "auto" (Pallas on GPU/TPU, "xla" on CPU), "xla" (blockwise XLA), "pallas" (the
        Pallas kernel of this platform; interpret mode on CPU), "pallas_gpu", "pallas_tpu" (a specific
        kernel; interpret mode on CPU), or "reference" (materialises the scores; for testing).
      block_sizes: BlockSizes; default per backend and head dim (BlockSizes.default).
    Returns:
      [B, T, Hq, D] in q.dtype. Differentiable (recomputing backward) for every implementation.
    """
    check_implementation("flash_attention", implementation)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    scale, q_offset = check_inputs(q, k, v, causal=causal, scale=scale, q_offset=q_offset)

    implementation, interpret = resolve("flash_attention", implementation, platform_of(q))
    if implementation == "reference":
        from pallas_kernels.flash_attention.reference import attention_reference

        return attention_reference(q, k, v, causal=causal, scale=scale, q_offset=q_offset)
    if implementation == "xla":
        from pallas_kernels.flash_attention.xla import flash_attention_xla

        return flash_attention_xla(
            q, k, v, causal=causal, scale=scale, q_offset=q_offset, block_sizes=block_sizes or BlockSizes.default("xla")
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
    )
