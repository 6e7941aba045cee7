"""Independent reference models for tests: tiny random transformers (torch) checkpoints, built offline.

    folder = save_tiny_hf_model(tmp_path / "llama", "llama")        # config.json + safetensors + tokenizer.json
    ref = torch_logits(folder, ids)                                  # [B, T, V] float32 numpy, from transformers

Every model is seeded and its weights are redrawn at a scale where logits are O(1..10) (the transformers init,
std 0.02, gives logits so small that any loader bug would hide under the tolerance). Other areas reuse these
helpers, so keep them free of hydrahead_jax imports: the oracle must not share code with what it checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never reach for the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
# Untied for Llama and Qwen2, tied for Qwen3, so both embedding paths are exercised by the parity tests.
TINY_VARIANTS = {
    "llama": dict(cls="LlamaForCausalLM", rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(cls="Qwen2ForCausalLM", rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3": dict(cls="Qwen3ForCausalLM", rope_theta=1000000.0, tie_word_embeddings=True),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! 0123456789 (x + y) * z = 42; def f(a, b): return a - b\n"
)


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE `tokenizers.Tokenizer` (256 byte symbols + a few merges + ChatML specials), deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TOKENIZER_TEXT] * 20, trainer=trainer)
    return tok


def _redraw_weights(model, seed: int) -> None:
    """Seeded weights at a scale that makes logits informative: linear ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1²)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1:  # RMSNorm gains and biases
                base = 0.0 if name.endswith("bias") else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))


def build_tiny_hf_model(arch: str, seed: int = 0, vocab_size: int | None = None, **overrides):
    """A tiny random float32 transformers causal LM of ``arch`` ("llama", "qwen2", "qwen3"), in eval mode."""
    import torch
    import transformers

    if arch not in TINY_VARIANTS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(TINY_VARIANTS)}")
    variant = dict(TINY_VARIANTS[arch])
    cls = getattr(transformers, variant.pop("cls"))
    kwargs = dict(
        TINY,
        **variant,
        vocab_size=vocab_size or tiny_tokenizer().get_vocab_size(),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    config = cls.config_class(**kwargs)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    _redraw_weights(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def save_tiny_hf_model(
    folder: str | os.PathLike, arch: str, *, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """Build a tiny model and save it as a Hugging Face folder (safetensors, tokenizer.json); returns the folder.

    ``max_shard_size`` (e.g. "40KB") forces a sharded save with ``model.safetensors.index.json``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    model = build_tiny_hf_model(arch, seed=seed, vocab_size=tok.get_vocab_size(), **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    return folder


# Llama 3's RoPE scaling at the tiny models' scale (original context 64 of their 256 positions).
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
# Llama 3's tokenizer.json, in miniature: its pre-tokenizer split, its specials after the BPE vocabulary (128000 and up
# in the real one) and its post-processor, which puts <|begin_of_text|> before every sequence (add_special_tokens=True).
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama-3.1's tokenizer_config.json sets no add_bos_token: transformers keeps tokenizer.json's post-processor.
LLAMA3_TOKENIZER_CONFIG = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "clean_up_tokenization_spaces": True,
    "model_max_length": 131072,
    "tokenizer_class": "PreTrainedTokenizerFast",
}


def llama3_tokenizer(vocab_size: int = 300):
    """A byte-level BPE `tokenizers.Tokenizer` laid out as Llama 3's: Split(its regex) + ByteLevel, the two
    specials last, and the post-processor Sequence[ByteLevel, TemplateProcessing('<|begin_of_text|> $A')]."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(LLAMA3_SPECIALS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TOKENIZER_TEXT] * 20, trainer=trainer)
    tok.add_special_tokens(list(LLAMA3_SPECIALS))
    bos = LLAMA3_SPECIALS[0]
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, tok.token_to_id(bos))],
            ),
        ]
    )
    return tok


def save_tiny_llama3_model(
    folder: str | os.PathLike, *, seed: int = 0, tokenizer_config: dict | None = None, **overrides
) -> Path:
    """A tiny Llama-3.x-style folder: LlamaForCausalLM with llama3 RoPE scaling, ``llama3_tokenizer``, and
    ``LLAMA3_TOKENIZER_CONFIG`` updated with ``tokenizer_config``; ``overrides`` go to the model config."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = llama3_tokenizer()
    bos, eos = (tok.token_to_id(t) for t in LLAMA3_SPECIALS)
    rope = dict(LLAMA3_ROPE, rope_theta=5e5)
    kwargs = dict(rope_parameters=rope, bos_token_id=bos, eos_token_id=eos, pad_token_id=None, **overrides)
    model = build_tiny_hf_model("llama", seed=seed, vocab_size=tok.get_vocab_size(), **kwargs)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**LLAMA3_TOKENIZER_CONFIG, **(tokenizer_config or {})}))
    return folder


def write_llama3_gguf(path: str | os.PathLike, folder: str | os.PathLike, *, add_bos_token: bool | None) -> Path:
    """The folder of ``save_tiny_llama3_model`` as a GGUF, with the tokenizer metadata llama.cpp's converter writes
    for Llama 3 (``tokenizer.ggml.pre`` "llama-bpe", control-typed specials, ``add_bos_token``; None: the key
    left out)."""
    import gguf

    vocab = json.loads((Path(folder) / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(vocab["vocab"].items(), key=lambda kv: kv[1])] + list(LLAMA3_SPECIALS)
    merges = [m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(LLAMA3_SPECIALS)) + [gguf.TokenType.CONTROL] * 2

    def metadata(w):
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(tokens.index(LLAMA3_SPECIALS[0]))
        w.add_eos_token_id(tokens.index(LLAMA3_SPECIALS[1]))
        if add_bos_token is not None:
            w.add_add_bos_token(add_bos_token)

    return write_tiny_gguf(path, load_torch_model(folder), "llama", tokens=tokens, extra_metadata=metadata)


def torch_logits(folder_or_model, input_ids, *, gguf_file: str | None = None) -> np.ndarray:
    """Logits [B, T, V] (float32 numpy) of transformers' own implementation for ``input_ids`` [B, T].

    ``folder_or_model``: a loaded torch model, a Hugging Face folder, or (with ``gguf_file``) the folder holding
    that GGUF file, which transformers dequantises itself.
    """
    model = (
        folder_or_model
        if not isinstance(folder_or_model, (str, os.PathLike))
        else load_torch_model(folder_or_model, gguf_file=gguf_file)
    )
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(input_ids), dtype=torch.long))
    return out.logits.float().numpy()


def load_torch_model(folder: str | os.PathLike, *, gguf_file: str | None = None):
    """transformers' float32 eager-attention model from a folder (or a GGUF file inside it)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()


def load_torch_tokenizer(folder: str | os.PathLike, *, gguf_file: str | None = None):
    """transformers' tokenizer for a folder (or one rebuilt by transformers from a GGUF file's metadata)."""
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(str(folder), **kwargs)


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama Q/K rows (HF half-split → interleaved-pair RoPE)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_tiny_gguf(
    path: str | os.PathLike, model, arch: str, tokens: list[str] | None = None, extra_metadata=None
) -> Path:
    """Write a transformers model as an F32 GGUF the way llama.cpp's converter lays it out.

    Names follow llama.cpp (``blk.{i}.attn_q.weight`` ...); Llama's Q/K rows are permuted for interleaved RoPE
    (Qwen2/Qwen3 are not, as in the converter). ``arch`` is written verbatim, so an unsupported one can be made.
    ``extra_metadata(writer)`` may add keys or tensors (e.g. rope scaling) before the file is written.
    """
    import gguf

    cfg = model.config
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = p.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj" and kind == "weight":
                value = llamacpp_permute(value, cfg.num_attention_heads)
            if arch == "llama" and module == "self_attn.k_proj" and kind == "weight":
                value = llamacpp_permute(value, cfg.num_key_value_heads)
        w.add_tensor(gname, value)
    if extra_metadata is not None:
        extra_metadata(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


REQUIRE_ORACLES = "HYDRAHEAD_REQUIRE_ORACLES"  # set by `make test`: there the dev extras are installed


def import_oracle(module: str):
    """``module`` (torch, a transformers module: an external oracle), imported. Where it is missing the test is
    skipped, except when $HYDRAHEAD_REQUIRE_ORACLES is set (`make test`, whose environment has the dev extras):
    there a missing oracle fails the test instead of passing it off as a skip."""
    import importlib

    import pytest

    try:
        return importlib.import_module(module)
    except ImportError as err:
        if os.environ.get(REQUIRE_ORACLES):
            pytest.fail(f"the oracle {module!r} does not import ({err}); install the dev extras (make install-dev)")
        pytest.skip(f"{module} is not installed (the dev extras): this oracle comparison cannot run")
