"""Stage-3 mixture: packed corpus rows with seeded synthetic retrieval rows mixed in at a given rate.

Row i of `SyntheticRows` depends only on (seed, i): the task, its options and the example seed are drawn
from a generator seeded with both, so the mixture stays random access, deterministic, and its iterator
state is still one integer (grain's `MapDataset.mix` interleaves by a fixed integer pattern).
"""

from __future__ import annotations

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
    """`rows` (corpus) and synthetic rows interleaved so that a fraction `rate` is synthetic.

    The haystack defaults to the store's own text. With a finite corpus the mixture ends when the
    corpus rows are used up, so an epoch still sees every corpus row once.
    """
    if not 0.0 < rate < 1.0:
        raise ValueError(f"synthetic rate must be in (0, 1), not {rate}.")
    haystack = haystack or Haystack.from_store(store, tokenizer)
    synthetic = SyntheticRows(tokenizer, haystack, seq_len=seq_len, seed=seed, tasks=tasks, loss=loss, length=len(rows))
    return grain.MapDataset.mix([rows, synthetic], weights=[1.0 - rate, rate])
