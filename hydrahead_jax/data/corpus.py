"""The default corpus (the Wikipedia extract and held-out news text inside the gensim wheel), the cache folder, and
the corpus errors.

Preparing a corpus into a token store: ``preparation.py`` (the step; ``prepare.py``, its command line),
``sources.py`` (inputs and their readers), ``store.py`` (the layout and the reader, ``CorpusStore``).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from hydrahead_jax.data.wiki import iter_wiki_articles

GENSIM_VERSION = "4.4.0"
ENWIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE_MEMBER = "gensim/test/test_data/lee_background.cor"
# Bump when the wiki cleaner changes what text it produces: part of the default source's hash.
WIKI_CLEANER_VERSION = 1


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


def read_wheel_member(member: str, cache: str | Path | None) -> bytes:
    wheel = fetch_gensim_wheel(cache)
    with zipfile.ZipFile(wheel) as z:
        try:
            return z.read(member)
        except KeyError:
            raise CorpusError(f"{wheel} has no {member}; the file may be corrupt. Delete it and retry.") from None


def load_enwiki_documents(cache: str | Path | None = None) -> list[str]:
    """The ~106 cleaned articles (title line, blank line, body) of the shortened Wikipedia dump."""
    return [text for _, text in iter_wiki_articles(read_wheel_member(ENWIKI_MEMBER, cache))]


def load_heldout_text(cache: str | Path | None = None) -> str:
    """`lee_background.cor` (news prose, one story per line): held-out evaluation text only."""
    return decode_utf8(read_wheel_member(LEE_MEMBER, cache), "lee_background.cor").strip()


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as UTF-8, or a CorpusError naming ``where``, the offset and the fix."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(
            f"{where}: bytes at offset {e.start} are not valid UTF-8 ({e.reason}: {data[e.start : e.start + 4]!r}). "
            "Fix: re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
        ) from None


# ----------------------------------------------------------------------------------------------
# Preparation and the store live in their own modules (preparation.py, store.py, sources.py); their names are
# reachable from here too, as they were when this module held them.

_MOVED = {
    "prepare_corpus": "preparation",
    "resolve_source": "preparation",
    "check_source": "preparation",
    "default_store_path": "preparation",
    "Source": "preparation",
    "CorpusStore": "store",
    "read_metadata": "store",
    "SPLITS": "store",
    "STORE_FORMAT": "store",
    "STORE_VERSION": "store",
}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f"hydrahead_jax.data.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
