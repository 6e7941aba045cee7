"""Data: corpus token stores, grain pipelines, synthetic long-context tasks, the training row format."""

from hydrahead_jax.data.corpus import (
    CorpusError,
    TokenizerMismatchError,
    cache_dir,
    fetch_gensim_wheel,
    load_enwiki_documents,
    load_heldout_text,
)
from hydrahead_jax.data.mixture import SyntheticRows, mix_synthetic, synthetic_row
from hydrahead_jax.data.pipeline import Documents, PackedWindows, make_dataset, make_train_iterator
from hydrahead_jax.data.preparation import prepare_corpus, resolve_source
from hydrahead_jax.data.protocol import TokenizerLike, check_tokenizer
from hydrahead_jax.data.rows import CopyRows, pack_row
from hydrahead_jax.data.store import CorpusStore, read_metadata
from hydrahead_jax.data.synthetic import TASKS, Haystack, SyntheticExample, generate
from hydrahead_jax.data.wiki import clean_wiki_markup

__all__ = [
    "CorpusError",
    "CorpusStore",
    "TokenizerMismatchError",
    "cache_dir",
    "fetch_gensim_wheel",
    "load_enwiki_documents",
    "load_heldout_text",
    "prepare_corpus",
    "read_metadata",
    "resolve_source",
    "SyntheticRows",
    "mix_synthetic",
    "synthetic_row",
    "Documents",
    "PackedWindows",
    "make_dataset",
    "make_train_iterator",
    "pack_row",
    "CopyRows",
    "TokenizerLike",
    "check_tokenizer",
    "TASKS",
    "Haystack",
    "SyntheticExample",
    "generate",
    "clean_wiki_markup",
]
