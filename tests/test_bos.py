"""BOS at every document start for teachers whose tokenizer adds one (Llama 3), checked against transformers.

The teacher is a tiny random Llama-3.x-style folder (``oracle.save_tiny_llama3_model``: llama3 RoPE scaling, a
tokenizer.json whose post-processor puts ``<|begin_of_text|>`` first, as Llama 3's does). Every expected id list
comes from transformers' own tokenizer with ``add_special_tokens=True`` on the document, never from our encoder.
SmolLM2 and Qwen, which add no BOS, are checked in test_tokenizer.py.
"""

import json

import numpy as np
import oracle
import pytest

from hydrahead_jax.data import synthetic
from hydrahead_jax.models.tokenizer import load_tokenizer

DOCS = [
    "The quick brown fox jumps over the lazy dog. It's 0123456789 (x + y) * z = 42!",
    "Pack my box with five dozen liquor jugs.\nHow vexingly quick daft zebras jump!",
]
FILLER = " ".join(
    [
        "The river bends twice before it reaches the old mill at the edge of town.",
        "Every morning the baker opens the shop a little before the church bell rings.",
        "A narrow road climbs the hill behind the school and ends at a stone gate.",
        "Children play in the square until the lamps are lit along the harbour wall.",
        "The library keeps its maps in long drawers beside the reading room window.",
    ]
    * 6
)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """(folder, our tokenizer, transformers' tokenizer, BOS id) of the tiny Llama-3 teacher."""
    folder = oracle.save_tiny_llama3_model(tmp_path_factory.mktemp("llama3") / "teacher", seed=3)
    ref = oracle.load_torch_tokenizer(folder)
    return folder, load_tokenizer(folder), ref, ref.convert_tokens_to_ids(oracle.LLAMA3_SPECIALS[0])


def _variant(folder, dst, *, bos_template: bool = True, **tokenizer_config):
    """A copy of the teacher's tokenizer files with ``tokenizer_config`` merged into its tokenizer_config.json and,
    without ``bos_template``, tokenizer.json's post-processor cut to its ByteLevel step (SmolLM2's and Qwen's kind)."""
    dst.mkdir()
    (dst / "config.json").write_bytes((folder / "config.json").read_bytes())
    spec = json.loads((folder / "tokenizer.json").read_text())
    if not bos_template:
        spec["post_processor"] = spec["post_processor"]["processors"][0]
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, **tokenizer_config}))
    return dst


@pytest.mark.parametrize(
    "variant,adds",
    [
        ({}, True),
        ({"add_bos_token": False}, True),  # transformers >= 5 ignores the flag beside a tokenizer.json
        ({"bos_template": False}, False),
        ({"bos_template": False, "add_bos_token": True}, False),
    ],
)
def test_folder_documents_encode_as_transformers_with_special_tokens(llama3, tmp_path, variant, adds):
    """Whether tokenizer.json's post-processor opens a sequence with BOS decides, with or without an add_bos_token
    flag in tokenizer_config.json: a document's ids are transformers' add_special_tokens=True ids."""
    folder, _, _, bos = llama3
    tokenizer = _variant(folder, tmp_path / "tok", **variant)
    ours, ref = load_tokenizer(tokenizer), oracle.load_torch_tokenizer(tokenizer)
    assert ours.document_start == ((bos,) if adds else ())
    for text in [*DOCS, "", " ", "héllo wörld 😀"]:
        assert ours.encode_document(text) == ref.encode(text, add_special_tokens=True), text
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_logits_on_a_bos_document_match_transformers(llama3):
    """Our teacher's logits on transformers' ids of two documents (each opening with BOS) equal torch's."""
    from hydrahead_jax.models.pretrained import load_pretrained

    folder, _, ref_tok, bos = llama3
    ids = np.asarray([ref_tok.encode(d, add_special_tokens=True)[:40] for d in DOCS])
    assert ids.shape == (2, 40) and (ids[:, 0] == bos).all()
    model, tok = load_pretrained(folder)
    assert [tok.encode_document(d)[:40] for d in DOCS] == ids.tolist()
    assert model.cfg.rope_scaling.rope_type == "llama3"
    expected = oracle.torch_logits(oracle.load_torch_model(folder), ids)
    got = np.asarray(model(ids))
    assert np.abs(expected).max() > 1.0  # informative logits
    # measured max |Δ| 3.7e-6 (f32, XLA:CPU, logits up to 4.4 in magnitude): 2e-5 leaves 5x headroom
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("add_bos_token", [True, False, None])
def test_gguf_flag_decides_bos_as_transformers_reads_it(llama3, tmp_path, add_bos_token):
    """A Llama-3 GGUF's tokenizer.ggml.add_bos_token (true in llama.cpp's conversion of Llama 3; absent: none
    added, as transformers reads a byte-level file) gives the ids transformers' GGUF tokenizer gives."""
    folder, _, _, bos = llama3
    path = oracle.write_llama3_gguf(tmp_path / "teacher.gguf", folder, add_bos_token=add_bos_token)
    ours, ref = load_tokenizer(path), oracle.load_torch_tokenizer(tmp_path, gguf_file=path.name)
    assert ours.document_start == ((bos,) if add_bos_token else ())
    for text in DOCS:
        assert ours.encode_document(text) == ref.encode(text, add_special_tokens=True), text


def test_training_row_of_two_documents_has_bos_at_both_starts(llama3, tmp_path):
    """A packed row over two Llama-style documents: each opens with BOS, segment ids and positions restart there,
    and the EOS → BOS step between them is not trained."""
    from hydrahead_jax.data.corpus import CorpusStore, prepare_corpus
    from hydrahead_jax.data.pipeline import PackedWindows

    _, tok, ref, bos = llama3
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    store = CorpusStore(prepare_corpus(tok, source, out_dir=tmp_path / "store", validation_fraction=0.0))
    first, second = (ref.encode(d, add_special_tokens=True) + [ref.eos_token_id] for d in DOCS)
    stream = first + second
    row = PackedWindows(store, len(stream) - 1, seed=0, shuffle=False)[0]
    n1, t = len(first), len(stream) - 1
    assert row["input_ids"].tolist() == stream[:-1] and row["targets"].tolist() == stream[1:]
    assert row["input_ids"][0] == row["input_ids"][n1] == bos
    assert row["segment_ids"].tolist() == [1] * n1 + [2] * (t - n1)
    assert row["positions"].tolist() == list(range(n1)) + list(range(t - n1))
    assert row["loss_mask"][n1 - 1] == 0 and row["loss_mask"].sum() == t - 1


def test_store_identity_tells_bos_from_no_bos(llama3, tmp_path):
    """The same vocabulary with and without BOS tokenises documents differently, so its token stores differ in
    name and one is refused for the other."""
    from hydrahead_jax.data.corpus import TokenizerMismatchError, default_store_path, prepare_corpus, resolve_source

    folder, with_bos, _, _ = llama3
    without = load_tokenizer(_variant(folder, tmp_path / "nobos", bos_template=False))
    assert without.document_start == () and with_bos.fingerprint != without.fingerprint
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    src = resolve_source(source)
    assert default_store_path(src, with_bos, tmp_path) != default_store_path(src, without, tmp_path)
    out = prepare_corpus(without, source, out_dir=tmp_path / "store", validation_fraction=0.0)
    with pytest.raises(TokenizerMismatchError, match="was built with tokenizer"):
        prepare_corpus(with_bos, source, out_dir=out, validation_fraction=0.0)


def _starts_as_document(ids, ref, text: str, length: int | None = None):
    """``ids`` open with transformers' add_special_tokens=True ids of ``text`` (and have ``length`` ids)."""
    head = ref.encode(text, add_special_tokens=True)
    assert [int(i) for i in ids[: len(head)]] == head
    if length is not None:
        assert len(ids) == length


def test_probe_prompts_start_with_bos(llama3):
    """The selection probes' NIAH and ablation (passkey, key-value) prompts open with BOS and keep their lengths."""
    from hydrahead_jax.selection.select import SelectionConfig, ablation_examples, niah_examples

    _, tok, ref, bos = llama3
    sel = SelectionConfig(niah_prompts=2, niah_lengths=(512,), niah_needle_types=("number",), ablation_length=512)
    haystack = synthetic.Haystack(FILLER, tok)
    for ex in niah_examples(tok, haystack, sel):
        _starts_as_document(ex.prompt_ids, ref, synthetic.NIAH_PREFIX.format(noun_pl="numbers"), 512)
        assert np.array_equal(ex.prompt_ids[ex.needle_positions], ex.answer_ids) and bos not in ex.prompt_ids[1:]
    passkey, kv = ablation_examples(tok, haystack, sel, count=2)
    _starts_as_document(passkey.prompt_ids, ref, synthetic.PASSKEY_PREFIX, 512)
    _starts_as_document(kv.prompt_ids, ref, synthetic.KV_PREFIX)
    assert len(kv.prompt_ids) <= 512


def test_eval_prompts_and_text_windows_start_with_bos(llama3, tmp_path):
    """eval.py's inputs: a retrieval prompt, a RULER prompt assembled from pieces (fwe) and a held-out text file
    (one document, its first perplexity window) open with BOS; lengths stay within their budgets."""
    from hydrahead_jax.evaluation import ruler
    from hydrahead_jax.evaluation.inputs import Inputs

    _, tok, ref, bos = llama3
    (tmp_path / "hay.txt").write_text(FILLER)
    (tmp_path / "doc.txt").write_text(DOCS[0] + "\n" + FILLER)
    inputs = Inputs(haystack=str(tmp_path / "hay.txt"), texts={"doc": str(tmp_path / "doc.txt")})
    ex = inputs.example("passkey", tok, length=512, sample=0, depth=0.5)
    _starts_as_document(ex.prompt_ids, ref, synthetic.PASSKEY_PREFIX, 512)
    want = ref.encode((tmp_path / "doc.txt").read_text(), add_special_tokens=True)
    assert inputs.stream("doc", tok).tolist() == want
    windows, size = inputs.windows("doc", tok, 64, 2)
    assert size == len(want) and [w.tolist() for w in windows] == [want[:64], want[64:128]]
    fwe = ruler.build("fwe", ruler.RulerInputs(tok, inputs.haystack(tok)), length=1024, seed=0)
    _starts_as_document(fwe.prompt_ids, ref, ruler.FWE_TEMPLATE)
    assert len(fwe.prompt_ids) + fwe.max_new_tokens <= 1024 and list(fwe.prompt_ids).count(bos) == 1
