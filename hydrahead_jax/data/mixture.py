"""Weighted mixtures of row sources: corpus stores by weight, and seeded synthetic retrieval rows at a rate.

A stage reads one or more corpus sources (``WeightedStore``: a token store, its weight, the shortest document it
contributes) and, at ``synthetic_rate`` > 0, synthetic retrieval rows as one more source: the corpus sources share
1 − rate in proportion to their weights, the synthetic rows take rate. ``mix_sources`` interleaves them with
grain's ``MapDataset.mix``, a fixed integer pattern (each weight scaled so the smallest is 100, truncated): row i's
source and its index there are functions of i alone, so the mixture stays random access, deterministic, and its
iterator state one integer. Over any n consecutive rows a source of proportion p gives n·p rows up to the pattern's
rounding (``source_counts`` counts them): never more spread than a random draw per row, whose count would vary by
√(n·p·(1 − p)).

Row i of ``SyntheticRows`` depends only on (seed, i): the task, its options and the example seed are drawn from a
generator seeded with both.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import grain
import numpy as np

from hydrahead_jax.data.protocol import TokenizerLike
from hydrahead_jax.data.rows import pack_row
from hydrahead_jax.data.synthetic import NEEDLE_TYPES, TASKS, Haystack, SyntheticExample, generate

DEFAULT_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "passkey", "kv_retrieval", "variable_tracking")
_ROW_SALT = 0x5E7_7A5C


def synthetic_row(
    ex: SyntheticExample, seq_len: int, *, loss: str = "answer", pad_id: int = 0
) -> dict[str, np.ndarray]:
    """A training row from one example (prompt ‖ answer, padded to seq_len + 1 tokens).

    loss="answer": loss_mask is 1 only where the target is an answer token; loss="full": on every
    next-token transition inside the example. Padding is segment 0 with loss 0.
    """
    if loss not in ("answer", "full"):
        raise ValueError(f"synthetic loss must be 'answer' or 'full', not {loss!r}.")
    content = np.concatenate([ex.prompt_ids, ex.answer_ids]).astype(np.int32)
    if len(content) > seq_len + 1:
        raise ValueError(f"example of {len(content)} tokens does not fit seq_len + 1 = {seq_len + 1}.")
    tokens = np.full(seq_len + 1, pad_id, np.int32)
    tokens[: len(content)] = content
    doc_ids = np.full(seq_len + 1, -1, np.int64)
    doc_ids[: len(content)] = 0
    row = pack_row(tokens, doc_ids)
    if loss == "answer":
        # target t is tokens[t + 1]: answer tokens sit at [P, P + A), so t in [P - 1, P + A - 1)
        p, a = len(ex.prompt_ids), len(ex.answer_ids)
        mask = np.zeros(seq_len, np.float32)
        mask[p - 1 : p + a - 1] = 1.0
        row["loss_mask"] = mask
    return row


class SyntheticRows(grain.MapDataset):
    """Random-access synthetic rows of exactly seq_len (prompt + answer fill seq_len + 1 tokens)."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        haystack: Haystack,
        *,
        seq_len: int,
        seed: int,
        tasks: Sequence[str] | None = None,
        loss: str = "answer",
        length: int = sys.maxsize,
        pad_id: int | None = None,
    ):
        super().__init__()
        self._tasks = tuple(tasks or DEFAULT_TASKS)
        unknown = [t for t in self._tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown synthetic tasks {unknown}; choose from {sorted(TASKS)}.")
        if loss not in ("answer", "full"):
            raise ValueError(f"synthetic loss must be 'answer' or 'full', not {loss!r}.")
        self._tok, self._hay, self._seq_len, self._seed = tokenizer, haystack, int(seq_len), int(seed)
        self._loss, self._len = loss, int(length)
        eos = tokenizer.eos_id
        self._pad_id = int(pad_id if pad_id is not None else (eos if eos is not None else 0))

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        return f"SyntheticRows(tasks={self._tasks}, seq_len={self._seq_len})"

    def example(self, index: int) -> SyntheticExample:
        rng = np.random.default_rng([self._seed, int(index), _ROW_SALT])
        task = self._tasks[int(rng.integers(len(self._tasks)))]
        options = {}
        if task.startswith("niah"):
            options["needle_type"] = NEEDLE_TYPES[int(rng.integers(len(NEEDLE_TYPES)))]
        return generate(
            task,
            self._tok,
            self._hay,
            length=self._seq_len + 1,
            seed=int(rng.integers(2**31)),
            depth=float(rng.uniform()),
            count_answer=True,
            **options,
        )

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return synthetic_row(self.example(index), self._seq_len, loss=self._loss, pad_id=self._pad_id)


@dataclasses.dataclass(frozen=True)
class WeightedStore:
    """A prepared token store as one source of a mixture: its weight, the shortest document (in tokens) it
    contributes (0: all), and the name its row counts are logged under."""

    path: object
    weight: float = 1.0
    min_doc_tokens: int = 0
    name: str = ""


def mix_sources(parts: Sequence[grain.MapDataset], weights: Sequence[float]) -> grain.MapDataset:
    """``parts`` interleaved by ``weights`` (see the module doc); one part is returned as it is."""
    if len(parts) != len(weights) or not parts:
        raise ValueError(f"{len(parts)} sources and {len(weights)} weights: one weight per source.")
    if any(not w > 0 for w in weights):
        raise ValueError(f"mixture weights must be > 0, not {list(weights)}.")
    return parts[0] if len(parts) == 1 else grain.MapDataset.mix(list(parts), weights=list(weights))


class _Label(grain.MapDataset):
    """A source that yields its own index: mixed like the real sources, it tells which source each row is from."""

    def __init__(self, label: int, length: int):
        super().__init__()
        self._label, self._len = label, length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        return self.slice(index) if isinstance(index, slice) else self._label


def source_counts(weights: Sequence[float], start: int, stop: int) -> list[int]:
    """How many of the mixture's rows [start, stop) each source gives (``mix_sources``' pattern, read for those
    rows, no data touched)."""
    labels = mix_sources([_Label(i, sys.maxsize) for i in range(len(weights))], weights)
    counts = [0] * len(weights)
    for i in range(start, stop):
        counts[labels[i]] += 1
    return counts


def synthetic_weights(weights: Sequence[float], rate: float) -> list[float]:
    """The corpus sources' weights scaled to share 1 − ``rate``, then ``rate`` for the synthetic rows (none when
    rate is 0)."""
    total = float(sum(weights))
    scaled = [(1.0 - rate) * w / total for w in weights]
    return scaled + [rate] if rate > 0 else scaled


def mix_synthetic(
    rows: grain.MapDataset,
    store,
    tokenizer: TokenizerLike,
    *,
    seq_len: int,
    seed: int,
    rate: float,
    tasks: Sequence[str] | None = None,
    loss: str = "answer",
    haystack: Haystack | None = None,
) -> grain.MapDataset:
    """`rows` (corpus) and synthetic rows interleaved so that a fraction `rate` is synthetic (``mix_sources``)."""
    if not 0.0 < rate < 1.0:
        raise ValueError(f"synthetic rate must be in (0, 1), not {rate}.")
    synthetic = synthetic_source(
        rows, store, tokenizer, seq_len=seq_len, seed=seed, tasks=tasks, loss=loss, haystack=haystack
    )
    return mix_sources([rows, synthetic], synthetic_weights([1.0], rate))


def synthetic_source(
    rows: grain.MapDataset,
    store,
    tokenizer: TokenizerLike,
    *,
    seq_len: int,
    seed: int,
    tasks: Sequence[str] | None = None,
    loss: str = "answer",
    haystack: Haystack | None = None,
) -> SyntheticRows:
    """The synthetic rows beside corpus ``rows``: as many as they (with a finite corpus the mixture ends when the
    corpus rows are used up, so an epoch still sees every corpus row once); the haystack defaults to ``store``'s
    own text."""
    haystack = haystack or Haystack.from_store(store, tokenizer)
    return SyntheticRows(tokenizer, haystack, seq_len=seq_len, seed=seed, tasks=tasks, loss=loss, length=len(rows))
