"""Building blocks of the decoder: RMSNorm, rotary embeddings, SwiGLU MLP, and parameter initialisers.

Every parameter carries logical axis names (``out_sharding`` metadata, not applied eagerly); the training code
maps them to mesh axes through one table of rules (``hydrahead_jax.sharding_rules``). Names used here:
``vocab``, ``embed`` (model width), ``heads`` (query heads x head_dim, flattened), ``kv_heads`` (KV heads x
head_dim), ``mlp`` (MLP width), ``head_dim``, ``norm`` (never sharded).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param_init(init, axes: tuple[str | None, ...]):
    """Wrap an initializer so the Param records its logical axis names (sharding is applied later, by the mesh)."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)


def dense(
    in_features: int,
    out_features: int,
    axes: tuple[str | None, str | None],
    *,
    rngs: nnx.Rngs,
    param_dtype,
    dtype,
    use_bias: bool = False,
    init_scale: float = 1.0,
) -> nnx.Linear:
    """A Linear whose kernel is [in, out] (the transpose of a torch weight) with logical axes ``axes``."""
    init = nnx.initializers.variance_scaling(init_scale, "fan_in", "truncated_normal")
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=param_init(init, axes),
        bias_init=param_init(nnx.initializers.zeros_init(), (axes[1],)),
        rngs=rngs,
    )


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean_c x_c² + eps) over the last axis, in float32 (returns float32).

    The one RMS normalisation of the code base: the decoder's RMSNorm, the HydraHead fusion and the Gated DeltaNet
    output gate all scale this by their own weights.
    """
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x²) + eps) · w, computed in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32, axis_name: str = "norm"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(axis_name,), eager_sharding=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        return (rms_normalize(x, self.eps) * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float) -> jax.Array:
    """inv_freq_i = θ^(−2i/d) for i < d/2 (float32)."""
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float, interleaved: bool) -> jax.Array:
    """Rotate x [B, T, H, D] by angle p·inv_freq_i on each of the D/2 coordinate pairs.

    Half-split (Hugging Face) pairs coordinate i with i + D/2; interleaved (llama.cpp / GGUF) pairs 2i with 2i+1.
    Both compute (a, b) → (a cos − b sin, a sin + b cos); they differ only in which coordinates form a pair.
    """
    d = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(d, theta)  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if interleaved:
        a, b = x32[..., 0::2], x32[..., 1::2]
        out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)
    else:
        a, b = x32[..., : d // 2], x32[..., d // 2 :]
        out = jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) ⊙ up(x))."""

    def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, param_dtype, dtype):
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.gate_proj = dense(hidden, intermediate, ("embed", "mlp"), **kw)
        self.up_proj = dense(hidden, intermediate, ("embed", "mlp"), **kw)
        self.down_proj = dense(intermediate, hidden, ("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
