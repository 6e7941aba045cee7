"""Models: the decoder (teacher and student skeleton), checkpoint loading, tokenizer, generation."""

from hydrahead_jax.models.attention import Attention
from hydrahead_jax.models.generate import generate
from hydrahead_jax.models.transformer import Transformer, load_hf_weights


def load_pretrained(source: str, dtype: str = "float32"):
    """(model, tokenizer) from "smollm2-135m", a .gguf file, or a local Hugging Face folder."""
    from hydrahead_jax.models.pretrained import load_pretrained as _load

    return _load(source, dtype=dtype)


__all__ = ["Attention", "Transformer", "generate", "load_hf_weights", "load_pretrained"]
