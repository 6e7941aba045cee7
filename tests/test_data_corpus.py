"""Corpus preparation: wiki cleaner, the default Wikipedia extract with the real SmolLM2 tokenizer, user
files, store reuse / tokenizer mismatch, and clear errors that leave nothing half-written."""

import bz2
import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hydrahead_jax.data import corpus
from hydrahead_jax.data.corpus import (
    CorpusError,
    CorpusStore,
    TokenizerMismatchError,
    fetch_gensim_wheel,
    load_enwiki_documents,
    load_heldout_text,
    prepare_corpus,
)
from hydrahead_jax.data.tiny_tokenizer import train_bpe_tokenizer
from hydrahead_jax.data.wiki import clean_wiki_markup

SNIPPET = """{{Infobox person
| name = Ada {{nowrap|Lovelace}}
| image = Ada.jpg
}}
'''Augusta Ada King''' was an [[England|English]] [[mathematician]].<ref name="a">{{cite web|url=x}}</ref> She wrote notes<ref>Toole, p. 3</ref> on the [[Analytical Engine]].<!-- hidden comment -->
[[File:Ada.jpg|thumb|A portrait with a [[painting|painted]] frame [c. 1840]]]
{| class="wikitable"
| a || b {{x|{{y}}}}
|}
== Early life ==
* Born in [[London]] on 10&nbsp;December 1815.
See [http://example.org the archive] and [http://example.org/bare].
== References ==
{{reflist}}
* A book.
[[Category:Mathematicians]]
[[fr:Ada Lovelace]]"""

SNIPPET_CLEAN = """Augusta Ada King was an English mathematician. She wrote notes on the Analytical Engine.

Early life
Born in London on 10 December 1815.
See the archive and."""


def test_wiki_cleaner_on_hand_written_markup():
    assert clean_wiki_markup(SNIPPET) == SNIPPET_CLEAN


def test_wiki_cleaner_unbalanced_template_drops_rest():
    assert clean_wiki_markup("Kept text. {{broken template | never closed") == "Kept text."


@pytest.fixture(scope="module")
def cache(tmp_path_factory, gensim_wheel):
    """A cache folder of this module's own holding the gensim wheel (see conftest.gensim_wheel)."""
    d = tmp_path_factory.mktemp("cache")
    shutil.copy(gensim_wheel, d)
    return d


@pytest.fixture(scope="module")
def bpe():
    texts = [
        "The quick brown fox jumps over the lazy dog. " * 3,
        "Zwölf Boxkämpfer jagen Viktor quer über den Sylter Deich.",
        "Numbers 0123456789 and punctuation: ,.;!?()[]{}\"'",
    ]
    return train_bpe_tokenizer(texts * 5, vocab_size=300, name="bpe-a")


@pytest.fixture(scope="module")
def other_bpe():
    return train_bpe_tokenizer(
        ["completely different training text for another vocabulary"] * 5, vocab_size=280, name="bpe-b"
    )


def _no_temp_leftovers(parent: Path):
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_enwiki_extract_with_smollm2(cache, tmp_path):
    from hydrahead_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    # independent count of main-namespace, non-redirect pages straight from the XML
    with zipfile.ZipFile(next(Path(cache).glob("*.whl"))) as z:
        xml = bz2.decompress(z.read(corpus.ENWIKI_MEMBER)).decode()
    pages = re.findall(r"<page>.*?</page>", xml, re.S)
    articles = [p for p in pages if "<ns>0</ns>" in p and "<redirect" not in p]
    docs = load_enwiki_documents(cache)
    assert len(docs) == len(articles) == 106
    text_bytes = sum(len(d.encode()) for d in docs)
    assert 2.6e6 < text_bytes < 3.1e6
    for d in docs:
        assert "{{" not in d and "[[" not in d and "<ref" not in d and "&nbsp;" not in d
    path = prepare_corpus(tok, cache=cache, out_dir=tmp_path / "enwiki")
    meta = json.loads((path / "metadata.json").read_text())
    assert meta["tokenizer"]["fingerprint"] == tok.fingerprint
    n_val = meta["splits"]["validation"]["documents"]
    assert n_val == 2 and meta["splits"]["train"]["documents"] == 104
    # the store the demo reads, as the one-array store before shards had it (its split, documents and counts, read
    # from that store on 2026-12-07): preparation in shards changed none of it
    assert meta["validation_documents"] == [37, 87]
    assert (meta["splits"]["train"]["tokens"], meta["splits"]["validation"]["tokens"]) == (605_871, 16_761)
    # token counts against per-document encode() + EOS (not encode_batch, which the store used)
    total = meta["splits"]["train"]["tokens"] + meta["splits"]["validation"]["tokens"]
    assert 600_000 < total < 700_000
    val = CorpusStore(path, "validation", tokenizer=tok)
    train = CorpusStore(path, "train")
    assert val.num_tokens + train.num_tokens == total and train.offsets[-1] == train.num_tokens
    train_ids = [i for i in range(106) if i not in meta["validation_documents"]]
    # a sample of documents against per-document encode() + EOS (the store used encode_batch)
    checks = [(val, j, i) for j, i in enumerate(meta["validation_documents"])]
    checks += [(train, j, train_ids[j]) for j in (0, 1, 50, 103)]
    for store, j, i in checks:
        np.testing.assert_array_equal(store.document(j), tok.encode(docs[i]) + [tok.eos_id])


def test_heldout_text(cache):
    text = load_heldout_text(cache)
    assert text.startswith("Hundreds of people have been forced to vacate their homes")
    assert len(text.splitlines()) == 300 and 3.5e5 < len(text) < 3.7e5


def test_fetch_downloads_with_pip_when_missing(tmp_path, monkeypatch, gensim_wheel):
    calls = []

    def fake_run(cmd, capture_output, text):
        calls.append(cmd)
        shutil.copy(gensim_wheel, cmd[cmd.index("-d") + 1])  # what pip download would leave there
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(corpus.subprocess, "run", fake_run)
    got = fetch_gensim_wheel(tmp_path / "c")
    assert got.parent == tmp_path / "c" and got.name.startswith("gensim-4.4.0-")
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "gensim==4.4.0" in cmd
    assert fetch_gensim_wheel(tmp_path / "c") == got and len(calls) == 1  # cached now: no second download

    monkeypatch.setattr(
        corpus.subprocess,
        "run",
        lambda cmd, capture_output, text: subprocess.CompletedProcess(cmd, 1, "", "no network"),
    )
    with pytest.raises(CorpusError, match="no network(.|\n)*copy a gensim"):
        fetch_gensim_wheel(tmp_path / "empty")


def test_user_sources_round_trip(tmp_path, bpe):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("First document.\nStill the first.\n")
    (src / "b.jsonl").write_text(
        json.dumps({"body": "Zwölf Boxkämpfer."})
        + "\n\n"
        + json.dumps({"body": "", "x": 1})
        + "\n"
        + json.dumps({"body": "Third (jsonl)."})
        + "\n"
    )
    pq.write_table(pa.table({"body": ["Parquet one.", "Parquet two!"], "n": [1, 2]}), src / "c.parquet")
    path = prepare_corpus(bpe, src, out_dir=tmp_path / "store", text_field="body", validation_fraction=0)
    store = CorpusStore(path)
    got = [bpe.decode(store.document(i)[:-1]) for i in range(store.num_docs)]
    assert got == [
        "First document.\nStill the first.",
        "Zwölf Boxkämpfer.",
        "Third (jsonl).",
        "Parquet one.",
        "Parquet two!",
    ]
    assert all(store.document(i)[-1] == bpe.eos_id for i in range(store.num_docs))
    (tmp_path / "p.txt").write_text("doc one\nline two\n\n\n doc two \n\ndoc three")
    p2 = prepare_corpus(
        bpe, tmp_path / "p.txt", out_dir=tmp_path / "s2", txt_split="paragraphs", validation_fraction=0.5, split_seed=1
    )
    meta = json.loads((p2 / "metadata.json").read_text())
    assert meta["splits"]["train"]["documents"] + meta["splits"]["validation"]["documents"] == 3
    assert meta["splits"]["validation"]["documents"] == 2  # round(0.5 * 3)


@pytest.mark.parametrize(
    "name,content,kwargs,pattern",
    [
        ("empty.txt", b"", {}, r"empty\.txt is empty"),
        ("blank.txt", b"  \n\n ", {}, r"blank\.txt is empty"),
        (
            "latin.txt",
            "caf\u00e9 ok".encode("utf-8") + b" na\xefve",
            {},
            r"latin\.txt: bytes at offset 11 are not valid UTF-8",
        ),
        (
            "rec.jsonl",
            b'{"text": "ok"}\n{"body": "x"}\n',
            {},
            r"rec\.jsonl, line 2: no field 'text' \(found \['body'\]\)",
        ),
        ("bad.jsonl", b'{"text": "ok"}\n{oops\n', {}, r"bad\.jsonl, line 2: not valid JSON"),
        ("x.csv", b"a,b\n", {}, r"unknown corpus file type '\.csv'"),
    ],
)
def test_bad_inputs_raise_and_leave_nothing(tmp_path, bpe, name, content, kwargs, pattern):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(CorpusError, match=pattern):
        prepare_corpus(bpe, tmp_path / name, out_dir=tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists() and not _no_temp_leftovers(tmp_path)


def test_parquet_missing_column_and_missing_path(tmp_path, bpe):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(CorpusError, match=r"no column 'text' \(columns: \['content'\]\)"):
        prepare_corpus(bpe, tmp_path / "t.parquet", out_dir=tmp_path / "out")
    with pytest.raises(CorpusError, match="does not exist"):
        prepare_corpus(bpe, tmp_path / "nope.txt", out_dir=tmp_path / "out")
    (tmp_path / "one.txt").write_text("only one document")
    with pytest.raises(CorpusError, match="too few for a validation split"):
        prepare_corpus(bpe, tmp_path / "one.txt", out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_crash_while_tokenising_leaves_nothing(tmp_path, bpe):
    class Exploding:
        name, fingerprint, vocab_size, eos_id, bos_id = "boom", "f" * 64, bpe.vocab_size, bpe.eos_id, None
        calls = 0

        def encode_batch(self, texts):
            Exploding.calls += 1
            if Exploding.calls > 1:
                raise KeyboardInterrupt("simulated crash")
            return bpe.encode_batch(texts)

    (tmp_path / "p.txt").write_text("\n\n".join(f"document number {i}" for i in range(10)))
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(
            Exploding(),
            tmp_path / "p.txt",
            out_dir=tmp_path / "out",
            txt_split="paragraphs",
            batch_docs=2,
            validation_fraction=0,
        )
    assert not (tmp_path / "out").exists() and not _no_temp_leftovers(tmp_path)


def test_store_reuse_and_tokenizer_mismatch(tmp_path, bpe, other_bpe):
    (tmp_path / "p.txt").write_text("\n\n".join(f"paragraph {i} of the text" for i in range(8)))
    kw = dict(out_dir=tmp_path / "store", txt_split="paragraphs")
    path = prepare_corpus(bpe, tmp_path / "p.txt", **kw)
    stamp = (path / "metadata.json").stat().st_mtime_ns
    assert prepare_corpus(bpe, tmp_path / "p.txt", **kw) == path
    assert (path / "metadata.json").stat().st_mtime_ns == stamp  # reused, not rewritten
    with pytest.raises(TokenizerMismatchError, match="built with tokenizer 'bpe-a'.*rebuild=True"):
        prepare_corpus(other_bpe, tmp_path / "p.txt", **kw)
    with pytest.raises(TokenizerMismatchError, match="bpe-b"):
        CorpusStore(path, tokenizer=other_bpe)
    with pytest.raises(CorpusError, match="other inputs or settings"):
        prepare_corpus(bpe, tmp_path / "p.txt", out_dir=tmp_path / "store", txt_split="file")
    rebuilt = prepare_corpus(other_bpe, tmp_path / "p.txt", rebuild=True, **kw)
    assert json.loads((rebuilt / "metadata.json").read_text())["tokenizer"]["name"] == "bpe-b"
    store = CorpusStore(rebuilt, tokenizer=other_bpe)
    assert other_bpe.decode(store.document(0)[:-1]).startswith("paragraph")
    assert not _no_temp_leftovers(tmp_path)
    # default location: keyed by source hash and tokenizer fingerprint under the cache folder
    auto = prepare_corpus(bpe, tmp_path / "p.txt", cache=tmp_path / "cache", txt_split="paragraphs")
    assert auto.parent == tmp_path / "cache" / "corpora" and bpe.fingerprint[:16] in auto.name


def test_tensorstore_fallback_reads_match(tmp_path, bpe):
    (tmp_path / "p.txt").write_text("\n\n".join(f"paragraph {i} of the text" for i in range(8)))
    path = prepare_corpus(bpe, tmp_path / "p.txt", out_dir=tmp_path / "s", txt_split="paragraphs")
    mem = CorpusStore(path)
    lazy = CorpusStore(path, max_in_memory_bytes=0)  # every read goes to TensorStore
    assert lazy._tokens is None
    for i in range(mem.num_docs):
        np.testing.assert_array_equal(mem.document(i), lazy.document(i))
