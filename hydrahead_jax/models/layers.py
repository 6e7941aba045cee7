"""Building blocks of the decoder: RMSNorm, rotary embeddings, SwiGLU MLP, and parameter initialisers.

Every parameter carries logical axis names (``out_sharding`` metadata, not applied eagerly); the training code
maps them to mesh axes through one table of rules (``hydrahead_jax.sharding_rules``). Names used here:
``vocab``, ``embed`` (model width), ``heads`` (query heads x head_dim, flattened), ``kv_heads`` (KV heads x
head_dim), ``mlp`` (MLP width), ``head_dim``, ``norm`` (never sharded).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from hydrahead_jax.config import RopeScaling


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


def scaled_rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, seq_len: jax.Array | int | None = None
) -> tuple[jax.Array, float]:
    """(inv_freq [D/2] float32, attention factor) of plain RoPE or of a ``RopeScaling`` (its docstring has the
    equations of each type, transformers' definitions).

    ``seq_len`` (L, may be traced) matters only to ``dynamic`` and ``longrope``; None means L ≤ L0.
    """
    if scaling is None:
        return rope_frequencies(head_dim, theta), 1.0
    kind, factor, l0 = scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim  # 2i/d
    inv_freq = rope_frequencies(head_dim, theta)
    if kind == "linear":
        inv_freq = inv_freq / factor
    elif kind == "dynamic":
        length = jnp.maximum(jnp.asarray(l0 if seq_len is None else seq_len, jnp.float32), l0)
        base = theta * (factor * length / l0 - (factor - 1)) ** (head_dim / (head_dim - 2))
        inv_freq = 1.0 / (base**exponents)
    elif kind == "yarn":

        def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in L0
            return head_dim * math.log(l0 / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
        if scaling.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001  # transformers' guard against a zero-width ramp
        ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - lo) / (hi - lo), 0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequencies, unchanged); 0: interpolate (divide by factor)
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
    elif kind == "llama3":
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelength > l0 / low, inv_freq / factor, inv_freq)
        smooth = (l0 / wavelength - low) / (high - low)
        medium = (wavelength >= l0 / high) & (wavelength <= l0 / low)
        inv_freq = jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind == "longrope":
        short = jnp.asarray(scaling.short_factor, jnp.float32)
        long = jnp.asarray(scaling.long_factor, jnp.float32)
        ext = short if seq_len is None else jnp.where(jnp.asarray(seq_len) > l0, long, short)
        inv_freq = 1.0 / (ext * theta**exponents)
    else:  # RopeScaling refuses other types; this guards a new type added there but not here
        raise ValueError(f"no RoPE frequencies for rope_type {kind!r}")
    return inv_freq, scaling.resolved_attention_factor()


def apply_rope(
    x: jax.Array, positions: jax.Array, *, theta: float, interleaved: bool, scaling: RopeScaling | None = None
) -> jax.Array:
    """Rotate x [B, T, H, D] by angle p·inv_freq_i on each of the D/2 coordinate pairs, times the attention factor.

    Half-split (Hugging Face) pairs coordinate i with i + D/2; interleaved (llama.cpp / GGUF) pairs 2i with 2i+1.
    Both compute (a, b) → m·(a cos − b sin, a sin + b cos); they differ only in which coordinates form a pair.
    inv_freq and m come from ``scaled_rope_frequencies`` (m = 1 and θ^(−2i/d) for plain RoPE); its length L is
    max(positions) + 1 of this call, as in transformers, so a decode step under ``dynamic`` rotates its token for the
    length so far while the cached keys keep the rotation they were written with.
    """
    d = x.shape[-1]
    seq_len = None
    if scaling is not None and scaling.rope_type in ("dynamic", "longrope"):
        seq_len = jnp.max(positions) + 1
    inv_freq, attention_factor = scaled_rope_frequencies(d, theta, scaling, seq_len)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :] * attention_factor
    sin = jnp.sin(angles)[:, :, None, :] * attention_factor
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
