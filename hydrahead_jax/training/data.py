"""The batch iterator of a stage: the corpus pipeline (``hydrahead_jax.data``) or a seeded synthetic source.

Both are grain ``DatasetIterator``s, so their position is saved in every checkpoint and a resumed run reads
exactly the batches an uninterrupted one would. Batches: input_ids/targets [B,T] int32, loss_mask [B,T]
float32, segment_ids/positions [B,T] int32 (B = this process's share of the global batch).
"""

from __future__ import annotations

import sys

import grain
import numpy as np

from hydrahead_jax.data.pipeline import make_train_iterator, pack_row, resolve_shard


class CopyRows(grain.MapDataset):
    """Row i: a random token block of length ⌈T/r⌉ (seeded by (seed, i)) repeated r times, cut to T+1 tokens.

    The first block is unpredictable; every later token is a copy of the token one block back, so the
    next-token loss can fall well below log V — a test source whose losses visibly move in a few steps.
    """

    def __init__(self, vocab_size: int, seq_len: int, *, seed: int, repeats: int = 4):
        super().__init__()
        self._v, self._t, self._seed, self._r = int(vocab_size), int(seq_len), int(seed), max(1, int(repeats))

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        block = -(-(self._t + 1) // self._r)
        tokens = np.random.default_rng([self._seed, int(index)]).integers(0, self._v, block, dtype=np.int64)
        row = np.tile(tokens, self._r + 1)[: self._t + 1]
        return pack_row(row, np.zeros(self._t + 1, np.int64))


def make_stage_iterator(
    data_cfg,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    vocab_size: int,
    synthetic_rate: float = 0.0,
    tokenizer=None,
    store_path=None,
) -> grain.DatasetIterator:
    """Iterator of this process's share of global batches of ``batch_size`` rows for one stage."""
    if data_cfg.source == "copy":
        shard_index, shard_count = resolve_shard(None, None)
        if batch_size % shard_count:
            raise ValueError(f"global batch_size={batch_size} is not divisible by the {shard_count} processes.")
        rows = CopyRows(vocab_size, seq_len, seed=seed, repeats=data_cfg.get("copy_repeats", 4))
        rows = rows[shard_index::shard_count].batch(batch_size // shard_count, drop_remainder=True)
        return rows.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)).__iter__()
    if store_path is None:
        raise ValueError("the corpus source needs a prepared token store (store_path).")
    return make_train_iterator(
        store_path,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        split="train",
        synthetic_rate=synthetic_rate,
        tokenizer=tokenizer if synthetic_rate > 0 else None,
        num_threads=int(data_cfg.get("num_threads", 2)),
        prefetch_buffer_size=int(data_cfg.get("prefetch", 8)),
    )


def prepare_store(data_cfg, tokenizer):
    """Token store path of the configured corpus (tokenised once, reused afterwards)."""
    from hydrahead_jax.data.corpus import prepare_corpus  # local: the copy source needs no corpus code

    if tokenizer is None:
        raise ValueError(
            f"data.source={data_cfg.source!r} needs a tokenizer; the teacher "
            f"{'has none' if tokenizer is None else ''} — use data.source='copy' for a random teacher."
        )
    return prepare_corpus(
        tokenizer,
        data_cfg.source,
        validation_fraction=float(data_cfg.validation_fraction),
        txt_split=data_cfg.get("txt_split", "file"),
        text_field=data_cfg.get("text_field", "text"),
    )
