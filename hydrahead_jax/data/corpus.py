"""Corpus preparation: documents from the default Wikipedia extract or a user's files, tokenised once
into a TensorStore token store.

Store layout (one folder)::

    metadata.json            tokenizer identity, source description + hash, split settings, counts
    train/tokens             zarr3 int32 [num_tokens]   all train documents back to back, each opened by the
                                                        tokenizer's document start (Llama 3: BOS; SmolLM2: none)
                                                        and closed by EOS
    train/offsets            zarr3 int64 [num_docs + 1] document d = tokens[offsets[d]:offsets[d+1]]
    validation/tokens, validation/offsets   the same for the held-out documents

The split is by document (seeded), so no document leaks across it. The folder is written under a
temporary name and renamed into place, so a crash never leaves a half-written store; re-running with
the same inputs and tokenizer reuses it; a store built with another tokenizer is refused.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import tensorstore as ts

from hydrahead_jax.data.protocol import TokenizerLike, encode_documents
from hydrahead_jax.data.wiki import iter_wiki_articles

STORE_FORMAT = "hydrahead-token-store"
STORE_VERSION = 1
GENSIM_VERSION = "4.4.0"
ENWIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE_MEMBER = "gensim/test/test_data/lee_background.cor"
# Bump when the wiki cleaner changes what text it produces: part of the default source's hash.
WIKI_CLEANER_VERSION = 1
SPLITS = ("train", "validation")


class CorpusError(ValueError):
    """A corpus source or token store cannot be used as given; the message says why and what to do."""


class TokenizerMismatchError(CorpusError):
    """The token store on disk was built with a different tokenizer."""


def cache_dir() -> Path:
    """`$HYDRAHEAD_CACHE`, else `~/.cache/hydrahead_jax`."""
    return Path(os.environ.get("HYDRAHEAD_CACHE") or Path.home() / ".cache" / "hydrahead_jax")


# ----------------------------------------------------------------------------------------------
# The default corpus: the gensim wheel's test data (never installed or imported, only read as a zip).


def fetch_gensim_wheel(cache: str | Path | None = None) -> Path:
    """Path of a gensim 4.4.0 wheel in `cache`, downloading it with pip (no deps, binary only) if absent."""
    cache = Path(cache) if cache is not None else cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(glob.glob(str(cache / f"gensim-{GENSIM_VERSION}-*.whl")))
    if found:
        return Path(found[0])
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"gensim=={GENSIM_VERSION}",
        "-d",
        str(cache),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(glob.glob(str(cache / f"gensim-{GENSIM_VERSION}-*.whl")))
    if proc.returncode != 0 or not found:
        raise CorpusError(
            f"could not download the gensim {GENSIM_VERSION} wheel (it carries the default corpus) with "
            f"`{' '.join(cmd)}`:\n{proc.stderr[-2000:]}\nFix: make PyPI reachable, or copy a "
            f"gensim-{GENSIM_VERSION}-*.whl into {cache} (or set $HYDRAHEAD_CACHE), or pass your own files."
        )
    return Path(found[0])


def _read_wheel_member(member: str, cache: str | Path | None) -> bytes:
    wheel = fetch_gensim_wheel(cache)
    with zipfile.ZipFile(wheel) as z:
        try:
            return z.read(member)
        except KeyError:
            raise CorpusError(f"{wheel} has no {member}; the file may be corrupt. Delete it and retry.") from None


def load_enwiki_documents(cache: str | Path | None = None) -> list[str]:
    """The ~106 cleaned articles (title line, blank line, body) of the shortened Wikipedia dump."""
    return [text for _, text in iter_wiki_articles(_read_wheel_member(ENWIKI_MEMBER, cache))]


def load_heldout_text(cache: str | Path | None = None) -> str:
    """`lee_background.cor` (news prose, one story per line): held-out evaluation text only."""
    return _decode_utf8(_read_wheel_member(LEE_MEMBER, cache), "lee_background.cor").strip()


# ----------------------------------------------------------------------------------------------
# User sources.


@dataclasses.dataclass
class Source:
    """A resolved corpus source: a description, a hash of its raw bytes + options, and a document reader."""

    description: str
    sha256: str
    read_documents: Callable[[], list[str]]


def _decode_utf8(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(
            f"{name}: bytes at offset {e.start} are not valid UTF-8 ({e.reason}: {data[e.start : e.start + 4]!r}). "
            "Fix: re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
        ) from None


def _read_text_file(path: Path) -> str:
    data = path.read_bytes()
    text = _decode_utf8(data, str(path))
    if not text.strip():
        raise CorpusError(f"{path} is empty (no text): remove it from the corpus sources.")
    return text


def _txt_documents(path: Path, txt_split: str) -> list[str]:
    text = _read_text_file(path)
    if txt_split == "file":
        return [text.strip()]
    # "paragraphs": documents separated by one or more blank lines.
    return [d.strip() for d in _split_blank_lines(text) if d.strip()]


def _split_blank_lines(text: str) -> list[str]:
    docs, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line)
        elif cur:
            docs.append("\n".join(cur))
            cur = []
    if cur:
        docs.append("\n".join(cur))
    return docs


def _jsonl_documents(path: Path, text_field: str) -> list[str]:
    text = _read_text_file(path)
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}, line {lineno}: not valid JSON ({e.msg}).") from None
        if not isinstance(record, dict) or text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise CorpusError(
                f"{path}, line {lineno}: no field {text_field!r} (found {keys}). "
                "Fix: pass text_field=<the field holding the text>."
            )
        value = record[text_field]
        if not isinstance(value, str):
            raise CorpusError(f"{path}, line {lineno}: field {text_field!r} is {type(value).__name__}, not a string.")
        if value.strip():  # empty records are common in real dumps; they carry no tokens, so skip them
            docs.append(value)
    if not docs:
        raise CorpusError(f"{path} holds no non-empty {text_field!r} values.")
    return docs


def _parquet_documents(path: Path, text_field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise CorpusError("reading Parquet needs pyarrow: `pip install pyarrow`.") from None
    if path.stat().st_size == 0:
        raise CorpusError(f"{path} is empty (0 bytes): remove it from the corpus sources.")
    try:
        names = pq.read_schema(path).names
    except Exception as e:  # pyarrow raises ArrowInvalid for non-Parquet bytes
        raise CorpusError(f"{path} is not a readable Parquet file: {e}") from None
    if text_field not in names:
        raise CorpusError(
            f"{path}: no column {text_field!r} (columns: {names}). Fix: pass text_field=<the column holding the text>."
        )
    column = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    docs = [v for v in column if isinstance(v, str) and v.strip()]
    if not docs:
        raise CorpusError(f"{path}: column {text_field!r} holds no non-empty strings.")
    return docs


_READERS = {".txt": "txt", ".text": "txt", ".md": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def _expand_paths(source: str | Path | Sequence[str | Path]) -> list[Path]:
    items = [source] if isinstance(source, (str, Path)) else list(source)
    paths: list[Path] = []
    for item in items:
        p = Path(item).expanduser()
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in _READERS)
            if not found:
                raise CorpusError(f"{p} holds no .txt/.jsonl/.parquet files.")
            paths.extend(found)
        elif p.is_file():
            if p.suffix.lower() not in _READERS:
                raise CorpusError(f"{p}: unknown corpus file type {p.suffix!r}; use .txt, .jsonl or .parquet.")
            paths.append(p)
        else:
            raise CorpusError(f"corpus source {p} does not exist.")
    return paths


def check_source(source: str | Path | Sequence[str | Path]) -> None:
    """Refuse a corpus source that does not exist or holds no readable files, without reading any text (the
    check a run makes before any work; "enwiki" is built in)."""
    if not (isinstance(source, str) and source == "enwiki"):
        _expand_paths(source)


def resolve_source(
    source: str | Path | Sequence[str | Path] = "enwiki",
    *,
    text_field: str = "text",
    txt_split: str = "file",
    cache: str | Path | None = None,
) -> Source:
    """Turns a source spec into a `Source`.

    `source`: "enwiki" (the default Wikipedia extract), a file (.txt, .jsonl, .parquet), a folder of
    them, or a list of those. `txt_split`: "file" (a .txt file is one document) or "paragraphs"
    (blank-line-separated documents). `text_field`: the JSONL field / Parquet column with the text.
    """
    if txt_split not in ("file", "paragraphs"):
        raise CorpusError(f"txt_split must be 'file' or 'paragraphs', not {txt_split!r}.")
    if isinstance(source, str) and source == "enwiki":
        raw = _read_wheel_member(ENWIKI_MEMBER, cache)
        h = hashlib.sha256(raw)
        h.update(f"wiki-cleaner-v{WIKI_CLEANER_VERSION}".encode())
        return Source(
            f"enwiki extract from gensim-{GENSIM_VERSION} ({ENWIKI_MEMBER.rsplit('/', 1)[-1]})",
            h.hexdigest(),
            lambda: [text for _, text in iter_wiki_articles(raw)],
        )
    paths = _expand_paths(source)
    h = hashlib.sha256(f"text_field={text_field};txt_split={txt_split}".encode())
    for p in paths:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)

    def read() -> list[str]:
        docs: list[str] = []
        for p in paths:
            kind = _READERS[p.suffix.lower()]
            if kind == "txt":
                docs.extend(_txt_documents(p, txt_split))
            elif kind == "jsonl":
                docs.extend(_jsonl_documents(p, text_field))
            else:
                docs.extend(_parquet_documents(p, text_field))
        return docs

    desc = ", ".join(str(p) for p in paths[:5]) + (f" (+{len(paths) - 5} more)" if len(paths) > 5 else "")
    return Source(desc, h.hexdigest(), read)


# ----------------------------------------------------------------------------------------------
# The token store.


def _ts_spec(path: Path) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}


def _write_array(path: Path, array: np.ndarray) -> None:
    chunk = int(max(1, min(len(array), 1 << 20)))
    store = ts.open(
        _ts_spec(path),
        create=True,
        dtype=ts.dtype(array.dtype.name),
        shape=[len(array)],
        chunk_layout=ts.ChunkLayout(write_chunk_shape=[chunk]),
    ).result()
    if len(array):
        store.write(array).result()


def _tokenizer_identity(tokenizer: TokenizerLike) -> dict:
    return {
        "name": str(tokenizer.name),
        "fingerprint": str(tokenizer.fingerprint),
        "vocab_size": int(tokenizer.vocab_size),
        "eos_id": tokenizer.eos_id,
        "bos_id": tokenizer.bos_id,
    }


def _tokenize(
    docs: list[str], tokenizer: TokenizerLike, append_eos: bool, batch_docs: int
) -> tuple[np.ndarray, np.ndarray]:
    """Flat int32 tokens and int64 offsets [len(docs)+1]: each document as ``encode_document`` gives it (BOS first
    for a tokenizer that adds one), EOS after it when asked."""
    chunks, lengths = [], []
    eos = [int(tokenizer.eos_id)] if append_eos else []
    for i in range(0, len(docs), batch_docs):
        for ids in encode_documents(tokenizer, docs[i : i + batch_docs]):
            arr = np.asarray(ids + eos, dtype=np.int64)
            chunks.append(arr)
            lengths.append(len(arr))
    tokens = np.concatenate(chunks) if chunks else np.zeros([0], np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**31):
        raise CorpusError("token ids outside int32 range; the tokenizer returned invalid ids.")
    offsets = np.zeros([len(lengths) + 1], np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return tokens.astype(np.int32), offsets


def default_store_path(source: Source, tokenizer: TokenizerLike, cache: str | Path | None = None) -> Path:
    base = Path(cache) if cache is not None else cache_dir()
    return base / "corpora" / f"{source.sha256[:16]}-{str(tokenizer.fingerprint)[:16]}"


def _check_existing(path: Path, source: Source, tokenizer: TokenizerLike, settings: dict) -> dict:
    meta = read_metadata(path)
    have = meta["tokenizer"]
    if have["fingerprint"] != str(tokenizer.fingerprint):
        raise TokenizerMismatchError(
            f"token store {path} was built with tokenizer {have['name']!r} (fingerprint {have['fingerprint'][:16]}), "
            f"not {tokenizer.name!r} (fingerprint {str(tokenizer.fingerprint)[:16]}). Fix: pass rebuild=True to "
            "re-tokenise into it, or use another out_dir."
        )
    if meta["source"]["sha256"] != source.sha256 or meta["settings"] != settings:
        raise CorpusError(
            f"token store {path} was built from other inputs or settings ({meta['source']['description']}, "
            f"{meta['settings']}). Fix: pass rebuild=True, or use another out_dir."
        )
    return meta


def prepare_corpus(
    tokenizer: TokenizerLike,
    source: str | Path | Sequence[str | Path] = "enwiki",
    *,
    out_dir: str | Path | None = None,
    validation_fraction: float = 0.02,
    split_seed: int = 0,
    text_field: str = "text",
    txt_split: str = "file",
    append_eos: bool = True,
    rebuild: bool = False,
    cache: str | Path | None = None,
    batch_docs: int = 64,
) -> Path:
    """Tokenises `source` once into a token store and returns its path (reusing a matching store).

    Validation holds max(1, round(validation_fraction * num_docs)) documents chosen by `split_seed`
    (none when validation_fraction == 0). Each document starts as the tokenizer starts one (Llama 3: with its BOS,
    as transformers' ``add_special_tokens=True`` does; the store's name then differs through the tokenizer's
    fingerprint) and gets the tokenizer's EOS appended, so packed sequences can tell document boundaries apart and
    the model learns to end documents.
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise CorpusError(f"validation_fraction must be in [0, 1), not {validation_fraction}.")
    if append_eos and tokenizer.eos_id is None:
        raise CorpusError(f"tokenizer {tokenizer.name!r} has no EOS id; pass append_eos=False or fix the tokenizer.")
    src = resolve_source(source, text_field=text_field, txt_split=txt_split, cache=cache)
    out = Path(out_dir) if out_dir is not None else default_store_path(src, tokenizer, cache)
    settings = {"validation_fraction": validation_fraction, "split_seed": split_seed, "append_eos": append_eos}
    if (out / "metadata.json").exists() and not rebuild:
        _check_existing(out, src, tokenizer, settings)
        return out
    if out.exists() and not rebuild and any(out.iterdir()):
        raise CorpusError(f"{out} exists and is not a token store; choose another out_dir.")

    docs = src.read_documents()
    if not docs:
        raise CorpusError(f"source {src.description} yielded no documents.")
    n = len(docs)
    n_val = 0 if validation_fraction == 0 else max(1, int(round(validation_fraction * n)))
    if n_val >= n:
        raise CorpusError(
            f"{n} document(s) is too few for a validation split of {validation_fraction}; "
            "add documents or pass validation_fraction=0."
        )
    perm = np.random.default_rng(split_seed).permutation(n)
    members = {"validation": np.sort(perm[:n_val]), "train": np.sort(perm[n_val:])}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        counts = {}
        for split in SPLITS:
            tokens, offsets = _tokenize([docs[i] for i in members[split]], tokenizer, append_eos, batch_docs)
            _write_array(tmp / split / "tokens", tokens)
            _write_array(tmp / split / "offsets", offsets)
            counts[split] = {"documents": int(len(offsets) - 1), "tokens": int(len(tokens))}
        meta = {
            "format": STORE_FORMAT,
            "version": STORE_VERSION,
            "tokenizer": _tokenizer_identity(tokenizer),
            "source": {"description": src.description, "sha256": src.sha256},
            "settings": settings,
            "splits": counts,
            "validation_documents": [int(i) for i in members["validation"]],
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2))
        if out.exists():  # rebuild (or an empty folder): move the old one aside, then swap in
            trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, trash)
            os.rename(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            try:
                os.rename(tmp, out)
            except OSError:
                # Another process finished the same store first: use theirs if it matches.
                shutil.rmtree(tmp, ignore_errors=True)
                _check_existing(out, src, tokenizer, settings)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_metadata(path: str | Path) -> dict:
    path = Path(path)
    try:
        meta = json.loads((path / "metadata.json").read_text())
    except FileNotFoundError:
        raise CorpusError(f"{path} is not a token store (no metadata.json); build one with prepare_corpus().") from None
    if meta.get("format") != STORE_FORMAT or meta.get("version") != STORE_VERSION:
        raise CorpusError(f"{path}: unsupported store format {meta.get('format')} v{meta.get('version')}.")
    return meta


class CorpusStore:
    """Random access to one split of a token store.

    Offsets always live in memory (8 bytes per document). Tokens are read into memory when they fit
    in `max_in_memory_bytes` (fast numpy slicing), else each read goes to TensorStore.
    """

    def __init__(
        self,
        path: str | Path,
        split: str = "train",
        *,
        tokenizer: TokenizerLike | None = None,
        max_in_memory_bytes: int = 2 << 30,
    ):
        self.path = Path(path)
        self.metadata = read_metadata(self.path)
        if split not in SPLITS:
            raise CorpusError(f"split must be one of {SPLITS}, not {split!r}.")
        if tokenizer is not None and str(tokenizer.fingerprint) != self.metadata["tokenizer"]["fingerprint"]:
            have = self.metadata["tokenizer"]
            raise TokenizerMismatchError(
                f"token store {self.path} was built with tokenizer {have['name']!r} (fingerprint "
                f"{have['fingerprint'][:16]}), but tokenizer {tokenizer.name!r} was given. Fix: rebuild the store "
                "with prepare_corpus(..., rebuild=True) or use the matching tokenizer."
            )
        self.split = split
        self.offsets = ts.open(_ts_spec(self.path / split / "offsets"), open=True).result().read().result()
        self.offsets = np.asarray(self.offsets, np.int64)
        self._ts_tokens = ts.open(_ts_spec(self.path / split / "tokens"), open=True).result()
        self.num_tokens = int(self._ts_tokens.shape[0])
        self.num_docs = len(self.offsets) - 1
        self._tokens = None
        if self.num_tokens * 4 <= max_in_memory_bytes:
            self._tokens = np.asarray(self._ts_tokens.read().result(), np.int32)

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def eos_id(self) -> int | None:
        return self.metadata["tokenizer"]["eos_id"]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the flat array."""
        if self._tokens is not None:
            return self._tokens[start:stop]
        return np.asarray(self._ts_tokens[start:stop].read().result(), np.int32)

    def document(self, index: int) -> np.ndarray:
        return self.read(int(self.offsets[index]), int(self.offsets[index + 1]))

    def __repr__(self):
        return f"CorpusStore({self.path}, split={self.split}, docs={self.num_docs}, tokens={self.num_tokens})"
