"""Public entry point: `chunk_gated_delta_rule` (training / prefill) and `gated_delta_rule_step` (decode).

Same semantics and argument names as flash-linear-attention's `chunk_gated_delta_rule`, so results
can be compared directly; see reference.py for the recurrence.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.dispatch import IMPLEMENTATIONS, platform_of, resolve

from . import reference as _reference
from . import xla as _xla
from .step import gated_delta_rule_step

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_step", "IMPLEMENTATIONS"]


def _check(q, k, v, g, beta, initial_state, chunk_size, scale, segment_ids):
    def fail(msg):
        raise ValueError(f"chunk_gated_delta_rule: {msg}")

    if q.ndim != 4:
        fail(f"q must be [batch, time, heads, key_dim]; got shape {q.shape}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        fail(f"k must have q's shape {q.shape}; got {k.shape}")
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        fail(f"v must be [batch, time, heads, value_dim] with (B,T,H)={(B, T, H)}; got {v.shape}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H):
            fail(
                f"{name} must be [batch, time, heads]={(B, T, H)}; got {x.shape}"
                + (" (drop the trailing singleton axis)" if x.shape == (B, T, H, 1) else "")
            )
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            fail(f"{name} must be floating point; got {x.dtype}")
    if initial_state is not None:
        if initial_state.shape != (B, H, K, v.shape[-1]):
            fail(f"initial_state must be [B,H,K,V]={(B, H, K, v.shape[-1])}; got {initial_state.shape}")
        if not jnp.issubdtype(initial_state.dtype, jnp.floating):
            fail(f"initial_state must be floating point (fp32 recommended); got {initial_state.dtype}")
    if not isinstance(chunk_size, int) or chunk_size < 16 or chunk_size & (chunk_size - 1):
        fail(f"chunk_size must be a power of two >= 16 (Pallas/Triton block shapes); got {chunk_size!r}")
    if scale is not None and not isinstance(scale, (int, float)):
        fail(f"scale must be a Python float or None (default key_dim**-0.5); got {type(scale).__name__}")
    if T == 0:
        fail("the time axis is empty")
    if segment_ids is not None:
        if getattr(segment_ids, "shape", None) != (B, T):
            fail(
                f"segment_ids must be [batch, time]={(B, T)} (one id per token); got {getattr(segment_ids, 'shape', None)}"
            )
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            fail(f"segment_ids must be integer (int32 document ids); got {segment_ids.dtype}")


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm=False,
    chunk_size=64,
    segment_ids=None,
    implementation="auto",
):
    """Gated delta rule over a whole sequence (chunked, differentiable).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log decay (≤ 0); beta: [B, T, H] in (0, 1).
      scale: multiplies q (default K**-0.5). initial_state: [B, H, K, V] (kept in fp32).
      output_final_state: also return the state after the last token. use_qk_l2norm: L2-normalise
      q and k over K first (in fp32, eps 1e-6 inside the sqrt, as FLA). chunk_size: power of two ≥ 16.
      segment_ids: [B, T] int (packed documents) or None. A document starts wherever segment_ids[b, t] ≠
      segment_ids[b, t−1]; the state restarts from zero there, so each document's outputs are those of running it
      alone (the row's first document starts from initial_state), and final_state is the last document's. No
      gradient flows to them. (Like FLA's `cu_seqlens`, with static shapes.)
      implementation: "auto" (Pallas on GPU/TPU, XLA elsewhere), "xla", "pallas" (this platform's
      kernel; interpret mode on CPU), "pallas_gpu", "pallas_tpu", "reference" (token scan).
    Returns:
      (o [B, T, H, V] in q.dtype, final_state [B, H, K, V] fp32 or None).
    """
    name, interpret = resolve("chunk_gated_delta_rule", implementation, platform_of(q))
    _check(q, k, v, g, beta, initial_state, chunk_size, scale, segment_ids)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kw = dict(
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
        segment_ids=segment_ids,
    )
    if name == "reference":
        return _reference.naive_gated_delta_rule(q, k, v, g, beta, **kw)
    if name == "xla":
        return _xla.chunk_gated_delta_rule_xla(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    if name == "pallas_gpu":
        from .pallas_gpu import chunk_gated_delta_rule_pallas_gpu as fn
    else:
        from .pallas_tpu import chunk_gated_delta_rule_pallas_tpu as fn
    return fn(q, k, v, g, beta, chunk_size=chunk_size, interpret=interpret, **kw)
