"""The batch iterator of a stage: the corpus pipeline (``hydrahead_jax.data``) or the seeded copy source.

Both are random access over the stage's global row sequence, so a stage's data position is one number, the global
batches read (``DataPosition``), saved in every checkpoint: a resumed run, on any number of processes, reads
exactly the batches an uninterrupted one would. Batches: input_ids/targets [B,T] int32, loss_mask [B,T]
float32, segment_ids/positions [B,T] int32 (B = this process's share of the global batch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, ClassVar

import grain
import numpy as np

from hydrahead_jax.config import ConfigError
from hydrahead_jax.data.mixture import WeightedStore, source_counts, synthetic_weights
from hydrahead_jax.data.pipeline import make_train_iterator, resolve_batch_rows, select_batch_rows
from hydrahead_jax.data.rows import FEATURES, CopyRows
from hydrahead_jax.run_config import STAGES, DataConfig, RunConfig, Stage

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
    the whole row (``synthetic_loss``, ``data.mixture.synthetic_row``). ``store_path``: the prepared store, or the
    stage's weighted stores (``stage_stores``)."""
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
        source = _validation_rows(data, store_path, seq_len, seed, f"config.{config_key}.heldout_rows={rows}", off)
    examples = [source[i] for i in range(rows)]
    return {k: np.stack([e[k] for e in examples]) for k in FEATURES}


def _validation_rows(data: DataConfig, store_path, seq_len: int, seed: int, what: str, off: str):
    """The packed validation windows of the stage's store(s), mixed by weight as its training rows are; a
    validation split that cannot give a row is refused with the fix."""
    from hydrahead_jax.data.mixture import mix_sources  # local: the copy source needs no corpus code
    from hydrahead_jax.data.pipeline import corpus_sources, weighted_stores
    from hydrahead_jax.data.store import CorpusStore

    if store_path is None:
        raise ValueError("the corpus source needs a prepared token store (store_path).")
    for source in weighted_stores(store_path):
        store = CorpusStore(source.path, "validation")
        if store.num_docs == 0:
            raise ConfigError(
                f"{what} reads the corpus validation split of {source.name or store.path}, which is empty "
                f"(config.data.validation_fraction={data.validation_fraction}). Fix: "
                f"--config.data.validation_fraction=0.02 (a new run), or {off}."
            )
        if store.num_tokens < seq_len:
            raise ConfigError(
                f"{what}: the corpus validation split of {source.name or store.path} holds {store.num_tokens} "
                f"tokens, fewer than one row of seq_len={seq_len}. Fix: a larger validation_fraction or corpus, "
                f"or {off}."
            )
    try:
        parts, _, weights = corpus_sources(store_path, "validation", seq_len=seq_len, seed=seed)
    except ValueError as err:  # no validation document as long as a source's min_doc_tokens
        raise ConfigError(f"{what}: {err} Fix: {off}.") from None
    return mix_sources(parts, weights)


# ------------------------------------------------------------------------------------------------ stores


def prepare_store(data: DataConfig, tokenizer, source: str | None = None):
    """Token store path of one corpus (default: ``data.source``), tokenised once and reused afterwards; in a
    multi-process run the processes share the work (each prepares its shards, process 0 completes the store), so
    the store must be in a folder every host sees (``data.store_root``)."""
    import jax  # local: the copy source needs no corpus code

    from hydrahead_jax.data.preparation import finalize_from_manifest, is_store, prepare_corpus, run_preparation
    from hydrahead_jax.training.checkpoint import is_primary, sync_processes

    source = data.source if source is None else source
    if is_store(source):
        return prepare_corpus(tokenizer, source)
    options = dict(
        validation_fraction=data.validation_fraction,
        txt_split=data.txt_split,
        text_field=data.text_field,
        workers=data.prepare_workers,
        store_root=data.store_root or None,
    )
    if jax.process_count() == 1:
        return prepare_corpus(tokenizer, source, **options)
    summary = run_preparation(
        tokenizer, source, host_index=jax.process_index(), host_count=jax.process_count(), finalize=False, **options
    )
    sync_processes("corpus shards")  # every host has written its shards
    try:
        if is_primary() and not summary["complete"]:
            finalize_from_manifest(summary["store"], fix="--config.data.store_root=gs://BUCKET/stores")
    finally:
        sync_processes("corpus store")
    return prepare_corpus(tokenizer, summary["store"])


def prepare_stores(run: RunConfig, tokenizer) -> dict[str, object]:
    """{source path: token store} for every corpus source of every stage (each prepared once, in stage order)."""
    paths = dict.fromkeys(s.path for stage in STAGES for s in run.stage_sources(stage))
    return {path: prepare_store(run.data, tokenizer, path) for path in paths}


def stage_stores(run: RunConfig, stage: Stage, stores: dict[str, object]) -> list[WeightedStore] | None:
    """The weighted stores ``stage`` reads (None for the copy source); a single source is its store alone."""
    specs = run.stage_sources(stage)
    if not specs:
        return None
    if len(specs) == 1 and specs[0].min_doc_tokens == 0:
        return stores[specs[0].path]
    return [WeightedStore(stores[s.path], s.weight, s.min_doc_tokens, s.path) for s in specs]


def data_digest(run: RunConfig, stores: dict[str, object]) -> str | None:
    """What the run reads, by content: the one store's content address when every stage reads ``data.source``
    alone (as before mixtures), else a hash over each stage's stores, weights and minimum lengths."""
    from hydrahead_jax.data.store import read_metadata, store_digest

    if not stores:
        return None
    digests = {path: store_digest(read_metadata(store)) for path, store in stores.items()}
    per_stage = [[(digests[s.path], s.weight, s.min_doc_tokens) for s in run.stage_sources(st)] for st in STAGES]
    if all(p == per_stage[0] for p in per_stage) and len(per_stage[0]) == 1 and per_stage[0][0][1:] == (1.0, 0):
        return per_stage[0][0][0]
    return "mixture-" + hashlib.sha256(json.dumps(per_stage).encode()).hexdigest()[:32]


def mixture_line(run: RunConfig, stage: Stage, start_batch: int) -> str:
    """The rows each source gives the stage from global batch ``start_batch`` to its last step (the realised
    proportions, ``mixture.source_counts``), e.g. "data: enwiki 75.0 % (15), synthetic 25.0 % (5) of rows 0-19"."""
    scfg = run.stage(stage)
    specs = run.stage_sources(stage)
    names = [s.path for s in specs] + (["synthetic"] if scfg.synthetic_rate > 0 else [])
    start, stop = start_batch * scfg.batch_size, scfg.total_steps * scfg.batch_size
    counts = source_counts(synthetic_weights([s.weight for s in specs], scfg.synthetic_rate), start, stop)
    total = max(1, sum(counts))
    shares = ", ".join(f"{n} {100 * c / total:.1f} % ({c})" for n, c in zip(names, counts, strict=True))
    return f"data: {shares} of rows {start}-{stop - 1}"
