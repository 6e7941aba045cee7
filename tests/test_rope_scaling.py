"""RoPE scaling (linear, dynamic NTK, yarn, llama3, longrope) against transformers, at 5x the pre-training length.

Each case is a tiny random transformers model whose config.json carries the scaling; it is loaded through
``load_pretrained`` and its logits compared with transformers' own at T = 1280 = 5 x L0 (L0 = 256). The decode-cache
path is checked against ``transformers.generate`` with its cache, which for ``dynamic`` rotates each new token for
the length so far while the cached keys keep theirs, as ours does.
"""

import json

import numpy as np
import oracle
import pytest

from hydrahead_jax.config import ConfigError, ModelConfig, RopeScaling
from hydrahead_jax.models.loaders import CheckpointError, read_gguf, read_hf_folder

L0 = 256
LONG = 5 * L0
HEAD_DIM = oracle.TINY["head_dim"]
# transformers-style rope_parameters per type (with max_position_embeddings), chosen so every regime of each type
# is exercised at head_dim 16, theta 1e4: yarn ramps over dims 0..4 of 8, llama3 has high, medium and low bands.
CASES = {
    "linear": (dict(rope_type="linear", factor=4.0), L0),
    "dynamic": (dict(rope_type="dynamic", factor=4.0), L0),
    "yarn": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=L0), 4 * L0),
    "yarn_mscale": (
        dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=L0, mscale=0.7, mscale_all_dim=0.3),
        8 * L0,
    ),
    "llama3": (
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=L0,
        ),
        8 * L0,
    ),
    "longrope": (
        dict(
            rope_type="longrope",
            short_factor=[1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
            long_factor=[1.0 + 0.9 * i for i in range(HEAD_DIM // 2)],
            original_max_position_embeddings=L0,
        ),
        4 * L0,
    ),
}


def _folder(tmp_path_factory, name: str, arch: str = "llama"):
    params, max_len = CASES[name]
    return oracle.save_tiny_hf_model(
        tmp_path_factory.mktemp(name) / arch,
        arch,
        seed=3,
        rope_parameters=dict(params, rope_theta=oracle.TINY_VARIANTS[arch]["rope_theta"]),
        max_position_embeddings=max_len,
    )


def _ids(vocab: int, length: int, batch: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=(batch, length))  # no pad/bos/eos ids


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers_at_5x_context(tmp_path_factory, name):
    from hydrahead_jax.models.pretrained import load_pretrained

    folder = _folder(tmp_path_factory, name)
    ref = oracle.load_torch_model(folder)
    assert ref.model.rotary_emb.rope_type == CASES[name][0]["rope_type"]  # transformers really scales
    model, _ = load_pretrained(folder)
    assert model.cfg.rope_scaling.rope_type == CASES[name][0]["rope_type"]
    ids = _ids(ref.config.vocab_size, LONG)
    expected = oracle.torch_logits(ref, ids)
    got = np.asarray(model(ids))
    # float32 rounding of angles p·inv_freq and of the matmuls differs between torch and XLA; measured max |Δ| 8e-6.
    np.testing.assert_allclose(got, expected, rtol=0, atol=5e-5)
    # The scaling matters at this length: plain RoPE gives other logits.
    plain = oracle.torch_logits(oracle.build_tiny_hf_model("llama", seed=3, vocab_size=ref.config.vocab_size), ids)
    assert np.abs(plain - expected).max() > 0.1


@pytest.mark.parametrize("name", ["dynamic", "yarn", "longrope"])
def test_decode_cache_matches_transformers_generate(tmp_path_factory, name):
    """Prefill past L0, then decode with the cache: each step's logits equal transformers' cached generate."""
    import torch

    from hydrahead_jax.models.generate import generate
    from hydrahead_jax.models.pretrained import load_pretrained

    folder = _folder(tmp_path_factory, name)
    ref = oracle.load_torch_model(folder)
    model, _ = load_pretrained(folder)
    prompt = _ids(ref.config.vocab_size, 4 * L0 + 3, seed=1)
    tokens, logits = generate(model, prompt, 4, return_logits=True)
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=4,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
            pad_token_id=0,
        )
    expected = np.stack([x.float().numpy() for x in out.logits], axis=1)
    np.testing.assert_array_equal(tokens, out.sequences[:, prompt.shape[1] :].numpy())
    # as the prefill comparison above (measured max |Δ| 8e-6 there)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=5e-5)


def test_config_json_forms_read_alike(tmp_path_factory):
    """transformers < 5's rope_theta + rope_scaling {"type": ...} and 5's rope_parameters give one RopeScaling."""
    folder = _folder(tmp_path_factory, "yarn")
    cfg, _ = read_hf_folder(folder)
    hf = json.loads((folder / "config.json").read_text())
    params = hf.pop("rope_parameters")
    hf["rope_theta"] = params.pop("rope_theta")
    hf["rope_scaling"] = dict(params, type=params.pop("rope_type"))
    (folder / "config.json").write_text(json.dumps(hf))
    old_cfg, _ = read_hf_folder(folder)
    assert old_cfg == cfg
    assert cfg.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=L0)
    assert cfg.rope_scaling.resolved_attention_factor() == pytest.approx(0.1 * np.log(4.0) + 1)


def test_unknown_rope_type_is_one_line_error(tmp_path_factory):
    folder = _folder(tmp_path_factory, "linear")
    hf = json.loads((folder / "config.json").read_text())
    hf["rope_parameters"] = {"rope_type": "su", "rope_theta": 1e4, "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"config\.json: rope scaling type 'su' is not supported") as err:
        read_hf_folder(folder)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"'su' is not supported"):
        RopeScaling("su")


def test_bad_scaling_parameters_refused():
    with pytest.raises(ConfigError, match="low_freq_factor and high_freq_factor"):
        RopeScaling("llama3", factor=8.0)
    with pytest.raises(ConfigError, match="short_factor has 3 values; head_dim=16 needs 8"):
        ModelConfig(
            vocab_size=10,
            hidden_size=64,
            intermediate_size=8,
            num_layers=1,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_scaling=RopeScaling("longrope", short_factor=(1, 1, 1), long_factor=(1,) * 8),
        )


def test_scaling_survives_json_round_trip():
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=64,
        intermediate_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=L0,
        rope_scaling=dict(rope_type="yarn", factor=4.0),
    )
    assert cfg.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=L0)
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    hash(cfg)  # configs are static jit arguments


def test_gguf_yarn_metadata(tmp_path_factory, tmp_path):
    """llama.cpp's yarn keys (type, factor, original_context_length) give the same model as the config.json."""
    import gguf

    folder = _folder(tmp_path_factory, "yarn", arch="qwen2")
    ref = oracle.load_torch_model(folder)
    hf_cfg, _ = read_hf_folder(folder)

    def extra(w: gguf.GGUFWriter):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(L0)

    path = oracle.write_tiny_gguf(tmp_path / "m.gguf", ref, "qwen2", extra_metadata=extra)
    cfg, _ = read_gguf(path)
    assert cfg.rope_scaling == hf_cfg.rope_scaling

    def llama3_divisors(w: gguf.GGUFWriter):
        w.add_tensor("rope_freqs.weight", np.ones(HEAD_DIM // 2, np.float32))

    path = oracle.write_tiny_gguf(tmp_path / "l3.gguf", ref, "qwen2", extra_metadata=llama3_divisors)
    with pytest.raises(CheckpointError, match="rope_freqs.weight.*Hugging Face folder"):
        read_gguf(path)
