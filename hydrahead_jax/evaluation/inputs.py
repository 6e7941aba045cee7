"""The seeded inputs every model sees: synthetic retrieval prompts, held-out text streams, efficiency prompts.

Inputs are built per tokenizer (models that share a tokenizer get identical ids) from the same seeds and
texts, and memoised so several models reuse them.

Seeds: sample ``i`` of any cell uses seed ``base_seed + i``; the same seed at another length or depth draws the
same needle value and haystack start, so cells differ only in length and depth.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hydrahead_jax.data import synthetic
from hydrahead_jax.data.protocol import encode_document

# suite name → synthetic task name
RETRIEVAL_TASKS = {
    "niah": "niah_single",
    "passkey": "passkey",
    "multikey": "niah_multikey",
    "multivalue": "niah_multivalue",
    "kv": "kv_retrieval",
    "vt": "variable_tracking",
}
# tasks whose needle depth is a grid axis (a heatmap); the others spread their samples evenly over depth
DEPTH_GRID_TASKS = ("niah",)


def tokenizer_key(tok) -> str:
    return str(getattr(tok, "fingerprint", None) or f"{type(tok).__name__}@{id(tok)}")


def sample_depths(n: int) -> list[float]:
    """Evenly spread depths (i + ½)/n for tasks that do not sweep depth."""
    return [(i + 0.5) / n for i in range(n)]


def _read_text(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist.")
    return path.read_text(encoding="utf-8")


class Inputs:
    """Memoised, seeded evaluation inputs.

    haystack: path of a text file used as filler (default: the Wikipedia extract of the corpus).
    texts: held-out text sources for perplexity and agreement, name → path of a .txt file. Default: the corpus
        validation split (``wiki-val``, token store of the model's tokenizer) and ``news`` (lee_background.cor).
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        haystack: str | None = None,
        texts: dict[str, str] | None = None,
        needle_type: str = "number",
        corpus: dict | None = None,
    ):
        self.seed = seed
        self.haystack_path = haystack
        self.text_paths = dict(texts) if texts else None
        # the training corpus and its validation split settings (from an export's train_config.json), so the
        # validation documents are exactly the ones training held out
        self.corpus = {
            "source": "enwiki",
            "validation_fraction": 0.02,
            "txt_split": "file",
            "text_field": "text",
            **(corpus or {}),
        }
        self.needle_type = needle_type
        self._haystacks: dict = {}
        self._streams: dict = {}
        self._examples: dict = {}

    # -- retrieval prompts ---------------------------------------------------------------------------------

    def haystack(self, tok) -> synthetic.Haystack:
        key = tokenizer_key(tok)
        if key not in self._haystacks:
            if self.haystack_path is not None:
                texts: Sequence[str] = [_read_text(self.haystack_path)]
            else:
                from hydrahead_jax.data import load_enwiki_documents

                texts = load_enwiki_documents()
            self._haystacks[key] = synthetic.Haystack(texts, tok)
        return self._haystacks[key]

    def example(self, task: str, tok, *, length: int, sample: int, depth: float) -> synthetic.SyntheticExample:
        """Sample ``sample`` of suite task ``task`` at ``length`` tokens with its needle at ``depth``."""
        key = (task, tokenizer_key(tok), length, sample, depth)
        if key not in self._examples:
            options = {"depth": depth}
            if task in ("niah", "multikey", "multivalue"):
                options["needle_type"] = self.needle_type
            self._examples[key] = synthetic.generate(
                RETRIEVAL_TASKS[task], tok, self.haystack(tok), length=length, seed=self.seed + sample, **options
            )
        return self._examples[key]

    # -- held-out text -------------------------------------------------------------------------------------

    def source_names(self) -> list[str]:
        if self.text_paths:
            return list(self.text_paths)
        return ["wiki-val" if self.corpus["source"] == "enwiki" else "corpus-val", "news"]

    def stream(self, name: str, tok) -> np.ndarray:
        """Token ids int32 [N] of held-out source ``name``: a text file (and ``news``) as one document, the corpus
        validation split as its token store holds it (documents joined by EOS); each document opens with the
        tokenizer's BOS where it adds one (``encode_document``), so the first window starts as a document does."""
        key = (name, tokenizer_key(tok))
        if key not in self._streams:
            self._streams[key] = self._load_stream(name, tok)
        return self._streams[key]

    def _load_stream(self, name: str, tok) -> np.ndarray:
        if self.text_paths:
            return np.asarray(encode_document(tok, _read_text(self.text_paths[name])), np.int32)
        if name == "news":
            from hydrahead_jax.data import load_heldout_text

            return np.asarray(encode_document(tok, load_heldout_text()), np.int32)
        if name in ("wiki-val", "corpus-val"):
            from hydrahead_jax.data import CorpusStore, prepare_corpus

            c = self.corpus
            store = CorpusStore(
                prepare_corpus(
                    tok,
                    c["source"],
                    validation_fraction=float(c["validation_fraction"]),
                    txt_split=c["txt_split"],
                    text_field=c["text_field"],
                ),
                "validation",
            )
            return np.asarray(store.read(0, store.num_tokens), np.int32)
        raise KeyError(f"unknown text source {name!r}")

    def windows(self, name: str, tok, length: int, count: int) -> tuple[list[np.ndarray], int]:
        """Up to ``count`` consecutive non-overlapping windows of ``length`` tokens from the start of the source,
        and the source's size in tokens."""
        ids = self.stream(name, tok)
        n = min(count, len(ids) // length)
        return [ids[i * length : (i + 1) * length] for i in range(n)], len(ids)

    # -- efficiency ----------------------------------------------------------------------------------------

    def random_prompt(self, length: int, vocab_size: int) -> np.ndarray:
        """Seeded random ids [1, length] below ``vocab_size`` (timing does not depend on what the tokens say)."""
        rng = np.random.default_rng([self.seed, length])
        return rng.integers(0, vocab_size, (1, length), dtype=np.int64).astype(np.int32)
