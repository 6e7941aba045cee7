"""The token store on disk or in a bucket: its layout, the shard writer, the metadata, and the reader.

Layout (version 2; ``prepare.py`` writes it, one output shard per group of input files)::

    manifest.json                 written first: tokenizer, settings, every input's name, size and mtime, the shards
    shards/00000/train/tokens     zarr3 int32 [n]   the shard's train documents back to back, each opened by the
                                                    tokenizer's document start (Llama 3: BOS; SmolLM2: none) and
                                                    closed by EOS
    shards/00000/train/offsets    zarr3 int64 [d+1] document j = tokens[offsets[j]:offsets[j+1]]
    shards/00000/validation/...   the same for the shard's held-out documents
    shards/00000/done.json        written last in a shard: its counts and its inputs' content hashes
    metadata.json                 written when every shard is done: the store is complete

Version 1 (before shards) kept one ``train/`` and ``validation/`` pair at the top; it reads as a store of one
shard at the top folder, so stores made before still serve.

The reader (``CorpusStore``) views a split as one stream: the shards' documents in shard order, global token
index t in shard k at t − token_start[k]. Tokens are chunked for random reads (TensorStore zarr3 with the sharding
codec: READ_CHUNK tokens per inner chunk, WRITE_CHUNK per file), so a window reads one or two 128 KiB chunks.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import tensorstore as ts

from hydrahead_jax.data.corpus import CorpusError, TokenizerMismatchError
from hydrahead_jax.data.protocol import TokenizerLike
from hydrahead_jax.storage import is_object_store, run_path, write_text_atomic

STORE_FORMAT = "hydrahead-token-store"
STORE_VERSION = 2
READABLE_VERSIONS = (1, 2)
SPLITS = ("train", "validation")
MANIFEST, METADATA, DONE = "manifest.json", "metadata.json", "done.json"
READ_CHUNK = 1 << 15  # tokens per inner chunk: what one random read decodes (128 KiB)
WRITE_CHUNK = 1 << 22  # tokens per file (zarr3 shard, 16 MiB): what the writer buffers before a write
_MAX_LENGTH = 1 << 40  # the arrays' shape while they are written; cut to the real length at the end


def shard_name(index: int) -> str:
    return f"shards/{index:05d}"


def kvstore(path) -> dict:
    """TensorStore's kvstore spec for a local path or a gs:// / s3:// URL."""
    text = os.fspath(path)
    if is_object_store(text):
        scheme, rest = text.split("://", 1)
        bucket, _, key = rest.partition("/")
        return {"driver": "gcs" if scheme == "gs" else "s3", "bucket": bucket, "path": key.rstrip("/") + "/"}
    return {"driver": "file", "path": text}


def _spec(path) -> dict:
    return {"driver": "zarr3", "kvstore": kvstore(path)}


def tokenizer_identity(tokenizer: TokenizerLike) -> dict:
    return {
        "name": str(tokenizer.name),
        "fingerprint": str(tokenizer.fingerprint),
        "vocab_size": int(tokenizer.vocab_size),
        "eos_id": tokenizer.eos_id,
        "bos_id": tokenizer.bos_id,
    }


def read_json(path) -> dict | None:
    """A JSON file of the store, or None when it is not there."""
    path = run_path(path)
    return json.loads(path.read_text()) if path.exists() else None


def write_json(path, value: dict) -> None:
    write_text_atomic(run_path(path), json.dumps(value, indent=1))


# ------------------------------------------------------------------------------------------------ writing


class ArrayWriter:
    """Appends int values to a new 1-D zarr3 array in WRITE_CHUNK-aligned blocks: memory holds at most one block."""

    def __init__(self, path, dtype: str):
        self._dtype = np.dtype(dtype)
        self._array = ts.open(
            _spec(path),
            create=True,
            delete_existing=True,
            dtype=ts.dtype(dtype),
            shape=[_MAX_LENGTH],
            chunk_layout=ts.ChunkLayout(read_chunk_shape=[READ_CHUNK], write_chunk_shape=[WRITE_CHUNK]),
        ).result()
        self._pending: list[np.ndarray] = []
        self._pending_len = 0
        self.length = 0  # values written or pending

    def append(self, values: np.ndarray) -> None:
        self._pending.append(np.asarray(values, self._dtype))
        self._pending_len += len(values)
        self.length += len(values)
        if self._pending_len >= WRITE_CHUNK:
            self._flush(whole_blocks=True)

    def _flush(self, whole_blocks: bool) -> None:
        if not self._pending_len:
            return
        data = np.concatenate(self._pending)
        keep = data.shape[0] % WRITE_CHUNK if whole_blocks else 0
        start = self.length - data.shape[0]
        head = data[: data.shape[0] - keep]
        if len(head):
            self._array[start : start + len(head)].write(head).result()
        self._pending = [data[len(head) :]] if keep else []
        self._pending_len = keep

    def close(self) -> None:
        """Writes what is pending and cuts the array to its length."""
        self._flush(whole_blocks=False)
        self._array.resize(exclusive_max=[self.length], resize_metadata_only=True).result()


class SplitWriter:
    """One split of one shard: documents appended one at a time (tokens streamed, offsets kept: 8 bytes each)."""

    def __init__(self, folder):
        self._folder = run_path(folder)
        self._tokens = ArrayWriter(self._folder / "tokens", "int32")
        self._lengths: list[int] = []

    def add_documents(self, docs: list[list[int]]) -> None:
        """Appends documents (token id lists, in order)."""
        lengths = [len(d) for d in docs]
        flat = np.concatenate([np.asarray(d, np.int64) for d in docs])
        if flat.size and (flat.min() < 0 or flat.max() >= 2**31):
            raise CorpusError("token ids outside int32 range; the tokenizer returned invalid ids.")
        self._tokens.append(flat.astype(np.int32))
        self._lengths += lengths

    def close(self) -> dict:
        self._tokens.close()
        offsets = ArrayWriter(self._folder / "offsets", "int64")
        offsets.append(np.concatenate([[0], np.cumsum(np.asarray(self._lengths, np.int64))]))
        offsets.close()
        return {"documents": len(self._lengths), "tokens": int(self._tokens.length)}


# ------------------------------------------------------------------------------------------------ metadata


def read_metadata(path) -> dict:
    """A complete store's metadata (refusing an unfinished store or an unknown format, with the fix)."""
    path = run_path(path)
    meta = read_json(path / METADATA)
    if meta is None:
        manifest = read_json(path / MANIFEST)
        if manifest is not None:
            done = sum(1 for i in range(len(manifest["shards"])) if (path / shard_name(i) / DONE).exists())
            raise CorpusError(
                f"{path} is an unfinished token store ({done} of {len(manifest['shards'])} shards done). Fix: rerun "
                f"`python -m hydrahead_jax.data.prepare --out {path} ...` (or train.py) to finish it."
            )
        raise CorpusError(
            f"{path} is not a token store (no {METADATA}); build one with "
            "`python -m hydrahead_jax.data.prepare` or prepare_corpus()."
        )
    if meta.get("format") != STORE_FORMAT or meta.get("version") not in READABLE_VERSIONS:
        raise CorpusError(f"{path}: unsupported store format {meta.get('format')} v{meta.get('version')}.")
    return meta


def check_tokenizer(path, meta: dict, tokenizer: TokenizerLike, fix: str) -> None:
    """Refuse a store built with another tokenizer."""
    have = meta["tokenizer"]
    if have["fingerprint"] != str(tokenizer.fingerprint):
        raise TokenizerMismatchError(
            f"token store {path} was built with tokenizer {have['name']!r} (fingerprint {have['fingerprint'][:16]}), "
            f"not {tokenizer.name!r} (fingerprint {str(tokenizer.fingerprint)[:16]}). Fix: {fix}"
        )


def store_digest(meta: dict) -> str:
    """The content address of a complete store: its identity (the source's, for a version-1 store) and the
    tokenizer's fingerprint; the name of the store's folder in the cache."""
    if meta["version"] == 1:
        return f"{meta['source']['sha256'][:16]}-{meta['tokenizer']['fingerprint'][:16]}"
    return meta["identity"]


def _shard_folders(meta: dict) -> list[str]:
    return [""] if meta["version"] == 1 else [shard_name(i) for i in range(len(meta["shards"]))]


# ------------------------------------------------------------------------------------------------ reading


class CorpusStore:
    """Random access to one split of a token store, all shards as one stream (global token and document indices).

    Offsets always live in memory (8 bytes per document). Tokens are read into memory when they fit in
    ``max_in_memory_bytes`` (fast numpy slicing), else each read goes to TensorStore (a shard's array is opened
    at its first read).
    """

    def __init__(
        self,
        path,
        split: str = "train",
        *,
        tokenizer: TokenizerLike | None = None,
        max_in_memory_bytes: int = 2 << 30,
    ):
        self.path = run_path(path)
        self.metadata = read_metadata(self.path)
        if split not in SPLITS:
            raise CorpusError(f"split must be one of {SPLITS}, not {split!r}.")
        if tokenizer is not None:
            check_tokenizer(
                self.path,
                self.metadata,
                tokenizer,
                "rebuild the store with prepare_corpus(..., rebuild=True) or use the matching tokenizer.",
            )
        self.split = split
        self._folders = [self.path / f / split if f else self.path / split for f in _shard_folders(self.metadata)]
        self.offsets, self._token_starts = self._read_offsets()
        self.num_tokens = int(self.offsets[-1])
        self.num_docs = len(self.offsets) - 1
        self._arrays: dict[int, ts.TensorStore] = {}
        self._lock = threading.Lock()
        self._tokens = None
        if self.num_tokens * 4 <= max_in_memory_bytes:
            self._tokens = np.concatenate(
                [np.zeros([0], np.int32)]
                + [np.asarray(self._array(k)[: self._shard_tokens(k)].read().result()) for k in range(self.shards)]
            ).astype(np.int32)

    @property
    def shards(self) -> int:
        return len(self._folders)

    def _read_offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """Every shard's offsets (read concurrently), joined into global ones; the shards' first global token."""
        futures = [ts.open(_spec(f / "offsets"), open=True).result().read() for f in self._folders]
        parts = [np.asarray(f.result(), np.int64) for f in futures]
        starts = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([int(p[-1]) for p in parts], out=starts[1:])
        offsets = np.concatenate([[0]] + [p[1:] + s for p, s in zip(parts, starts[:-1], strict=True)])
        return offsets.astype(np.int64), starts

    def _shard_tokens(self, k: int) -> int:
        return int(self._token_starts[k + 1] - self._token_starts[k])

    def _array(self, k: int) -> ts.TensorStore:
        with self._lock:  # grain reads rows from several threads
            if k not in self._arrays:
                self._arrays[k] = ts.open(_spec(self._folders[k] / "tokens"), open=True).result()
            return self._arrays[k]

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def eos_id(self) -> int | None:
        return self.metadata["tokenizer"]["eos_id"]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's stream (across shards where the range spans several)."""
        start, stop = max(0, int(start)), min(int(stop), self.num_tokens)
        if self._tokens is not None or stop <= start:
            return (self._tokens if self._tokens is not None else np.zeros([0], np.int32))[start:stop]
        k = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            base, end = int(self._token_starts[k]), min(stop, int(self._token_starts[k + 1]))
            if end > start:
                pieces.append(np.asarray(self._array(k)[start - base : end - base].read().result(), np.int32))
            start, k = end, k + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document(self, index: int) -> np.ndarray:
        return self.read(int(self.offsets[index]), int(self.offsets[index + 1]))

    def __repr__(self):
        return (
            f"CorpusStore({self.path}, split={self.split}, shards={self.shards}, docs={self.num_docs}, "
            f"tokens={self.num_tokens})"
        )
