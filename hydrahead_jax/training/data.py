"""The batch iterator of a stage: the corpus pipeline (``hydrahead_jax.data``) or the seeded copy source.

Both are grain ``DatasetIterator``s, so their position is saved in every checkpoint and a resumed run reads
exactly the batches an uninterrupted one would. Batches: input_ids/targets [B,T] int32, loss_mask [B,T]
float32, segment_ids/positions [B,T] int32 (B = this process's share of the global batch).
"""

from __future__ import annotations

import grain
import numpy as np

from hydrahead_jax.config import ConfigError
from hydrahead_jax.data.pipeline import make_train_iterator, resolve_batch_rows, select_batch_rows
from hydrahead_jax.data.rows import FEATURES, CopyRows
from hydrahead_jax.run_config import DataConfig

# Held-out copy rows of the stage at index i use seed run.seed + HELDOUT_SEED_OFFSET + i, and the evaluation rows of
# experiments.compare run.seed + HELDOUT_SEED_OFFSET + EVAL_SEED_INDEX: far from every seed a training iterator or
# the calibration batch uses (run.seed + 1000·(i+1), run.seed + 7919).
HELDOUT_SEED_OFFSET = 104_729
EVAL_SEED_INDEX = 100


def make_stage_iterator(
    data: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    vocab_size: int,
    synthetic_rate: float,
    synthetic_loss: str = "answer",
    tokenizer=None,
    store_path=None,
    batch_rows=None,
) -> grain.DatasetIterator:
    """Iterator of this process's share of global batches of ``batch_size`` rows for one stage: the rows
    ``batch_rows`` of each global batch (those its devices hold, ``training.sharding.process_batch_rows``;
    ``range(batch_size)``: the whole batch on every process), by default rows p, p+P, ... of process p of P.
    ``synthetic_rate`` > 0 mixes that fraction of synthetic retrieval rows in, with loss on their answer tokens or on
    the whole row (``synthetic_loss``, ``data.mixture.synthetic_row``)."""
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
        synthetic_loss=synthetic_loss,
        tokenizer=tokenizer if synthetic_rate > 0 else None,
        batch_rows=batch_rows,
        num_threads=data.num_threads,
        prefetch_buffer_size=data.prefetch,
    )


def make_heldout_batch(
    data: DataConfig,
    *,
    seq_len: int,
    rows: int,
    seed: int,
    vocab_size: int,
    store_path=None,
    config_key: str = "stage",
) -> dict[str, np.ndarray]:
    """The fixed held-out batch of a stage, whole ([rows, seq_len] per feature, the training batches' format).

    Corpus sources: the first ``rows`` packed windows of the VALIDATION split (documents training never sees) in
    the split's seeded window order; ``copy``: ``CopyRows`` rows 0 … rows−1 of ``seed``. A function of its
    arguments alone (no iterator state), so every run, every resume and every process reads the same rows.
    No synthetic retrieval rows are mixed in. ``config_key`` (stage1 …) names the stage's section in an error."""
    off = f"--config.{config_key}.heldout_rows=0"
    if data.source == "copy":
        source = CopyRows(vocab_size, seq_len, seed=seed, repeats=data.copy_repeats)
    else:
        from hydrahead_jax.data.corpus import CorpusStore  # local: the copy source needs no corpus code
        from hydrahead_jax.data.pipeline import PackedWindows

        if store_path is None:
            raise ValueError("the corpus source needs a prepared token store (store_path).")
        store = CorpusStore(store_path, "validation")
        if store.num_docs == 0:
            raise ConfigError(
                f"config.{config_key}.heldout_rows={rows} reads the corpus validation split, which is empty "
                f"(config.data.validation_fraction={data.validation_fraction}). Fix: "
                f"--config.data.validation_fraction=0.02 (a new run), or {off}."
            )
        if store.num_tokens < seq_len:
            raise ConfigError(
                f"config.{config_key}.heldout_rows={rows}: the corpus validation split holds {store.num_tokens} "
                f"tokens, fewer than one row of seq_len={seq_len}. Fix: a larger validation_fraction or corpus, "
                f"or {off}."
            )
        source = PackedWindows(store, seq_len, seed=seed)
    examples = [source[i] for i in range(rows)]
    return {k: np.stack([e[k] for e in examples]) for k in FEATURES}


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
