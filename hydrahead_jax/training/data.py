"""The batch iterator of a stage: the corpus pipeline (``hydrahead_jax.data``) or the seeded copy source.

Both are grain ``DatasetIterator``s, so their position is saved in every checkpoint and a resumed run reads
exactly the batches an uninterrupted one would. Batches: input_ids/targets [B,T] int32, loss_mask [B,T]
float32, segment_ids/positions [B,T] int32 (B = this process's share of the global batch).
"""

from __future__ import annotations

import grain

from hydrahead_jax.data.pipeline import make_train_iterator, resolve_batch_rows, select_batch_rows
from hydrahead_jax.data.rows import CopyRows
from hydrahead_jax.run_config import DataConfig


def make_stage_iterator(
    data: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    vocab_size: int,
    synthetic_rate: float,
    tokenizer=None,
    store_path=None,
    batch_rows=None,
) -> grain.DatasetIterator:
    """Iterator of this process's share of global batches of ``batch_size`` rows for one stage: the rows
    ``batch_rows`` of each global batch (those its devices hold, ``training.sharding.process_batch_rows``;
    ``range(batch_size)``: the whole batch on every process), by default rows p, p+P, ... of process p of P."""
    if data.source == "copy":
        rows = resolve_batch_rows(batch_size, batch_rows, None, None)
        batches = select_batch_rows(
            CopyRows(vocab_size, seq_len, seed=seed, repeats=data.copy_repeats), batch_size, rows
        )
        return batches.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)).__iter__()
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
        batch_rows=batch_rows,
        num_threads=data.num_threads,
        prefetch_buffer_size=data.prefetch,
    )


def prepare_store(data: DataConfig, tokenizer):
    """Token store path of the configured corpus (tokenised once, reused afterwards)."""
    from hydrahead_jax.data.corpus import prepare_corpus  # local: the copy source needs no corpus code

    return prepare_corpus(
        tokenizer,
        data.source,
        validation_fraction=data.validation_fraction,
        txt_split=data.txt_split,
        text_field=data.text_field,
    )
