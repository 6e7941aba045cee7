"""Typed, validated configuration of the decoder that serves as teacher and as every student's skeleton."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPE_NAMES = tuple(_DTYPES)


class ConfigError(ValueError):
    """A configuration that cannot describe a working model; the message names the field and the fix."""


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
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}.")

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
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"Unknown ModelConfig fields {unknown}; valid fields are {sorted(known)}.")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)
