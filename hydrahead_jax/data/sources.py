"""Corpus inputs: the files a source names, and each file's documents read as a stream.

A source is the built-in Wikipedia extract ("enwiki"), a file, a folder (every file below it), a glob
(``data/*.jsonl.zst``), a ``gs://`` / ``s3://`` URL of any of those, or a list of them. Every path goes through the
path layer (``storage.run_path``). The kind of a file is its suffix:

    .txt .text .md           one document per file (txt_split="file") or per blank-line-separated paragraph
    .jsonl .json             one JSON object per line; the document is its ``text_field``
    .jsonl.gz .jsonl.zst     the same, gzip / zstandard compressed (read as a stream)
    .parquet                 the column ``text_field``, read one record batch at a time
    .arrow                   Arrow IPC stream files, as ``datasets.Dataset.save_to_disk`` writes them
                             (data-00000-of-0000N.arrow next to state.json and dataset_info.json)

A folder holding another kind of file is refused, naming the file: a silently skipped file is data the run never
sees. Hidden files (a leading ".") are skipped, as are the two JSON descriptions next to a ``save_to_disk`` folder's
.arrow files. Empty records (an empty ``text_field``) carry no tokens and are skipped; a file with no document at
all is an error.

Each input is listed with its size and modification time (no byte is read): the store's manifest records them, and
a restarted preparation compares them instead of re-reading the corpus.
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from hydrahead_jax.data import corpus
from hydrahead_jax.data.corpus import CorpusError, decode_utf8
from hydrahead_jax.storage import file_size, is_object_store, run_path

KINDS = {
    ".jsonl.zst": "jsonl.zst",
    ".jsonl.gz": "jsonl.gz",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".txt": "txt",
    ".text": "txt",
    ".md": "txt",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
ENWIKI = "enwiki"
# The files ``datasets.Dataset.save_to_disk`` writes beside its .arrow files: descriptions, not documents.
_ARROW_DATASET_FILES = ("state.json", "dataset_info.json")
_GLOB_CHARS = "*?["


@dataclasses.dataclass(frozen=True)
class InputFile:
    """One input of a source. ``name``: its path below the source's root (the manifest's key, so a corpus mounted
    elsewhere is the same corpus); ``mtime``: None where the storage gives none."""

    name: str
    path: str
    size: int
    mtime: float | None
    kind: str

    def listing(self) -> dict:
        """What the manifest records of it, and what a restart compares."""
        return {"name": self.name, "size": self.size, "mtime": self.mtime}


def file_kind(name: str) -> str | None:
    """The reader a file name asks for (its longest known suffix), or None."""
    lower = name.lower()
    return next((kind for suffix, kind in KINDS.items() if lower.endswith(suffix)), None)


def _known_kinds() -> str:
    return ", ".join(KINDS)


def _stat(path) -> tuple[int, float | None]:
    """(size, mtime) of a file: an object store gives its update time where its client reports one."""
    if is_object_store(path):
        info = path.stat()
        mtime = getattr(info, "mtime", None)
        return file_size(path), (float(mtime) if isinstance(mtime, (int, float)) else None)
    info = os.stat(path)
    return info.st_size, info.st_mtime


def _input(path, name: str) -> InputFile:
    kind = file_kind(os.fspath(path))
    if kind is None:
        suffix = os.path.splitext(os.fspath(path))[1]
        raise CorpusError(
            f"{os.fspath(path)}: unknown corpus file type {suffix!r}; the readers take {_known_kinds()}. Fix: remove "
            "or convert the file, or name only the files to read (a glob such as DIR/*.jsonl.zst)."
        )
    size, mtime = _stat(path)
    return InputFile(name, os.fspath(path), size, mtime, kind)


def _sort_key(relative: str) -> tuple[str, ...]:
    return tuple(relative.split("/"))  # folders' parts in order, as pathlib sorts them


def _folder_inputs(root) -> list[InputFile]:
    from hydrahead_jax.storage import files_under  # local: keeps the import list short for the reader functions

    found = []
    base = os.fspath(root).rstrip("/")
    for path in files_under(root):
        relative = os.fspath(path)[len(base) + 1 :]
        if any(part.startswith(".") for part in relative.split("/")):
            continue
        if relative.split("/")[-1] in _ARROW_DATASET_FILES and (path.parent / "state.json").exists():
            continue
        if relative.split("/")[-1] == "dataset_dict.json":
            raise CorpusError(
                f"{os.fspath(path.parent)} is a datasets DatasetDict folder (several splits). Fix: name one split's "
                f"folder, e.g. {os.fspath(path.parent / 'train')}."
            )
        found.append(_input(path, relative))
    if not found:
        raise CorpusError(f"{os.fspath(root)} holds no corpus files ({_known_kinds()}).")
    return sorted(found, key=lambda f: _sort_key(f.name))


def _glob_inputs(pattern: str) -> list[InputFile]:
    """Files matching a glob; names below the pattern's longest folder without a wildcard."""
    prefix = pattern[: min(pattern.find(c) for c in _GLOB_CHARS if c in pattern)]
    root = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    if is_object_store(pattern):
        import fsspec

        fs, _ = fsspec.core.url_to_fs(pattern)
        scheme = pattern.split("://", 1)[0]
        matches = [f"{scheme}://{m}" for m in fs.glob(pattern) if not fs.isdir(m)]
    else:
        matches = [m for m in globlib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(m)]
        root = os.path.expanduser(root)
    if not matches:
        raise CorpusError(f"corpus source {pattern} matches no file.")
    inputs = [_input(run_path(m), m[len(root) + 1 :] if root else m) for m in matches]
    return sorted(inputs, key=lambda f: _sort_key(f.name))


def _item_inputs(item: str | os.PathLike) -> list[InputFile]:
    text = os.path.expanduser(os.fspath(item))
    if any(c in text for c in _GLOB_CHARS):
        return _glob_inputs(text)
    path = run_path(text, what="corpus source")
    if path.is_dir():
        return _folder_inputs(path)
    if path.exists():
        return [_input(path, path.name)]
    raise CorpusError(f"corpus source {text} does not exist.")


def enwiki_input(cache: str | Path | None = None) -> InputFile:
    """The built-in Wikipedia extract (a member of the gensim wheel) as one input; its "mtime" is its content
    hash (with the cleaner's version), which is also the store's identity, as before stores had manifests."""
    raw = corpus.read_wheel_member(corpus.ENWIKI_MEMBER, cache)
    return InputFile(corpus.ENWIKI_MEMBER.rsplit("/", 1)[-1], ENWIKI, len(raw), None, ENWIKI)


def list_inputs(source: str | os.PathLike | Sequence[str | os.PathLike], cache=None) -> list[InputFile]:
    """The inputs of ``source`` in reading order (stat only, no byte read); an error names a missing or unknown
    file. A list of several items prefixes each item's names with its position (``0/…``, ``1/…``). ``cache``: where
    the built-in extract's wheel is (default: the cache folder)."""
    if isinstance(source, str) and source == ENWIKI:
        return [enwiki_input(cache)]
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not items:
        raise CorpusError("the corpus source is an empty list; name at least one file or folder.")
    if len(items) == 1:
        return _item_inputs(items[0])
    out = []
    for i, item in enumerate(items):
        out += [dataclasses.replace(f, name=f"{i}/{f.name}") for f in _item_inputs(item)]
    return out


# ------------------------------------------------------------------------------------------------ reading


def _open(inp: InputFile):
    return run_path(inp.path).open("rb")


def content_sha256(inp: InputFile, cache: str | Path | None = None) -> str:
    """sha256 of an input's bytes (one sequential read; the enwiki extract's includes the cleaner's version)."""
    h = hashlib.sha256()
    if inp.kind == ENWIKI:
        h.update(corpus.read_wheel_member(corpus.ENWIKI_MEMBER, cache))
        h.update(f"wiki-cleaner-v{corpus.WIKI_CLEANER_VERSION}".encode())
        return h.hexdigest()
    with _open(inp) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _split_blank_lines(text: str) -> Iterator[str]:
    cur: list[str] = []
    for line in text.splitlines():
        if line.strip():
            cur.append(line)
        elif cur:
            yield "\n".join(cur)
            cur = []
    if cur:
        yield "\n".join(cur)


def _txt_documents(inp: InputFile, txt_split: str) -> Iterator[str]:
    """A text file is one document (or its paragraphs): read whole, so at most one file's text is in memory."""
    with _open(inp) as f:
        text = decode_utf8(f.read(), inp.path)
    if not text.strip():
        raise CorpusError(f"{inp.path} is empty (no text): remove it from the corpus sources.")
    if txt_split == "file":
        yield text.strip()
    else:
        yield from (d.strip() for d in _split_blank_lines(text) if d.strip())


def _binary_lines(inp: InputFile, f) -> Iterator[bytes]:
    if inp.kind == "jsonl.gz":
        yield from gzip.GzipFile(fileobj=f)
    elif inp.kind == "jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise CorpusError(f"{inp.path}: reading .zst files needs zstandard: pip install zstandard") from None
        yield from io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f), 1 << 20)
    else:
        yield from f


def _record_text(record, inp: InputFile, lineno: int, text_field: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise CorpusError(
            f"{inp.path}, line {lineno}: no field {text_field!r} (found {keys}). "
            "Fix: pass text_field=<the field holding the text>."
        )
    value = record[text_field]
    if not isinstance(value, str):
        raise CorpusError(f"{inp.path}, line {lineno}: field {text_field!r} is {type(value).__name__}, not a string.")
    return value


def _jsonl_documents(inp: InputFile, text_field: str) -> Iterator[str]:
    with _open(inp) as f:
        for lineno, raw in enumerate(_binary_lines(inp, f), 1):
            line = decode_utf8(raw, f"{inp.path}, line {lineno}")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{inp.path}, line {lineno}: not valid JSON ({e.msg}).") from None
            value = _record_text(record, inp, lineno, text_field)
            if value.strip():  # empty records are common in real dumps; they carry no tokens, so skip them
                yield value


def _column_documents(inp: InputFile, batches, names: list[str], text_field: str) -> Iterator[str]:
    """The non-empty strings of column ``text_field`` of a stream of Arrow record batches."""
    if text_field not in names:
        raise CorpusError(
            f"{inp.path}: no column {text_field!r} (columns: {names}). Fix: pass text_field=<the column holding the "
            "text>."
        )
    for batch in batches:
        for value in batch.column(text_field).to_pylist():
            if isinstance(value, str) and value.strip():
                yield value


def _parquet_documents(inp: InputFile, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    if inp.size == 0:
        raise CorpusError(f"{inp.path} is empty (0 bytes): remove it from the corpus sources.")
    with _open(inp) as f:
        try:
            reader = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises ArrowInvalid for non-Parquet bytes
            raise CorpusError(f"{inp.path} is not a readable Parquet file: {e}") from None
        names = reader.schema_arrow.names
        columns = [text_field] if text_field in names else None
        yield from _column_documents(inp, reader.iter_batches(batch_size=1024, columns=columns), names, text_field)


def _arrow_documents(inp: InputFile, text_field: str) -> Iterator[str]:
    import pyarrow as pa

    with _open(inp) as f:
        try:
            reader = pa.ipc.open_stream(f)
        except Exception as e:
            raise CorpusError(
                f"{inp.path} is not an Arrow IPC stream (the format datasets' save_to_disk writes): {e}"
            ) from None
        yield from _column_documents(inp, reader, reader.schema.names, text_field)


def _enwiki_documents(cache) -> Iterator[str]:
    from hydrahead_jax.data.wiki import iter_wiki_articles

    yield from (text for _, text in iter_wiki_articles(corpus.read_wheel_member(corpus.ENWIKI_MEMBER, cache)))


def iter_documents(inp: InputFile, *, text_field: str = "text", txt_split: str = "file", cache=None) -> Iterator[str]:
    """The documents of one input, in file order, one at a time (a file with none is an error)."""
    if inp.kind == ENWIKI:
        docs = _enwiki_documents(cache)
    elif inp.kind == "txt":
        docs = _txt_documents(inp, txt_split)
    elif inp.kind == "parquet":
        docs = _parquet_documents(inp, text_field)
    elif inp.kind == "arrow":
        docs = _arrow_documents(inp, text_field)
    else:
        docs = _jsonl_documents(inp, text_field)
    empty = True
    try:
        for doc in docs:
            empty = False
            yield doc
    except CorpusError:
        raise
    except Exception as err:  # a damaged file: a decompressor's or Arrow's own error, named with the file here
        raise CorpusError(
            f"{inp.path} is not a readable {inp.kind} file ({type(err).__name__}: {err}). Fix: replace the file, or "
            "remove it from the corpus."
        ) from None
    if empty:
        what = "documents" if inp.kind in ("txt", ENWIKI) else f"non-empty {text_field!r} values"
        raise CorpusError(f"{inp.path} holds no {what}.")
