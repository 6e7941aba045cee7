"""Corpus preparation as its own resumable step (hydrahead_jax.data.preparation / prepare): every reader against the
texts written, the per-shard split, stores of several shards read as one stream, the command line against the
tokenizer run directly, refusals naming the file, a killed preparation resumed, four processes against one, and
sources and stores on gs:// (the GCS emulator)."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hydrahead_jax.data.corpus import CorpusError
from hydrahead_jax.data.preparation import prepare_corpus, run_preparation
from hydrahead_jax.data.sources import iter_documents, list_inputs
from hydrahead_jax.data.store import CorpusStore, read_metadata
from hydrahead_jax.data.tiny_tokenizer import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the river flows past old stone bridges while merchants argue about grain prices in a quiet town".split()


def documents(seed: int, count: int, lo: int = 5, hi: int = 120) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(lo, hi))) + "." for _ in range(count)]


def write_jsonl_zst(path: Path, docs: list[str]) -> Path:
    import zstandard

    path.write_bytes(
        zstandard.ZstdCompressor().compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    )
    return path


def write_corpus(folder: Path, files: int, docs_per_file: int, seed: int = 0) -> list[str]:
    """``files`` .jsonl.zst files of seeded prose; the documents in reading order."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(files):
        docs = documents(seed * 1000 + i, docs_per_file)
        write_jsonl_zst(folder / f"part-{i:03d}.jsonl.zst", docs)
        out += docs
    return out


@pytest.fixture(scope="module")
def bpe():
    return train_bpe_tokenizer([" ".join(WORDS)] * 20 + documents(99, 50), vocab_size=300, name="prep-bpe")


def store_arrays(path) -> dict:
    """Every split's tokens and offsets of a store (read as one stream)."""
    out = {}
    for split in ("train", "validation"):
        s = CorpusStore(path, split, max_in_memory_bytes=0)
        out[split] = (s.read(0, s.num_tokens), s.offsets)
    return out


def assert_same_store(a, b):
    ma, mb = read_metadata(a), read_metadata(b)
    assert ma["splits"] == mb["splits"] and ma["validation_documents"] == mb["validation_documents"]
    for split, (tokens, offsets) in store_arrays(a).items():
        other_tokens, other_offsets = store_arrays(b)[split]
        np.testing.assert_array_equal(tokens, other_tokens)
        np.testing.assert_array_equal(offsets, other_offsets)


# ------------------------------------------------------------------------------------------------ readers


def test_every_reader_gives_the_documents_written(tmp_path, monkeypatch):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    (src / "nested").mkdir(parents=True)
    (src / "a.txt").write_text("A text file.\nOne document.\n")
    (src / "b.md").write_text("# Markdown\n\nalso one document")
    (src / "c.jsonl").write_text(json.dumps({"text": "jsonl one"}) + "\n\n" + json.dumps({"text": ""}) + "\n")
    (src / "d.jsonl.gz").write_bytes(gzip.compress((json.dumps({"text": "gz one"}) + "\n").encode()))
    write_jsonl_zst(src / "e.jsonl.zst", ["zst one", "zst two"])
    pq.write_table(pa.table({"text": ["parquet one", None, "parquet two"]}), src / "f.parquet")
    datasets.Dataset.from_dict({"text": ["arrow one", "", "arrow two", "arrow three"]}).save_to_disk(
        str(src / "nested" / "g"), num_shards=2
    )
    (src / ".hidden.csv").write_text("skipped: hidden")
    inputs = list_inputs(src)
    assert [f.name for f in inputs] == [
        "a.txt",
        "b.md",
        "c.jsonl",
        "d.jsonl.gz",
        "e.jsonl.zst",
        "f.parquet",
        "nested/g/data-00000-of-00002.arrow",
        "nested/g/data-00001-of-00002.arrow",
    ]
    got = [d for f in inputs for d in iter_documents(f)]
    assert got == [
        "A text file.\nOne document.",
        "# Markdown\n\nalso one document",
        "jsonl one",
        "gz one",
        "zst one",
        "zst two",
        "parquet one",
        "parquet two",
        "arrow one",
        "arrow two",
        "arrow three",
    ]
    assert [f.name for f in list_inputs(f"{src}/*.jsonl*")] == ["c.jsonl", "d.jsonl.gz", "e.jsonl.zst"]
    monkeypatch.chdir(src)
    (md,) = list_inputs("*.md")
    assert md.name == "b.md" and md.path == str(src / "b.md")


def test_a_file_of_an_unknown_kind_is_refused_naming_it_before_any_work(tmp_path, bpe):
    write_corpus(tmp_path / "src", 1, 3)
    (tmp_path / "src" / "notes.csv").write_text("a,b\n")
    with pytest.raises(CorpusError, match=r"src/notes\.csv: unknown corpus file type '\.csv'.*Fix"):
        prepare_corpus(bpe, tmp_path / "src", out_dir=tmp_path / "store")
    assert not (tmp_path / "store").exists()
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text("{}")
    with pytest.raises(CorpusError, match=r"DatasetDict folder.*name one split's folder"):
        list_inputs(tmp_path / "dd")


# ------------------------------------------------------------------------------------------------ the store


def test_split_per_shard_and_the_store_read_as_one_stream(tmp_path, bpe):
    """Six files, three per shard: each shard gives max(1, round(0.1 n)) documents to validation, the splits are
    disjoint and together every document once, and the stream reads across shard boundaries as the documents'
    concatenation in order (in memory and through TensorStore)."""
    docs = write_corpus(tmp_path / "src", 6, 17)
    size = int(3.5 * np.mean([f.stat().st_size for f in (tmp_path / "src").iterdir()]))  # three files a shard
    path = prepare_corpus(bpe, tmp_path / "src", out_dir=tmp_path / "store", validation_fraction=0.1, shard_bytes=size)
    meta = read_metadata(path)
    assert [s["inputs"] for s in meta["shards"]] == [[0, 1, 2], [3, 4, 5]]
    assert [s["splits"]["validation"]["documents"] for s in meta["shards"]] == [5, 5]  # round(0.1 * 51)
    validation = meta["validation_documents"]
    train_ids = [i for i in range(len(docs)) if i not in set(validation)]
    eos = [bpe.eos_id]
    for split, ids in (("train", train_ids), ("validation", validation)):
        want = [bpe.encode(docs[i]) + eos for i in ids]
        for lazy in (False, True):
            store = CorpusStore(path, split, max_in_memory_bytes=0 if lazy else 2 << 30)
            assert store.shards == 2 and store.num_docs == len(ids)
            assert [store.document(j).tolist() for j in range(store.num_docs)] == want
            np.testing.assert_array_equal(store.read(0, store.num_tokens), np.concatenate(want))
    assert meta["splits"]["train"]["documents"] + meta["splits"]["validation"]["documents"] == len(docs)


def test_a_version_1_store_still_reads(tmp_path, bpe):
    """A store written before shards (one train/validation pair at the top, metadata version 1) reads as a store
    of one shard."""
    import tensorstore as ts

    splits = {
        "train": (np.arange(10, dtype=np.int32), np.asarray([0, 4, 10], np.int64)),
        "validation": (np.arange(3, dtype=np.int32), np.asarray([0, 3], np.int64)),
    }
    for split, arrays in splits.items():
        for name, array in zip(("tokens", "offsets"), arrays, strict=True):
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "v1" / split / name)}}
            store = ts.open(spec, create=True, dtype=ts.dtype(array.dtype.name), shape=[len(array)]).result()
            store.write(array).result()
    meta = {
        "format": "hydrahead-token-store",
        "version": 1,
        "tokenizer": {"name": bpe.name, "fingerprint": bpe.fingerprint, "eos_id": bpe.eos_id},
        "source": {"description": "x", "sha256": "a" * 64},
        "settings": {},
        "splits": {},
    }
    (tmp_path / "v1" / "metadata.json").write_text(json.dumps(meta))
    store = CorpusStore(tmp_path / "v1", tokenizer=bpe)
    assert store.shards == 1 and store.document(1).tolist() == [4, 5, 6, 7, 8, 9]
    assert CorpusStore(tmp_path / "v1", "validation").document(0).tolist() == [0, 1, 2]


def test_changed_inputs_are_refused_naming_the_file(tmp_path, bpe):
    write_corpus(tmp_path / "src", 3, 5)
    kw = dict(out_dir=tmp_path / "store", shard_bytes=1)
    path = prepare_corpus(bpe, tmp_path / "src", **kw)
    stamp = (path / "metadata.json").stat().st_mtime_ns
    target = tmp_path / "src" / "part-001.jsonl.zst"
    data = target.read_bytes()
    os.utime(target, (time.time() + 5, time.time() + 5))  # touched, content unchanged: accepted after a hash
    assert prepare_corpus(bpe, tmp_path / "src", **kw) == path
    assert (path / "metadata.json").stat().st_mtime_ns == stamp
    target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, other content
    with pytest.raises(CorpusError, match=r"part-001\.jsonl\.zst was rewritten.*Fix: restore.*rebuild=True"):
        prepare_corpus(bpe, tmp_path / "src", **kw)
    target.write_bytes(data + b"\n")
    with pytest.raises(CorpusError, match=r"part-001\.jsonl\.zst changed since.*size \d+ -> \d+ bytes"):
        prepare_corpus(bpe, tmp_path / "src", **kw)
    (tmp_path / "src" / "part-003.jsonl.zst").write_bytes((tmp_path / "src" / "part-000.jsonl.zst").read_bytes())
    target.write_bytes(data)
    with pytest.raises(CorpusError, match=r"input part-003\.jsonl\.zst was added"):
        prepare_corpus(bpe, tmp_path / "src", **kw)


# ------------------------------------------------------------------------------------------------ the command line


def prepare_command(source, out, *extra) -> list[str]:
    return [sys.executable, "-m", "hydrahead_jax.data.prepare", "--source", str(source), "--out", str(out), *extra]


def run_prepare(source, out, *extra, timeout=600) -> dict:
    proc = subprocess.run(
        prepare_command(source, out, "--tokenizer", "smollm2-135m", *extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def direct_count(docs: list[str]) -> int:
    """Tokens of the documents by the tokenizer run directly (encode per document + EOS), as the store has them."""
    from hydrahead_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    return sum(len(tok.encode_document(d)) + 1 for d in docs)


@pytest.mark.slow
def test_the_command_line_with_workers_counts_what_the_tokenizer_counts(tmp_path):
    docs = write_corpus(tmp_path / "src", 4, 30)
    summary = run_prepare(tmp_path / "src", tmp_path / "store", "--workers", "2", "--shard_mb", "0.001")
    assert summary["complete"] and summary["shards"] == summary["shards_done"] == summary["shards_prepared"] == 4
    assert summary["documents"] == len(docs) and summary["tokens"] == direct_count(docs)
    assert summary["splits"]["validation"]["documents"] == 4  # one per shard of 30 (max(1, round(0.6)))
    again = run_prepare(tmp_path / "src", tmp_path / "store", "--shard_mb", "0.001")
    assert again["shards_prepared"] == 0 and again["tokens"] == summary["tokens"]


@pytest.mark.slow
def test_a_killed_preparation_resumes_keeping_its_finished_shards(tmp_path):
    """SIGKILL while shards are being written (one worker: shards finish one by one), then the same command: the
    finished shards are kept as they were (their done.json untouched), the rest prepared, and the store equals one
    prepared without interruption; its token count equals the tokenizer's own."""
    docs = write_corpus(tmp_path / "src", 8, 250)
    args = ("--tokenizer", "smollm2-135m", "--shard_mb", "0.001")
    proc = subprocess.Popen(
        prepare_command(tmp_path / "src", tmp_path / "store", *args), cwd=ROOT, start_new_session=True
    )
    done = lambda: sorted((tmp_path / "store").glob("shards/*/done.json"))  # noqa: E731
    deadline = time.time() + 300
    while len(done()) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = {p: p.stat().st_mtime_ns for p in done()}
    assert 2 <= len(kept) < 8, f"{len(kept)} shards were done when the preparation was killed"
    assert not (tmp_path / "store" / "metadata.json").exists()
    with pytest.raises(CorpusError, match=r"unfinished token store \(\d of 8 shards done\).*rerun"):
        CorpusStore(tmp_path / "store")
    summary = run_prepare(tmp_path / "src", tmp_path / "store", "--shard_mb", "0.001")
    assert summary["complete"] and summary["shards_prepared"] == 8 - len(kept)
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert summary["tokens"] == direct_count(docs) and summary["documents"] == len(docs)
    run_prepare(tmp_path / "src", tmp_path / "whole", "--shard_mb", "0.001")
    assert_same_store(tmp_path / "store", tmp_path / "whole")


@pytest.mark.slow
def test_four_processes_make_the_store_one_process_makes(tmp_path, bpe):
    """Two hosts (--host_index 0/1 of 2) of two workers each, at the same time, against prepare_corpus in this one
    process: the same store, array for array."""
    write_corpus(tmp_path / "src", 6, 40)
    procs = [
        subprocess.Popen(
            prepare_command(
                tmp_path / "src",
                tmp_path / "four",
                *("--tokenizer", "smollm2-135m", "--shard_mb", "0.001", "--workers", "2"),
                *("--host_index", str(h), "--host_count", "2"),
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for h in range(2)
    ]
    summaries = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    assert [s["shards_prepared"] for s in summaries] == [3, 3] and any(s["complete"] for s in summaries)
    from hydrahead_jax.models.tokenizer import load_tokenizer

    one = prepare_corpus(
        load_tokenizer("smollm2-135m"), tmp_path / "src", out_dir=tmp_path / "one", shard_bytes=int(0.001 * 2**20)
    )
    assert_same_store(tmp_path / "four", one)


# ------------------------------------------------------------------------------------------------ gs://


@pytest.mark.slow
def test_source_and_store_on_gcs(tmp_path, bpe):
    """A corpus in a bucket (a folder and a glob of it), prepared into a store in the bucket, equals the store of
    the same files prepared locally; a rerun reuses it."""
    from gcs_emulator import BUCKET, emulator_env, gcs_emulator

    from hydrahead_jax.storage import run_path

    write_corpus(tmp_path / "src", 3, 20)
    local = prepare_corpus(bpe, tmp_path / "src", out_dir=tmp_path / "local", shard_bytes=1)
    with gcs_emulator(tmp_path) as variables, emulator_env(variables):
        for f in sorted((tmp_path / "src").iterdir()):
            (run_path(f"gs://{BUCKET}/corpus") / f.name).write_bytes(f.read_bytes())
        for source in (f"gs://{BUCKET}/corpus", f"gs://{BUCKET}/corpus/*.jsonl.zst"):
            out = f"gs://{BUCKET}/stores/{'glob' if '*' in source else 'folder'}"
            summary = run_preparation(bpe, source, out_dir=out, shard_bytes=1)
            assert summary["complete"] and summary["shards_prepared"] == 3
            assert_same_store(out, local)
            assert run_preparation(bpe, source, out_dir=out, shard_bytes=1)["shards_prepared"] == 0


def test_hosts_that_do_not_share_the_store_folder_are_told_so(tmp_path, bpe):
    """The multi-process path of train.py (training.data.prepare_store): each host prepares its shards without
    completing the store, then process 0 completes it. Hosts writing into folders of their own (a local cache on
    each) leave process 0 shards it cannot see: refused with the fix; one shared folder gives the one-host store."""
    from hydrahead_jax.data.preparation import finalize_from_manifest

    write_corpus(tmp_path / "src", 4, 12)
    kw = dict(shard_bytes=1, finalize=False)
    for host in range(2):
        run_preparation(bpe, tmp_path / "src", out_dir=tmp_path / f"own{host}", host_index=host, host_count=2, **kw)
    with pytest.raises(CorpusError, match=r"shards \[1, 3\] of 4 are not done.*all hosts must see.*store_root"):
        finalize_from_manifest(tmp_path / "own0", fix="--config.data.store_root=gs://BUCKET/stores")
    for host in range(2):
        run_preparation(bpe, tmp_path / "src", out_dir=tmp_path / "shared", host_index=host, host_count=2, **kw)
    assert not (tmp_path / "shared" / "metadata.json").exists()
    finalize_from_manifest(tmp_path / "shared")
    assert_same_store(
        tmp_path / "shared", prepare_corpus(bpe, tmp_path / "src", out_dir=tmp_path / "one", shard_bytes=1)
    )


class DyingTokenizer:
    """A tokenizer whose worker process dies (as one killed for memory does) at its first batch."""

    name, fingerprint, vocab_size, eos_id, bos_id = "dies", "d" * 64, 10, 0, None

    def encode_batch(self, texts):
        os._exit(9)


def test_a_worker_that_dies_or_fails_is_an_error_naming_the_shard(tmp_path, bpe):
    write_corpus(tmp_path / "src", 6, 4)
    with pytest.raises(CorpusError, match=r"the worker preparing shard \d died \(exit code 9; out of memory\?\)"):
        prepare_corpus(DyingTokenizer(), tmp_path / "src", out_dir=tmp_path / "dies", shard_bytes=1, workers=2)
    assert not (tmp_path / "dies").exists()  # nothing was finished: the new store is gone again
    (tmp_path / "src" / "part-004.jsonl.zst").write_bytes(b"not zstd")
    with pytest.raises(CorpusError, match=r"part-004\.jsonl\.zst is not a readable jsonl.zst file \(ZstdError"):
        prepare_corpus(bpe, tmp_path / "src", out_dir=tmp_path / "bad", shard_bytes=1, workers=2)
