"""grain pipeline over a token store: packing by hand, epoch coverage, exact resume (also through Orbax),
determinism, per-process slicing, and the synthetic mixture."""

import json

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from hydrahead_jax.data.corpus import CorpusStore, prepare_corpus
from hydrahead_jax.data.mixture import SyntheticRows
from hydrahead_jax.data.pipeline import PackedWindows, make_dataset, make_train_iterator
from hydrahead_jax.data.rows import pack_row
from hydrahead_jax.data.tiny_tokenizer import TokenizersAdapter, train_bpe_tokenizer

KEYS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")


def _word_tokenizer():
    """Word-level tokenizer with known ids: <eos>=0, a=1, b=2, ... so token streams can be written by hand."""
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate("abcdefghij")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TokenizersAdapter(tok, name="words", eos_token="<eos>")


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    (d / "docs.txt").write_text("a b c\n\nd e\n\nf g h i j\n")
    return prepare_corpus(
        _word_tokenizer(), d / "docs.txt", out_dir=d / "store", txt_split="paragraphs", validation_fraction=0.0
    )


def _prose(n_docs=60, seed=0):
    rng = np.random.default_rng(seed)
    words = "the river flows past old stone bridges while merchants argue about grain prices".split()
    return [
        "\n".join(" ".join(rng.choice(words, rng.integers(5, 60))) + "." for _ in range(rng.integers(1, 6)))
        for _ in range(n_docs)
    ]


@pytest.fixture(scope="module")
def bpe():
    from hydrahead_jax.data import synthetic as syn

    # prose plus the task templates, so synthetic prompts tokenise to a realistic number of tokens
    templates = [
        syn.NIAH_PREFIX,
        syn.PASSKEY_PREFIX,
        syn.KV_PREFIX,
        syn.VT_PREFIX,
        " ".join(syn.WORDS),
        "What is the special magic number for mentioned in the provided text? Answer: The pass key is "
        "Remember it. The value associated with the specified key is: One of the special magic",
    ]
    return train_bpe_tokenizer(_prose(20, seed=1) + templates * 3, vocab_size=800)


@pytest.fixture(scope="module")
def prose_store(tmp_path_factory, bpe):
    d = tmp_path_factory.mktemp("prose")
    with open(d / "docs.jsonl", "w") as f:
        for text in _prose():
            f.write(json.dumps({"text": text}) + "\n")
    return prepare_corpus(bpe, d / "docs.jsonl", out_dir=d / "store", validation_fraction=0.1, split_seed=3)


def test_pack_row_by_hand():
    # tokens of docs 7 (3 tokens) and 9 (2 tokens) then padding; T = 5 (6 tokens in)
    row = pack_row(np.array([5, 6, 0, 8, 0, 0]), np.array([7, 7, 7, 9, 9, -1]))
    np.testing.assert_array_equal(row["input_ids"], [5, 6, 0, 8, 0])
    np.testing.assert_array_equal(row["targets"], [6, 0, 8, 0, 0])
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 0, 1])
    np.testing.assert_array_equal(row["loss_mask"], [1, 1, 0, 1, 0])


def test_packed_windows_by_hand(tiny_store):
    store = CorpusStore(tiny_store)
    # docs "a b c"+eos, "d e"+eos, "f g h i j"+eos → the stream below (13 tokens)
    np.testing.assert_array_equal(store.read(0, 13), [1, 2, 3, 0, 4, 5, 0, 6, 7, 8, 9, 10, 0])
    ds = PackedWindows(store, 4, seed=0, shuffle=False, num_epochs=1)
    rows = [ds[i] for i in range(len(ds))]
    assert len(rows) == 3  # 13 // 4: the final EOS (whose target would cross the epoch end) is dropped
    want = [
        dict(
            input_ids=[1, 2, 3, 0],
            targets=[2, 3, 0, 4],
            segment_ids=[1, 1, 1, 1],
            positions=[0, 1, 2, 3],
            loss_mask=[1, 1, 1, 0],
        ),
        dict(
            input_ids=[4, 5, 0, 6],
            targets=[5, 0, 6, 7],
            segment_ids=[1, 1, 1, 2],
            positions=[0, 1, 2, 0],
            loss_mask=[1, 1, 0, 1],
        ),
        dict(
            input_ids=[7, 8, 9, 10],
            targets=[8, 9, 10, 0],
            segment_ids=[1, 1, 1, 1],
            positions=[0, 1, 2, 3],
            loss_mask=[1, 1, 1, 1],
        ),
    ]
    for row, w in zip(rows, want):
        for k in KEYS:
            np.testing.assert_array_equal(row[k], w[k], err_msg=k)
        assert row["input_ids"].dtype == np.int32 and row["loss_mask"].dtype == np.float32
    tail = PackedWindows(store, 4, seed=0, shuffle=False, num_epochs=1, drop_tail=False)
    assert len(tail) == 4
    last = tail[3]
    np.testing.assert_array_equal(last["input_ids"], [0, 0, 0, 0])
    np.testing.assert_array_equal(last["segment_ids"], [1, 0, 0, 0])
    np.testing.assert_array_equal(last["loss_mask"], [0, 0, 0, 0])


def _docs(store):
    return [store.document(i).tolist() for i in range(store.num_docs)]


def test_epoch_covers_every_token_once(prose_store):
    store = CorpusStore(prose_store)
    seq_len = 32
    ds = PackedWindows(store, seq_len, seed=5, num_epochs=1, drop_tail=False)
    rows = [ds[i] for i in range(len(ds))]
    valid = np.concatenate([r["input_ids"][r["segment_ids"] > 0] for r in rows])
    # every token of the split is an input exactly once (multiset equality)
    np.testing.assert_array_equal(np.sort(valid), np.sort(store.read(0, store.num_tokens)))
    # and every segment is a contiguous piece of one document; pieces of each document tile it exactly
    docs = {tuple(d): i for i, d in enumerate(_docs(store))}
    pieces = []
    for r in rows:
        for s in range(1, r["segment_ids"].max() + 1):
            seg = r["input_ids"][r["segment_ids"] == s]
            np.testing.assert_array_equal(r["positions"][r["segment_ids"] == s], np.arange(len(seg)))
            pieces.append(seg.tolist())
    # reassemble: the stream order is a permutation of documents, so joining pieces in row order
    # within the unshuffled window order must give the documents back; check via the un-shuffled twin
    plain = PackedWindows(store, seq_len, seed=5, num_epochs=1, drop_tail=False, shuffle=False)
    stream = np.concatenate([plain[i]["input_ids"][plain[i]["segment_ids"] > 0] for i in range(len(plain))])
    np.testing.assert_array_equal(stream, store.read(0, store.num_tokens))
    doc_strings = [_csv(d) for d in docs]
    for p in pieces:
        assert any(_csv(p) in d for d in doc_strings), "a segment is not a contiguous slice of any document"
    # with the default drop_tail the lost inputs are exactly the last N mod T of the epoch's stream
    dropped = PackedWindows(store, seq_len, seed=5, num_epochs=1)
    assert len(dropped) == store.num_tokens // seq_len


def _csv(ids):
    return "," + ",".join(map(str, ids)) + ","


def test_loss_mask_matches_document_boundaries(prose_store, bpe):
    store = CorpusStore(prose_store)
    ds = PackedWindows(store, 64, seed=1, num_epochs=1)
    for i in range(len(ds)):
        r = ds[i]
        same = np.r_[r["segment_ids"][1:] == r["segment_ids"][:-1], True]
        # mask is 0 exactly at inputs that are EOS (the target starts the next document)
        np.testing.assert_array_equal(r["loss_mask"] == 0, r["input_ids"] == bpe.eos_id)
        # inside a row a segment change happens only right after an EOS input
        assert np.all(r["input_ids"][:-1][~same[:-1]] == bpe.eos_id)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_exact_resume_and_determinism(prose_store):
    kw = dict(seq_len=32, batch_size=4, seed=11, shard_index=0, shard_count=1)
    it = make_train_iterator(prose_store, **kw)
    first = _take(it, 7)
    state = it.get_state()
    rest = _take(it, 50)
    per_epoch = PackedWindows(CorpusStore(prose_store), 32, seed=11).windows_per_epoch // 4
    assert 7 < per_epoch < 57  # so the resumed stretch crosses an epoch boundary
    fresh = make_train_iterator(prose_store, **kw)
    fresh.set_state(json.loads(json.dumps(state)))
    _assert_batches_equal(_take(fresh, 50), rest)
    again = make_train_iterator(prose_store, **kw)
    _assert_batches_equal(_take(again, 57), first + rest)
    other_seed = make_train_iterator(prose_store, **{**kw, "seed": 12})
    assert not np.array_equal(next(other_seed)["input_ids"], first[0]["input_ids"])
    for b in first:
        assert b["input_ids"].shape == (4, 32) and b["input_ids"].dtype == np.int32
        np.testing.assert_array_equal(b["targets"][:, :-1], b["input_ids"][:, 1:])


def test_epochs_reshuffle_and_finite_epochs(prose_store):
    store = CorpusStore(prose_store)
    ds = PackedWindows(store, 32, seed=2, num_epochs=2)
    w = ds.windows_per_epoch
    assert len(ds) == 2 * w
    e0 = np.stack([ds[i]["input_ids"] for i in range(w)])
    e1 = np.stack([ds[w + i]["input_ids"] for i in range(w)])
    assert not np.array_equal(e0, e1)
    it = make_train_iterator(prose_store, seq_len=32, batch_size=2, seed=2, num_epochs=1, shard_index=0, shard_count=1)
    assert sum(1 for _ in it) == w // 2


def test_orbax_round_trip(prose_store, tmp_path):
    kw = dict(seq_len=16, batch_size=2, seed=4, shard_index=0, shard_count=1)
    it = make_train_iterator(prose_store, **kw)
    _take(it, 5)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",))
    mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    expected = _take(it, 6)
    mngr.close()
    restored = make_train_iterator(prose_store, **kw)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",))
    mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
    mngr.close()
    _assert_batches_equal(_take(restored, 6), expected)


def test_shards_are_disjoint_and_tile_the_global_batch(prose_store):
    kw = dict(seq_len=16, batch_size=6, seed=9)
    whole = _take(make_train_iterator(prose_store, shard_index=0, shard_count=1, **kw), 4)
    shards = [_take(make_train_iterator(prose_store, shard_index=p, shard_count=3, **kw), 4) for p in range(3)]
    for step in range(4):
        rows = [shards[p][step]["input_ids"] for p in range(3)]
        assert all(r.shape == (2, 16) for r in rows)
        # process p holds global rows p, p+3: interleaving the shards rebuilds the single-process batch
        inter = np.stack([rows[p][j] for j in range(2) for p in range(3)])
        np.testing.assert_array_equal(inter, whole[step]["input_ids"])
    seen = [{r.tobytes() for s in range(4) for r in shards[p][s]["input_ids"]} for p in range(3)]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    with pytest.raises(ValueError, match="divisible"):
        make_train_iterator(prose_store, shard_index=0, shard_count=4, **kw)


def test_validation_split_and_tokenizer_check(prose_store, bpe):
    val = CorpusStore(prose_store, "validation")
    train = CorpusStore(prose_store, "train")
    assert val.num_docs == 6 and train.num_docs == 54  # round(0.1 * 60)
    it = make_train_iterator(
        prose_store, seq_len=16, batch_size=2, seed=0, split="validation", shard_index=0, shard_count=1, tokenizer=bpe
    )
    assert next(it)["input_ids"].shape == (2, 16)


def test_mixture_rate_loss_mask_and_resume(prose_store, bpe):
    kw = dict(
        seq_len=512,
        batch_size=5,
        seed=3,
        shard_index=0,
        shard_count=1,
        synthetic_rate=0.2,
        tokenizer=bpe,
        synthetic_tasks=("niah_single", "passkey", "kv_retrieval"),
    )
    ds = make_dataset(prose_store, **kw)
    it = iter(ds)
    batches = _take(it, 4)
    state = it.get_state()
    nxt = _take(it, 3)
    rows_syn = 0
    for b in batches:
        for r in range(5):
            m = b["loss_mask"][r]
            if b["segment_ids"][r].max() == 1 and m.sum() < 100 and m[0] == 0:
                rows_syn += 1
    assert rows_syn == 4  # 1 in 5 rows is synthetic: 20 rows → 4
    fresh = make_train_iterator(prose_store, **kw)
    fresh.set_state(state)
    _assert_batches_equal(_take(fresh, 3), nxt)
    _assert_batches_equal(_take(make_train_iterator(prose_store, **kw), 4), batches)


def test_mixture_with_loss_on_the_whole_synthetic_row_and_resume(prose_store, bpe):
    """synthetic_loss="full" (stages 2-3's KL over the whole retrieval row): the same rows as the answer-only
    mixture, the synthetic ones with loss on every token, and the iterator still resumes exactly."""
    kw = dict(
        seq_len=512,
        batch_size=5,
        seed=3,
        synthetic_rate=0.2,
        tokenizer=bpe,
        synthetic_tasks=("niah_single", "passkey", "kv_retrieval"),
    )
    answer = _take(make_train_iterator(prose_store, **kw), 4)
    it = make_train_iterator(prose_store, **kw, synthetic_loss="full")
    full = _take(it, 4)
    state = it.get_state()
    nxt = _take(it, 3)
    synthetic = 0
    for a, f in zip(answer, full):
        for key in ("input_ids", "targets", "segment_ids", "positions"):
            np.testing.assert_array_equal(a[key], f[key])
        for r in range(5):
            m = a["loss_mask"][r]
            if a["segment_ids"][r].max() == 1 and m.sum() < 100 and m[0] == 0:  # a synthetic row (as above)
                synthetic += 1
                # loss on every transition inside the example: its tokens but the last (whose target is padding)
                inside = f["segment_ids"][r] == 1
                assert np.all(f["loss_mask"][r][~inside] == 0) and f["loss_mask"][r].sum() >= inside.sum() - 1
                assert np.all(f["loss_mask"][r][: int(inside.sum()) - 1] == 1)
                assert f["loss_mask"][r].sum() > 10 * m.sum()
            else:
                np.testing.assert_array_equal(f["loss_mask"][r], m)
    assert synthetic == 4
    fresh = make_train_iterator(prose_store, **kw, synthetic_loss="full")
    fresh.set_state(state)
    _assert_batches_equal(_take(fresh, 3), nxt)


def test_synthetic_row_masks_answer_only(prose_store, bpe):
    from hydrahead_jax.data.synthetic import Haystack

    hay = Haystack.from_store(CorpusStore(prose_store), bpe)
    rows = SyntheticRows(bpe, hay, seq_len=300, seed=1, tasks=("niah_single",))
    full = SyntheticRows(bpe, hay, seq_len=300, seed=1, tasks=("niah_single",), loss="full")
    for i in range(3):
        ex = rows.example(i)
        r, f = rows[i], full[i]
        p, a = len(ex.prompt_ids), len(ex.answer_ids)
        assert p + a == 301  # count_answer: prompt + answer fill seq_len + 1 exactly
        np.testing.assert_array_equal(r["targets"][r["loss_mask"] == 1], ex.answer_ids)
        np.testing.assert_array_equal(np.flatnonzero(r["loss_mask"]), np.arange(p - 1, p + a - 1))
        assert f["loss_mask"].sum() == 300 and np.all(f["segment_ids"] == 1)


def test_documents_source(tiny_store):
    from hydrahead_jax.data.pipeline import Documents

    docs = Documents(CorpusStore(tiny_store))
    assert len(docs) == 3
    np.testing.assert_array_equal(docs[1]["tokens"], [4, 5, 0])
    shuffled = [int(d["document"]) for d in docs.shuffle(seed=0)]
    assert sorted(shuffled) == [0, 1, 2]
