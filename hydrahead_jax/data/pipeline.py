"""grain pipelines over a token store: random-access packed windows, shuffling, per-process slicing,
batching and an exactly resumable iterator.

Packing ("concatenate then split", random access)
-------------------------------------------------
Epoch e orders the documents by a permutation π_e (seeded by (seed, e)) and views them as one stream
S_e = doc[π_e(0)] ‖ doc[π_e(1)] ‖ ... of N tokens (each document ends in EOS). Window w of the epoch is

    input_ids = S_e[wT : wT + T],      targets = S_e[wT + 1 : wT + T + 1]

so every stream token is an input exactly once per epoch. A second seeded permutation σ_e orders the
windows, so consecutive rows do not come from the same long document. Element i of the (infinite or
`num_epochs`-long) dataset is window σ_e(i mod W) of epoch e = i div W, computed from i alone: that is
what makes the dataset random access and the iterator state a single integer.

Within a row, documents are marked with segment ids 1, 2, ... (0 = padding), positions restart at 0
at each document start and at the row start (each row is attended independently), and
loss_mask[t] = 1 only when input t and target t belong to the same document (so the EOS → next
document transition and padding are not trained). The tail of an epoch, N mod T tokens, is dropped
(`drop_tail=True`, default) or emitted as one padded row.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import grain
import numpy as np

from hydrahead_jax.data.mixture import WeightedStore, mix_sources, synthetic_source, synthetic_weights
from hydrahead_jax.data.protocol import TokenizerLike
from hydrahead_jax.data.rows import pack_row
from hydrahead_jax.data.store import CorpusStore

_DOC_SALT, _WINDOW_SALT = 0x5EED_D0C5, 0x5EED_3140


class PackedWindows(grain.MapDataset):
    """Random-access packed rows of `seq_len` tokens over one split of a token store (see module doc)."""

    def __init__(
        self,
        store: CorpusStore,
        seq_len: int,
        *,
        seed: int,
        num_epochs: int | None = None,
        shuffle: bool = True,
        drop_tail: bool = True,
        pad_id: int | None = None,
        min_doc_tokens: int = 0,
    ):
        super().__init__()
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, not {seq_len}.")
        self._store, self._seq_len, self._seed = store, int(seq_len), int(seed)
        self._shuffle, self._drop_tail = shuffle, drop_tail
        self._documents = _long_documents(store, min_doc_tokens)
        self._lengths = store.doc_lengths if self._documents is None else store.doc_lengths[self._documents]
        n = int(self._lengths.sum())
        self._stream_len = n
        self.windows_per_epoch = n // seq_len if drop_tail else -(-n // seq_len)
        if self.windows_per_epoch == 0:
            raise ValueError(
                f"split {store.split!r} of {store.path} has {n} tokens, fewer than one row of "
                f"seq_len={seq_len}; use a shorter seq_len or a larger corpus."
            )
        self._num_epochs = num_epochs
        self._len = sys.maxsize if num_epochs is None else self.windows_per_epoch * int(num_epochs)
        eos = store.eos_id
        self._pad_id = int(pad_id if pad_id is not None else (eos if eos is not None else 0))
        self._orders: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        return f"PackedWindows(seq_len={self._seq_len}, windows_per_epoch={self.windows_per_epoch})"

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order π_e, cumulative stream offsets of that order, window order σ_e), cached."""
        with self._lock:  # grain reads rows from several threads
            cached = self._orders.get(epoch)
            if cached is None:
                cached = self._orders[epoch] = self._compute_epoch_order(epoch)
                if len(self._orders) > 4:  # epochs are visited in order; keep a few (threads may straddle one)
                    self._orders.pop(min(self._orders))
            return cached

    def _compute_epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n_docs = len(self._lengths)
        if self._shuffle:
            doc_order = np.random.default_rng([self._seed, epoch, _DOC_SALT]).permutation(n_docs)
            win_order = np.random.default_rng([self._seed, epoch, _WINDOW_SALT]).permutation(self.windows_per_epoch)
        else:
            doc_order, win_order = np.arange(n_docs), np.arange(self.windows_per_epoch)
        cum = np.zeros(n_docs + 1, np.int64)
        np.cumsum(self._lengths[doc_order], out=cum[1:])
        return doc_order, cum, win_order

    def window(self, epoch: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        """T+1 tokens of stream window `window` of `epoch` and their document ids (-1 past the stream end)."""
        doc_order, cum, _ = self._epoch_order(epoch)
        start = window * self._seq_len
        stop = min(start + self._seq_len + 1, self._stream_len)
        tokens = np.full(self._seq_len + 1, self._pad_id, np.int32)
        doc_ids = np.full(self._seq_len + 1, -1, np.int64)
        k = int(np.searchsorted(cum, start, side="right")) - 1
        pos = start
        while pos < stop:
            d = int(doc_order[k]) if self._documents is None else int(self._documents[doc_order[k]])
            take = min(stop, int(cum[k + 1])) - pos
            begin = int(self._store.offsets[d]) + (pos - int(cum[k]))
            tokens[pos - start : pos - start + take] = self._store.read(begin, begin + take)
            doc_ids[pos - start : pos - start + take] = d
            pos += take
            k += 1
        return tokens, doc_ids

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self}")
        epoch, i = divmod(int(index), self.windows_per_epoch)
        _, _, win_order = self._epoch_order(epoch)
        return pack_row(*self.window(epoch, int(win_order[i])))


def _long_documents(store: CorpusStore, min_doc_tokens: int) -> np.ndarray | None:
    """The documents of at least ``min_doc_tokens`` tokens (None: all of them, no filter)."""
    if min_doc_tokens <= 0:
        return None
    lengths = store.doc_lengths
    kept = np.flatnonzero(lengths >= min_doc_tokens)
    if not len(kept):
        longest = int(lengths.max()) if len(lengths) else 0
        raise ValueError(
            f"split {store.split!r} of {store.path} has no document of min_doc_tokens={min_doc_tokens} tokens or "
            f"more (the longest has {longest}); lower min_doc_tokens or use a corpus of longer documents."
        )
    return kept


class Documents(grain.MapDataset):
    """Random access to whole documents of a split: {"tokens": int32 [len], "document": int}."""

    def __init__(self, store: CorpusStore):
        super().__init__()
        self._store = store

    def __len__(self) -> int:
        return self._store.num_docs

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return {"tokens": self._store.document(int(index)), "document": int(index)}


def resolve_shard(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
    """(index, count) of this process's slice; defaults to jax.process_index()/process_count()."""
    if shard_index is None or shard_count is None:
        import jax  # pylint: disable=import-outside-toplevel

        shard_index = jax.process_index() if shard_index is None else shard_index
        shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, {shard_count}), not {shard_index}.")
    return int(shard_index), int(shard_count)


def resolve_batch_rows(
    batch_size: int,
    batch_rows: Sequence[int] | None,
    shard_index: int | None,
    shard_count: int | None,
) -> tuple[int, ...]:
    """The rows of every global batch this process reads, sorted.

    ``batch_rows`` given: those rows (a multi-process run passes the rows its devices hold,
    ``training.sharding.process_batch_rows``; ``range(batch_size)``: every process reads the whole batch).
    Otherwise process p of P reads rows p, p+P, p+2P, ... (``shard_index``/``shard_count``, by default
    ``jax.process_index()``/``process_count()``)."""
    if batch_rows is None:
        index, count = resolve_shard(shard_index, shard_count)
        if batch_size % count:
            raise ValueError(f"global batch_size={batch_size} is not divisible by the {count} processes.")
        return tuple(range(index, batch_size, count))
    rows = tuple(sorted(int(r) for r in batch_rows))
    if not rows or len(set(rows)) != len(rows) or rows[0] < 0 or rows[-1] >= batch_size:
        raise ValueError(
            f"batch_rows={list(batch_rows)} must be distinct rows of a global batch of {batch_size}, at least one."
        )
    return rows


class BatchRows(grain.MapDataset):
    """The rows ``rows`` of every global batch of ``batch_size`` consecutive elements of ``parent``:

        element i  =  parent[(i div b) · batch_size + rows[i mod b]],   b = len(rows)

    so ``.batch(b)`` gives this process's share of the global step-s batch, parent[s·B : (s+1)·B], and the
    shares of all processes together are exactly the single-process batch. Random access, no state of its own:
    the iterator's position stays one integer (exact resume)."""

    def __init__(self, parent: grain.MapDataset, batch_size: int, rows: Sequence[int]):
        super().__init__(parent)
        self._batch_size, self._rows = int(batch_size), tuple(rows)
        self._len = len(parent) // self._batch_size * len(self._rows)

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        return f"BatchRows(batch_size={self._batch_size}, rows={self._rows})"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        step, j = divmod(int(index), len(self._rows))
        return self._parent[step * self._batch_size + self._rows[j]]


def select_batch_rows(
    rows: grain.MapDataset, batch_size: int, batch_rows: tuple[int, ...], start_batch: int = 0
) -> grain.MapDataset:
    """Batches of this process's ``batch_rows`` of each global batch of ``batch_size`` (see ``BatchRows``), from
    global batch ``start_batch`` on: a position counted in global batches names the same global rows whichever
    rows of them this process reads, so a resume on another number of processes continues where the run stopped."""
    if start_batch < 0:
        raise ValueError(f"start_batch must be >= 0, not {start_batch}.")
    if batch_rows == tuple(range(batch_size)):
        batches = rows.batch(batch_size, drop_remainder=True)
    else:
        batches = BatchRows(rows, batch_size, batch_rows).batch(len(batch_rows), drop_remainder=True)
    return batches[start_batch:] if start_batch else batches


def make_train_iterator(store_path, **options) -> grain.DatasetIterator:
    """A checkpointable iterator of batches {input_ids, targets, loss_mask, segment_ids, positions}
    (``make_dataset``'s arguments).

    `batch_size` is the GLOBAL batch: process p of P gets rows p, p+P, p+2P, ... of the global row
    sequence, batch_size // P of them per step, so the union of all processes' step-s batches is exactly
    the single-process step-s batch; `batch_rows` names the rows of each global batch this process reads
    instead (see `resolve_batch_rows`: a multi-process run reads the rows its devices hold). `start_batch`: the
    first global batch read (a resumed run's position, `select_batch_rows`). Save/restore the iterator with
    `get_state()`/`set_state()` or Orbax `grain.checkpoint.CheckpointSave/CheckpointRestore`; it resumes at
    exactly the next batch.
    """
    return make_dataset(store_path, **options).__iter__()


def weighted_stores(store_path) -> list[WeightedStore]:
    """A store path, or a sequence of ``WeightedStore``s, as the list of a mixture's sources."""
    if isinstance(store_path, (list, tuple)):
        return list(store_path)
    return [WeightedStore(store_path)]


def corpus_sources(
    store_path,
    split: str,
    *,
    seq_len: int,
    seed: int,
    tokenizer: TokenizerLike | None = None,
    **windows,
) -> tuple[list[PackedWindows], list[CorpusStore], list[float]]:
    """The packed rows of each source of ``store_path`` (source i seeded seed + i·1000003, so one source reads as
    it always did), their stores and weights; ``windows``: PackedWindows' options."""
    sources = weighted_stores(store_path)
    stores = [CorpusStore(s.path, split, tokenizer=tokenizer) for s in sources]
    rows = [
        PackedWindows(store, seq_len, seed=seed + i * 1_000_003, min_doc_tokens=s.min_doc_tokens, **windows)
        for i, (s, store) in enumerate(zip(sources, stores, strict=True))
    ]
    return rows, stores, [float(s.weight) for s in sources]


def make_dataset(
    store_path,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    split: str = "train",
    num_epochs: int | None = None,
    shard_index: int | None = None,
    shard_count: int | None = None,
    batch_rows: Sequence[int] | None = None,
    start_batch: int = 0,
    synthetic_rate: float = 0.0,
    synthetic_tasks: Sequence[str] | None = None,
    synthetic_loss: str = "answer",
    tokenizer: TokenizerLike | None = None,
    shuffle: bool = True,
    drop_tail: bool = True,
    num_threads: int = 2,
    prefetch_buffer_size: int = 16,
) -> grain.IterDataset:
    """The `grain.IterDataset` behind `make_train_iterator`.

    ``store_path``: one token store, or a sequence of ``mixture.WeightedStore`` mixed by weight. `synthetic_rate`
    > 0 mixes seeded synthetic retrieval rows in as one more source taking that fraction (needs `tokenizer`; the
    haystack is the first store's text; see `mixture.py`)."""
    if not 0 <= synthetic_rate < 1:
        raise ValueError(f"synthetic_rate must be in [0, 1), not {synthetic_rate}.")
    if synthetic_rate > 0 and tokenizer is None:
        raise ValueError("synthetic_rate > 0 needs the tokenizer (to build the synthetic prompts).")
    batch_rows = resolve_batch_rows(batch_size, batch_rows, shard_index, shard_count)
    windows = dict(num_epochs=num_epochs, shuffle=shuffle, drop_tail=drop_tail)
    parts, stores, weights = corpus_sources(
        store_path, split, seq_len=seq_len, seed=seed, tokenizer=tokenizer, **windows
    )
    if synthetic_rate > 0:
        corpus = mix_sources(parts, weights)
        parts = parts + [
            synthetic_source(
                corpus, stores[0], tokenizer, seq_len=seq_len, seed=seed, tasks=synthetic_tasks, loss=synthetic_loss
            )
        ]
    rows = mix_sources(parts, synthetic_weights(weights, synthetic_rate))
    batches = select_batch_rows(rows, batch_size, batch_rows, start_batch)
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size)
    return batches.to_iter_dataset(options)
