"""The batch iterator of a stage: the corpus pipeline (``hydrahead_jax.data``) or the seeded copy source.

Both are random access over the stage's global row sequence, so a stage's data position is one number, the global
batches read (``DataPosition``), saved in every checkpoint: a resumed run, on any number of processes, reads
exactly the batches an uninterrupted one would. Batches: input_ids/targets [B,T] int32, loss_mask [B,T]
float32, segment_ids/positions [B,T] int32 (B = this process's share of the global batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

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
    start_batch: int = 0,
) -> grain.DatasetIterator:
    """Iterator of this process's share of global batches of ``batch_size`` rows for one stage, from global batch
    ``start_batch`` on (a resumed stage's ``DataPosition.batches``): the rows
    ``batch_rows`` of each global batch (those its devices hold, ``training.sharding.process_batch_rows``;
    ``range(batch_size)``: the whole batch on every process), by default rows p, p+P, ... of process p of P.
    ``synthetic_rate`` > 0 mixes that fraction of synthetic retrieval rows in, with loss on their answer tokens or on
    the whole row (``synthetic_loss``, ``data.mixture.synthetic_row``)."""
    if data.source == "copy":
        rows = resolve_batch_rows(batch_size, batch_rows, None, None)
        batches = select_batch_rows(
            CopyRows(vocab_size, seq_len, seed=seed, repeats=data.copy_repeats), batch_size, rows, start_batch
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
        start_batch=start_batch,
        num_threads=data.num_threads,
        prefetch_buffer_size=data.prefetch,
    )


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """How far a stage has read its data: ``batches`` whole global batches of ``batch_size`` rows, i.e. rows
    0 … batches·batch_size − 1 of the stage's global row sequence.

    Global, not per process: each process reads its own rows of every global batch (``batch_rows``), so one
    position continues the same global rows on any number of processes and any mesh (``make_stage_iterator``'s
    ``start_batch``). A checkpoint's meta holds it under ``META_KEY``."""

    batches: int
    batch_size: int
    META_KEY: ClassVar[str] = "data_position"

    def to_json(self) -> dict[str, int]:
        return {"global_batches": int(self.batches), "global_batch_size": int(self.batch_size)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> DataPosition | None:
        """The position a checkpoint's meta holds; None for a checkpoint written before positions were global
        (its iterator state is per process: ``checkpoint.legacy_data_position``). ValueError when it is garbled."""
        stored = meta.get(cls.META_KEY)
        if stored is None:
            return None
        try:
            position = cls(int(stored["global_batches"]), int(stored["global_batch_size"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"meta[{cls.META_KEY!r}] = {stored!r} is not a data position ({err!r})") from None
        if position.batches < 0 or position.batch_size < 1:
            raise ValueError(f"meta[{cls.META_KEY!r}] = {stored!r} is not a data position")
        return position

    def advanced(self, batches: int) -> DataPosition:
        """The position after ``batches`` more global batches."""
        return dataclasses.replace(self, batches=self.batches + int(batches))


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
