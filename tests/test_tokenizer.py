"""Tokenizers against transformers: SmolLM2 rebuilt from GGUF metadata, and a folder's tokenizer.json."""

import json

import oracle
import pytest

from hydrahead_jax.models.loaders import CheckpointError, resolve_source
from hydrahead_jax.models.tokenizer import load_tokenizer

MIXED = [
    "The year 2024 had 366 days; π ≈ 3.14159 and 1,000,000 > 999999.",
    "Héllo wörld, naïve café — déjà vu, Ångström, Øre, ß, İstanbul.",
    "emoji 😀🚀👍🏽 family 👨‍👩‍👧 flags 🇫🇷 ok",
    "中文字符和日本語のテキスト、한국어 텍스트도 있어요。",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    "def f(x):\n\treturn x**2  # square\n\n\nclass A:\n    pass\n",
    "   many    spaces   \n\n\n  \t tabs\r\n end   ",
    "<repo_name>hydra/head<file_sep>main.py<filename>x",
    "It's we'll I'M can't they've 'quoted' \"double\"",
    "",
    " ",
    "a<|im_start|>b",
]


@pytest.fixture(scope="module")
def smol():
    path = resolve_source("smollm2-135m")
    return load_tokenizer("smollm2-135m"), oracle.load_torch_tokenizer(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", MIXED)
def test_ids_match_transformers_and_round_trip(smol, text):
    ours, ref = smol
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_metadata(smol):
    ours, ref = smol
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]
    assert ours.encode("12345") == [ref.convert_tokens_to_ids(c) for c in "12345"]  # individual digits
    assert (ours.bos_id, ours.eos_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert ours.vocab_size == len(ref) == 49152
    assert ours.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"
    assert ours.encode_batch(MIXED) == [ref.encode(t, add_special_tokens=False) for t in MIXED]


def test_fingerprint_is_stable_and_discriminating(smol, tmp_path):
    ours, _ = smol
    again = load_tokenizer(resolve_source("smollm2-135m"))
    assert len(ours.fingerprint) == 64 and int(ours.fingerprint, 16) >= 0
    assert ours.fingerprint == again.fingerprint
    folder = oracle.save_tiny_hf_model(tmp_path / "tiny", "llama")
    assert load_tokenizer(folder).fingerprint != ours.fingerprint


# SmolLM2's fingerprint before documents had a start (commit bf98cd9): its token stores' names, and the demo's
# figures through them, must not move.
SMOLLM2_FINGERPRINT = "f7682e6743fcad6bde624fd01de1bd1f1f408f979feb54afbe6f9f1f9f33634a"


def test_smollm2_documents_have_no_bos_as_in_transformers(smol):
    """The bundled GGUF says tokenizer.ggml.add_bos_token = false: a document is its text's ids, as transformers'
    add_special_tokens=True gives them, and the fingerprint is the one the existing token stores carry."""
    ours, ref = smol
    assert ours.document_start == ()
    for text in MIXED:
        assert ours.encode_document(text) == ref.encode(text, add_special_tokens=True) == ours.encode(text), text
    assert ours.fingerprint == SMOLLM2_FINGERPRINT


# Qwen2.5's tokenizer files in their BOS-relevant parts: a ByteLevel post-processor and no BOS token.
QWEN_POST_PROCESSOR = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
QWEN_TOKENIZER_CONFIG = {
    "add_bos_token": False,
    "bos_token": None,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "tokenizer_class": "Qwen2Tokenizer",
}


@pytest.mark.parametrize("files", ["qwen2.5", "plain"])
def test_qwen_documents_have_no_bos_as_in_transformers(tmp_path, files):
    """Qwen2/3 add no BOS: with Qwen2.5's post-processor and tokenizer_config.json, and with the plain tiny
    folder (no post-processor), a document's ids are transformers' add_special_tokens=True ids, BOS-free."""
    folder = oracle.save_tiny_hf_model(tmp_path / "tiny", "qwen2")
    if files == "qwen2.5":
        spec = json.loads((folder / "tokenizer.json").read_text())
        (folder / "tokenizer.json").write_text(json.dumps({**spec, "post_processor": QWEN_POST_PROCESSOR}))
        (folder / "tokenizer_config.json").write_text(json.dumps(QWEN_TOKENIZER_CONFIG))
    ours, ref = load_tokenizer(folder), oracle.load_torch_tokenizer(folder)
    assert ours.document_start == ()
    for text in MIXED:
        assert ours.encode_document(text) == ref.encode(text, add_special_tokens=True) == ours.encode(text), text


def test_chat_template_matches_transformers(smol):
    ours, ref = smol
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    text = ours.apply_chat_template(messages)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_folder_tokenizer_matches_transformers(tmp_path):
    folder = oracle.save_tiny_hf_model(tmp_path / "tiny", "qwen2")
    ours, ref = load_tokenizer(folder), oracle.load_torch_tokenizer(folder)
    for text in MIXED:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == text
    assert (ours.bos_id, ours.eos_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert ours.vocab_size == len(ref) == 300


def test_folder_without_tokenizer_json(tmp_path):
    folder = oracle.save_tiny_hf_model(tmp_path / "tiny", "llama")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tiny: tokenizer\.json is missing"):
        load_tokenizer(folder)


def test_gguf_without_bpe_tokenizer(tmp_path):
    model = oracle.build_tiny_hf_model("llama", vocab_size=300)
    path = oracle.write_tiny_gguf(tmp_path / "notok.gguf", model, "llama")
    with pytest.raises(CheckpointError, match=r"notok\.gguf: GGUF tokenizer model '<absent>' is not supported"):
        load_tokenizer(path)
