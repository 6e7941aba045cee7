"""Typed, validated configuration of the decoder that serves as teacher and as every student's skeleton."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPE_NAMES = tuple(_DTYPES)


class ConfigError(ValueError):
    """A configuration that cannot describe a working model; the message names the field and the fix."""


ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling, as transformers' ``modeling_rope_utils`` defines each ``rope_type``.

    With inv_freq_i = θ^(−2i/d) (i < d/2), L0 = ``original_max_position_embeddings`` (the pre-training length) and
    L = max(positions) + 1 of the current call:

        linear    inv_i / factor                                          (position interpolation)
        dynamic   θ' = θ · (factor·max(L, L0)/L0 − (factor − 1))^(d/(d−2)), inv_i = θ'^(−2i/d)   (NTK by length)
        yarn      inv_i · ((1 − r_i)/factor + r_i), r_i = 1 − clamp((i − lo)/(hi − lo), 0, 1), where lo, hi are the
                  dims turning beta_fast / beta_slow times over L0; cos/sin are scaled by the attention factor
                  (default 0.1·ln(factor) + 1, or the mscale / mscale_all_dim ratio)
        llama3    wavelength λ_i = 2π/inv_i: λ_i < L0/high_freq_factor keeps inv_i, λ_i > L0/low_freq_factor takes
                  inv_i/factor, and in between (1 − s)·inv_i/factor + s·inv_i, s = (L0/λ_i − low)/(high − low)
        longrope  inv_i / e_i with e = long_factor when L > L0, else short_factor; cos/sin scaled by the attention
                  factor (default sqrt(1 + ln(factor)/ln(L0)))

    ``original_max_position_embeddings`` None means the model's ``max_position_embeddings`` (transformers' default);
    ``ModelConfig`` fills it in. A dynamic scaling takes L0 = the model's ``max_position_embeddings``, as
    transformers does. The attention factor multiplies cos and sin, so it scales every score by its square.
    """

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None  # yarn, longrope: None derives it from factor (see above)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: floor/ceil the correction range
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    short_factor: tuple[float, ...] | None = None  # longrope, d/2 values
    long_factor: tuple[float, ...] | None = None  # longrope, d/2 values

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"RoPE scaling type {self.rope_type!r} is not supported; choose one of {ROPE_TYPES} "
                "(or no scaling for plain RoPE)."
            )
        for field in ("short_factor", "long_factor"):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, tuple(float(x) for x in value))
        if not self.factor > 0:
            raise ConfigError(f"RopeScaling.factor must be > 0, got {self.factor}.")
        if self.original_max_position_embeddings is not None and self.original_max_position_embeddings <= 0:
            raise ConfigError(
                f"RopeScaling.original_max_position_embeddings must be positive, got "
                f"{self.original_max_position_embeddings}."
            )
        if self.rope_type == "llama3" and (self.low_freq_factor is None or self.high_freq_factor is None):
            raise ConfigError("a llama3 RoPE scaling needs low_freq_factor and high_freq_factor (Llama-3.1: 1 and 4).")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                f"llama3 RoPE scaling: high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}."
            )
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ConfigError("a longrope RoPE scaling needs short_factor and long_factor (head_dim/2 values each).")

    def resolved_attention_factor(self) -> float:
        """The factor cos and sin are multiplied by (1 for linear, dynamic and llama3)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.rope_type == "yarn":

            def mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if self.mscale and self.mscale_all_dim:
                return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
            return mscale(self.factor)
        if self.rope_type == "longrope" and self.factor > 1:
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        return 1.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RopeScaling:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"Unknown RopeScaling fields {unknown}; valid fields are {sorted(known)}.")
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama / Qwen2 / Qwen3 style decoder.

    Attention is grouped-query: ``num_heads`` query heads share ``num_kv_heads`` key/value heads, query head
    ``h`` reading KV head ``h // (num_heads // num_kv_heads)`` (the Hugging Face ``repeat_kv`` convention). A
    *KV group* is one KV head with its query heads; HydraHead splits attention at that granularity.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    architecture: str = "llama"
    rope_theta: float = 10000.0
    # False: Hugging Face half-split rotary layout (x[:d/2], x[d/2:]); True: interleaved pairs (x[0::2], x[1::2]),
    # the layout llama.cpp's GGUF files store Q/K rows in.
    rope_interleaved: bool = False
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head before RoPE.
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections.
    max_position_embeddings: int = 32768
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype of activations; softmax, norms and GDN state stay in float32.
    name: str = "custom"

    def __post_init__(self):
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{field} must be a positive integer, got {value!r}.")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}: "
                "grouped-query attention needs every KV head to serve the same number of query heads."
            )
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.head_dim} must be even for rotary embeddings.")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"ModelConfig.architecture={self.architecture!r} is not supported; "
                f"choose one of {SUPPORTED_ARCHITECTURES}."
            )
        for field in ("param_dtype", "dtype"):
            if getattr(self, field) not in _DTYPES:
                raise ConfigError(f"ModelConfig.{field}={getattr(self, field)!r}; choose one of {tuple(_DTYPES)}.")
        if not self.rope_theta > 0:
            raise ConfigError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}.")
        self._check_rope_scaling()
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}.")

    def _check_rope_scaling(self) -> None:
        """Accept a dict (from JSON) for ``rope_scaling``, fill its pre-training length, and check its shape."""
        scaling = self.rope_scaling
        if scaling is None:
            return
        if isinstance(scaling, dict):
            scaling = RopeScaling.from_dict(scaling)
        if not isinstance(scaling, RopeScaling):
            raise ConfigError(f"ModelConfig.rope_scaling must be a RopeScaling, a dict or None; got {scaling!r}.")
        if scaling.rope_type == "dynamic" or scaling.original_max_position_embeddings is None:
            # transformers: dynamic NTK scales relative to max_position_embeddings; the others default to it.
            scaling = dataclasses.replace(scaling, original_max_position_embeddings=self.max_position_embeddings)
        if scaling.rope_type == "longrope":
            for field in ("short_factor", "long_factor"):
                if len(getattr(scaling, field)) != self.head_dim // 2:
                    raise ConfigError(
                        f"longrope {field} has {len(getattr(scaling, field))} values; head_dim={self.head_dim} "
                        f"needs {self.head_dim // 2}."
                    )
        object.__setattr__(self, "rope_scaling", scaling)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field; ``rope_scaling`` only when set, so a plain-RoPE config reads as it did before scaling
        existed (run fingerprints and exported ``model_config.json`` files stay valid)."""
        out = dataclasses.asdict(self)
        if out["rope_scaling"] is None:
            del out["rope_scaling"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"Unknown ModelConfig fields {unknown}; valid fields are {sorted(known)}.")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


EXTENSION_TYPES = ("linear", "dynamic", "yarn")


def parse_rope_extension(spec: str) -> tuple[str, float, int | None]:
    """``"TYPE:FACTOR[:ORIGINAL_LENGTH]"`` (e.g. ``"yarn:4"``, ``"yarn:4:8192"``) → (type, factor, length or None).

    The context-extension setting of the long stage; raises ConfigError with the accepted form."""
    parts = spec.split(":")
    form = "TYPE:FACTOR[:ORIGINAL_LENGTH] with TYPE in " + "/".join(EXTENSION_TYPES) + ", e.g. yarn:4"
    if len(parts) not in (2, 3) or parts[0] not in EXTENSION_TYPES:
        raise ConfigError(f"RoPE extension {spec!r}: write {form}.")
    try:
        factor = float(parts[1])
        original = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise ConfigError(
            f"RoPE extension {spec!r}: the factor must be a number and the length an integer ({form})."
        ) from None
    if not factor > 1 or (original is not None and original <= 0):
        raise ConfigError(f"RoPE extension {spec!r}: the factor must be > 1 and the length positive ({form}).")
    return parts[0], factor, original


def with_rope_extension(cfg: ModelConfig, spec: str) -> ModelConfig:
    """``cfg`` with its positions extended by ``spec`` (``parse_rope_extension``) for long-context training.

    yarn / linear scale from the original length L0 (default: ``cfg.max_position_embeddings``) to factor·L0, which
    becomes the new ``max_position_embeddings``; dynamic NTK scales relative to ``max_position_embeddings`` itself.
    A config that already carries a RoPE scaling is refused: two scalings do not compose."""
    kind, factor, original = parse_rope_extension(spec)
    if cfg.rope_scaling is not None:
        raise ConfigError(
            f"RoPE extension {spec!r}: the model already uses RoPE scaling {cfg.rope_scaling.rope_type!r} "
            f"(factor {cfg.rope_scaling.factor}); extending on top of it is not supported. Fix: no stage-3 extension."
        )
    original = original or cfg.max_position_embeddings
    if kind == "dynamic":
        return cfg.replace(rope_scaling=RopeScaling("dynamic", factor=factor), max_position_embeddings=original)
    return cfg.replace(
        rope_scaling=RopeScaling(kind, factor=factor, original_max_position_embeddings=original),
        max_position_embeddings=int(round(original * factor)),
    )
