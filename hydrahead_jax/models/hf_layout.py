"""The one table between Hugging Face checkpoints and this decoder: tensor name → our parameter, HF shape, layout.

Checkpoints (HF folders, and GGUF files once renamed) hold torch-layout tensors (linear weights ``[out, in]``):

    model.embed_tokens.weight                         [V, D]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  [out, in]       (+ q/k/v .bias for Qwen2)
    model.layers.{i}.self_attn.{q,k}_norm.weight      [head_dim]      (Qwen3)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight   [out, in]
    model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight   [D]
    lm_head.weight                                    [V, D]          (absent when embeddings are tied)

Our linear kernels are ``[in, out]``: those tensors are transposed on the way in. The decoder's layers are one
stacked module (``Transformer.layers``): tensor ``model.layers.{i}.…`` is slice i of the stacked parameter.
"""

from __future__ import annotations

from typing import NamedTuple

from hydrahead_jax.config import ModelConfig


class HFTensor(NamedTuple):
    path: tuple[str, ...]  # the parameter's path in the model's nnx state
    shape: tuple[int, ...]  # the Hugging Face (torch-layout) shape
    transposed: bool  # the HF tensor is the transpose of our parameter
    layer: int | None = None  # for a layer tensor: its index along the stacked parameter's leading axis


def hf_tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    """Every tensor a Hugging Face checkpoint of ``cfg`` holds, by name."""
    d, hd, f, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    table = {
        "model.embed_tokens.weight": HFTensor(("embed_tokens", "embedding"), (v, d), False),
        "model.norm.weight": HFTensor(("norm", "weight"), (d,), False),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = HFTensor(("lm_head", "kernel"), (v, d), True)
    for i in range(cfg.num_layers):
        attn, mlp = ("layers", "self_attn"), ("layers", "mlp")
        p = f"model.layers.{i}."
        for name, shape in (("q_proj", (q_out, d)), ("k_proj", (kv_out, d)), ("v_proj", (kv_out, d))):
            table[f"{p}self_attn.{name}.weight"] = HFTensor((*attn, name, "kernel"), shape, True, i)
        table[f"{p}self_attn.o_proj.weight"] = HFTensor((*attn, "o_proj", "kernel"), (d, q_out), True, i)
        if cfg.attention_bias:
            for name, size in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                table[f"{p}self_attn.{name}.bias"] = HFTensor((*attn, name, "bias"), (size,), False, i)
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                table[f"{p}self_attn.{name}.weight"] = HFTensor((*attn, name, "weight"), (hd,), False, i)
        for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            table[f"{p}mlp.{name}.weight"] = HFTensor((*mlp, name, "kernel"), shape, True, i)
        for name in ("input_layernorm", "post_attention_layernorm"):
            table[f"{p}{name}.weight"] = HFTensor(("layers", name, "weight"), (d,), False, i)
    return table
