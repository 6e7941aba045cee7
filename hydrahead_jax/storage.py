"""Where a run reads and writes: local folders and object-store URLs, made into paths in one place.

Every path of a run — the workdir and all it holds (checkpoints, metrics, TensorBoard, head map, lock, export),
a head map or model read back, evaluation outputs — is made by ``run_path``: a local path becomes an absolute
``pathlib.Path`` (a later ``chdir`` changes nothing), and ``gs://`` and ``s3://`` URLs stay URLs as an
``etils.epath.Path`` (the path type Orbax itself uses), so every host of a cluster run reads and writes the same
objects. epath serves them through fsspec (gcsfs / s3fs); Orbax's arrays go through TensorStore's own GCS/S3
drivers. Code that handles a run's paths uses what both types share (``/``, ``exists``, ``is_dir``, ``iterdir``,
``read_text``/``write_text``, ``open``, ``mkdir``, ``unlink``) and the functions here for the rest.

Object stores differ from a disk in three ways the run relies on, handled here once:
- no rename: a "folder" move is a copy and a delete (``move``), not atomic; the run moves folders only aside (a
  restarted stage, a replaced run), never into a place another process reads meanwhile;
- no append: ``metrics.jsonl`` is rewritten whole at flush points (``training.metrics``);
- an object's upload is atomic, so ``write_text_atomic`` writes it directly (a local file goes through a
  temporary name and ``os.replace``).

A local emulator stands in for GCS in the tests: ``STORAGE_EMULATOR_HOST`` (gcsfs, google-cloud-storage) and
``TENSORSTORE_GCS_HTTP_URL`` (TensorStore) point the clients at it; nothing else changes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from etils import epath

from hydrahead_jax.config import ConfigError

RunPath = Path | epath.Path  # what ``run_path`` returns: a local path or an object-store URL

# scheme -> the fsspec package epath needs for it (TensorStore and Orbax carry their own drivers)
OBJECT_STORE_CLIENTS = {"gs": "gcsfs", "s3": "s3fs"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")


def is_object_store(path) -> bool:
    """Whether ``path`` (a str or path) is an object-store URL (gs://, s3://)."""
    return os.fspath(path).split("://", 1)[0] in OBJECT_STORE_CLIENTS and "://" in os.fspath(path)


def run_path(path, *, what: str = "path") -> RunPath:
    """``path`` as the run reads and writes it: an object-store URL stays a URL, a local path becomes absolute.

    A scheme other than gs:// and s3://, a URL written with one slash (``gs:/bucket``) or a URL whose client
    package is missing is refused in one line naming ``what`` (e.g. ``--workdir``) and the fix."""
    text = os.fspath(path)
    match = _URL.match(text)
    if match is None:
        return Path(os.path.abspath(text))
    scheme = match.group(1).lower()
    if scheme not in OBJECT_STORE_CLIENTS:
        raise ConfigError(
            f"{what} {text}: the {scheme}:// scheme is not supported; use a local path, gs://BUCKET/PATH or "
            "s3://BUCKET/PATH."
        )
    if not text.startswith(f"{scheme}://") or len(text) <= len(scheme) + 3:
        raise ConfigError(f"{what} {text} is not a complete URL; write it as {scheme}://BUCKET/PATH.")
    client = OBJECT_STORE_CLIENTS[scheme]
    if importlib.util.find_spec(client) is None:
        raise ConfigError(f"{what} {text} needs the {client} package for {scheme}:// paths; pip install {client}.")
    return epath.Path(text)


def write_text_atomic(path, text: str) -> None:
    """Replace ``path``'s content with ``text`` so a reader sees the old or the new content, never a part: a
    local file through a temporary name and ``os.replace``, an object in one upload (objects are atomic)."""
    if is_object_store(path):
        path.write_text(text)
        return
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def move(src, dst) -> None:
    """Move a file or folder (a rename on a disk; a copy and a delete on an object store, where a folder exists
    only as the prefix of its objects, so ``dst``'s parent need not exist)."""
    if is_object_store(src):
        import fsspec

        fs, _ = fsspec.core.url_to_fs(os.fspath(src))
        fs.mv(os.fspath(src), os.fspath(dst), recursive=True)
    else:
        shutil.move(os.fspath(src), os.fspath(dst))


def remove_tree(path) -> None:
    """Delete a folder and everything in it (nothing when it is not there)."""
    if is_object_store(path):
        if path.exists():
            path.rmtree()
    else:
        shutil.rmtree(path, ignore_errors=True)


def file_size(path) -> int:
    """A file's size in bytes (epath's ``stat`` names it ``length``, pathlib's ``st_size``)."""
    info = path.stat()
    return info.length if hasattr(info, "length") else info.st_size


@contextlib.contextmanager
def local_mirror(url: str) -> Iterator[Path]:
    """A temporary local folder standing in for the object-store folder ``url``, for a writer that appends to and
    renames its files (eval.py's journal): filled with ``url``'s objects on entry, every file written back on exit,
    error or not (a process killed meanwhile loses what it wrote since entry; rerunning resumes from what is in the
    bucket)."""
    remote = run_path(url)
    with tempfile.TemporaryDirectory(prefix="hydrahead-mirror-") as tmp:
        local = Path(tmp)
        if remote.exists():
            for obj in files_under(remote):
                dst = local / os.fspath(obj)[len(os.fspath(remote)) + 1 :]
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(obj.read_bytes())
        try:
            yield local
        finally:
            for file in sorted(p for p in local.rglob("*") if p.is_file()):
                (remote / file.relative_to(local).as_posix()).write_bytes(file.read_bytes())


def files_under(folder) -> list:
    """Every file below ``folder``, sorted (epath refuses ``rglob`` on object stores, and fsspec's ``walk`` names
    objects without their scheme, so the folders are listed one by one)."""
    found, pending = [], [folder]
    while pending:
        for entry in pending.pop().iterdir():
            (pending if entry.is_dir() else found).append(entry)
    return sorted(found, key=os.fspath)
