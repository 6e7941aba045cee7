"""Corpus preparation as its own resumable step: documents → token store, sharded over hosts and worker processes.

The command line is ``python -m hydrahead_jax.data.prepare`` (prepare.py); train.py runs the same step
(``training.data.prepare_stores``) when a store is missing.

How the work is cut:
- the inputs (``sources.list_inputs``: names, sizes and mtimes, no byte read) are grouped in listing order into
  output shards of about ``shard_bytes`` of input each (a larger file is a shard of its own);
- shard k belongs to host k mod H (``host_index``/``host_count``: JAX's process index and count in a distributed
  run, or flags) and is tokenised by one of the host's ``workers`` processes, which streams its documents (two
  passes: count, then tokenise in batches of ``batch_docs``) and writes the shard's arrays in WRITE_CHUNK blocks,
  so a worker's memory is bounded by one shard's document offsets, never by the corpus (a worker process is
  replaced after WORKER_SHARDS shards, so what the allocator keeps between shards cannot add up either);
- a shard is finished when its done.json exists (written last); a killed preparation resumes at the unfinished
  shards and keeps the finished ones; when every shard is done, metadata.json is written (the store is complete).

Identity: manifest.json, written when the store is created, records the tokenizer, the settings and every input's
name, size and mtime; a restart compares the listing against it (a changed file is an error naming it and the fix;
only a file whose mtime alone changed is re-read, to compare its content hash with the one its shard recorded).
The store's cache name is a digest of the inputs' names and sizes and the reader settings (the built-in Wikipedia
extract: of its content, as before) with the tokenizer's fingerprint.

Train / validation split: per shard, without a global permutation. Shard k with n documents gives
``max(1, round(validation_fraction · n))`` of them (none when the fraction is 0) to validation: the first ones of
``np.random.default_rng([split_seed, k]).permutation(n)``. For a store of one shard (the Wikipedia extract, a
single file, a small folder) that is exactly the split stores had before shards, so their contents are unchanged.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import gc
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import resource
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from hydrahead_jax.data.corpus import CorpusError, cache_dir
from hydrahead_jax.data.protocol import TokenizerLike, encode_documents
from hydrahead_jax.data.sources import ENWIKI, InputFile, content_sha256, iter_documents, list_inputs
from hydrahead_jax.data.store import (
    DONE,
    MANIFEST,
    METADATA,
    SPLITS,
    STORE_FORMAT,
    STORE_VERSION,
    SplitWriter,
    check_tokenizer,
    read_json,
    read_metadata,
    shard_name,
    tokenizer_identity,
    write_json,
)
from hydrahead_jax.storage import move, remove_tree, run_path

DEFAULT_SHARD_BYTES = 64 << 20
WORKER_SHARDS = 4  # shards a worker process prepares before a fresh one takes over
_REBUILD_FIX = "pass rebuild=True (prepare: --rebuild) to re-tokenise into it, or use another out_dir (--out)."


# ------------------------------------------------------------------------------------------------ the source


@dataclasses.dataclass
class Source:
    """A source's inputs, their digest (the store's identity with the tokenizer's) and its reader settings."""

    description: str
    digest: str
    inputs: list[InputFile]
    text_field: str = "text"
    txt_split: str = "file"
    cache: str | Path | None = None

    @property
    def builtin(self) -> bool:
        return len(self.inputs) == 1 and self.inputs[0].kind == ENWIKI

    def documents(self, inputs: Sequence[InputFile] | None = None) -> Iterator[str]:
        """The documents of ``inputs`` (default: all), streamed in order."""
        for inp in self.inputs if inputs is None else inputs:
            yield from iter_documents(inp, text_field=self.text_field, txt_split=self.txt_split, cache=self.cache)

    def read_documents(self) -> list[str]:
        """Every document in memory (a haystack's text: small sources only)."""
        return list(self.documents())


def resolve_source(
    source: str | os.PathLike | Sequence[str | os.PathLike] = ENWIKI,
    *,
    text_field: str = "text",
    txt_split: str = "file",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    cache: str | Path | None = None,
) -> Source:
    """The inputs of ``source`` (stat only) and their digest: names and sizes with the reader settings; the
    built-in extract's is its content hash with the cleaner's version (small, and as stores had it before)."""
    if txt_split not in ("file", "paragraphs"):
        raise CorpusError(f"txt_split must be 'file' or 'paragraphs', not {txt_split!r}.")
    inputs = list_inputs(source, cache)
    if len(inputs) == 1 and inputs[0].kind == ENWIKI:
        digest = content_sha256(inputs[0], cache)
        return Source(f"enwiki extract ({inputs[0].name})", digest, inputs, cache=cache)
    listing = [(f.name, f.size) for f in inputs]
    settings = {"text_field": text_field, "txt_split": txt_split, "shard_bytes": shard_bytes, "inputs": listing}
    digest = hashlib.sha256(json.dumps(["store-v2", settings]).encode()).hexdigest()
    shown = ", ".join(f.path for f in inputs[:5]) + (f" (+{len(inputs) - 5} more)" if len(inputs) > 5 else "")
    return Source(shown, digest, inputs, text_field, txt_split, cache)


def check_source(source) -> None:
    """Refuse a source that does not exist or holds a file no reader takes, reading no document (the check a run
    makes before any work; a prepared store's folder is a source too)."""
    if not (isinstance(source, (str, os.PathLike)) and is_store(source)):
        list_inputs(source)


def is_store(path) -> bool:
    """Whether ``path`` is a token store's folder (complete or not)."""
    if (
        not isinstance(path, (str, os.PathLike))
        or os.fspath(path) == ENWIKI
        or any(c in os.fspath(path) for c in "*?[")
    ):
        return False
    root = run_path(path, what="corpus source")
    return (root / METADATA).exists() or (root / MANIFEST).exists()


def default_store_path(source: Source, tokenizer: TokenizerLike, cache: str | Path | None = None, root=None):
    """``root`` (a local folder or a gs:// URL; default: the cache's corpora/ folder) / the store's identity."""
    if root is not None:
        return run_path(root, what="data.store_root") / store_identity(source, tokenizer)
    base = Path(cache) if cache is not None else cache_dir()
    return base / "corpora" / store_identity(source, tokenizer)


def store_identity(source: Source, tokenizer: TokenizerLike) -> str:
    return f"{source.digest[:16]}-{str(tokenizer.fingerprint)[:16]}"


# ------------------------------------------------------------------------------------------------ the plan


def group_shards(sizes: Sequence[int], shard_bytes: int) -> list[list[int]]:
    """Consecutive inputs grouped into shards of at most ``shard_bytes`` (a larger input is a shard alone)."""
    shards: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not shards or total + size > shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append(i)
        total += size
    return shards


def validation_members(n: int, fraction: float, seed: int, shard: int) -> np.ndarray:
    """The shard-local indices (sorted) of shard ``shard``'s validation documents (see the module doc)."""
    k = 0 if fraction == 0 else min(n, max(1, int(round(fraction * n))))
    return np.sort(np.random.default_rng([seed, shard]).permutation(n)[:k])


@dataclasses.dataclass
class Plan:
    """A store being prepared: where, from what, with which settings, and its shards (lists of input indices)."""

    out: object  # a RunPath
    source: Source
    tokenizer: TokenizerLike
    settings: dict
    manifest: dict
    created: bool  # this call created the store (so it may remove it again if no shard got done)

    @property
    def shards(self) -> list[list[int]]:
        return self.manifest["shards"]

    def shard_folder(self, k: int):
        return self.out / shard_name(k)

    def done(self, k: int) -> dict | None:
        return read_json(self.shard_folder(k) / DONE)

    def finished(self) -> list[int]:
        return [k for k in range(len(self.shards)) if (self.shard_folder(k) / DONE).exists()]


def _settings(source: Source, validation_fraction: float, split_seed: int, append_eos: bool, shard_bytes: int):
    settings = {"validation_fraction": validation_fraction, "split_seed": split_seed, "append_eos": append_eos}
    if not source.builtin:  # the extract has one input and no reader options: its settings are those of before
        settings.update(text_field=source.text_field, txt_split=source.txt_split, shard_bytes=shard_bytes)
    return settings


def _new_manifest(source: Source, tokenizer, settings: dict, shard_bytes: int) -> dict:
    return {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        "identity": store_identity(source, tokenizer),
        "tokenizer": tokenizer_identity(tokenizer),
        "source": {"description": source.description, "digest": source.digest},
        "settings": settings,
        "inputs": [f.listing() for f in source.inputs],
        "shards": group_shards([f.size for f in source.inputs], shard_bytes),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _recorded_hashes(out, recorded: dict) -> dict[str, str]:
    """Content hashes of the inputs of the finished shards, by name."""
    meta = read_json(out / METADATA)
    if meta is not None and meta.get("version") == STORE_VERSION:
        return {i["name"]: i["sha256"] for i in meta["inputs"]}
    hashes = {}
    for k in range(len(recorded["shards"])):
        done = read_json(out / shard_name(k) / DONE)
        hashes.update({i["name"]: i["sha256"] for i in (done or {}).get("inputs", [])})
    return hashes


def _check_inputs(out, recorded: dict, source: Source) -> None:
    """The inputs now against those the manifest recorded: a file added, gone, resized or rewritten is refused,
    naming it; a file whose mtime alone changed is re-read once and compared by content hash (when its shard is
    done; an unfinished shard reads it anew anyway)."""
    was = {i["name"]: i for i in recorded["inputs"]}
    now = {f.name: f for f in source.inputs}
    fix = f"restore the corpus as it was, or {_REBUILD_FIX}"
    for name in sorted(set(was) ^ set(now)):
        change = "was added" if name in now else "is gone"
        raise CorpusError(f"token store {out}: input {name} {change} since the store was created. Fix: {fix}")
    hashes = None
    for name, f in now.items():
        if f.size != was[name]["size"]:
            raise CorpusError(
                f"token store {out}: input {f.path} changed since the store was created (size {was[name]['size']} "
                f"-> {f.size} bytes). Fix: {fix}"
            )
        if f.mtime is not None and was[name]["mtime"] is not None and f.mtime != was[name]["mtime"]:
            hashes = _recorded_hashes(out, recorded) if hashes is None else hashes
            if name in hashes and content_sha256(f, source.cache) != hashes[name]:
                raise CorpusError(
                    f"token store {out}: input {f.path} was rewritten since the store was created (same size, other "
                    f"content). Fix: {fix}"
                )


def _check_store(out, recorded: dict, source: Source, tokenizer, settings: dict) -> None:
    """A store found at ``out`` (manifest or metadata) against this call's tokenizer, settings and inputs."""
    check_tokenizer(out, recorded, tokenizer, _REBUILD_FIX)
    if recorded.get("version") == 1:  # before shards: the source's content hash and three settings
        same = recorded["source"]["sha256"] == source.digest and recorded["settings"] == settings
    else:
        same = recorded["settings"] == settings and recorded["source"]["digest"] == source.digest
        if recorded["settings"] == settings:
            _check_inputs(out, recorded, source)  # names the file that changed
    if not same:
        raise CorpusError(
            f"token store {out} was built from other inputs or settings ({recorded['source']['description']}, "
            f"{recorded['settings']}). Fix: {_REBUILD_FIX}"
        )


def plan_store(
    tokenizer: TokenizerLike,
    source: Source,
    out_dir=None,
    *,
    validation_fraction: float = 0.02,
    split_seed: int = 0,
    append_eos: bool = True,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Plan:
    """Opens the store at ``out_dir`` (default: the cache's folder for this source and tokenizer), checking one
    that exists against this call (tokenizer, settings, inputs), or creates it (writes its manifest)."""
    if not 0.0 <= validation_fraction < 1.0:
        raise CorpusError(f"validation_fraction must be in [0, 1), not {validation_fraction}.")
    if append_eos and tokenizer.eos_id is None:
        raise CorpusError(f"tokenizer {tokenizer.name!r} has no EOS id; pass append_eos=False or fix the tokenizer.")
    out = (
        run_path(out_dir, what="--out") if out_dir is not None else default_store_path(source, tokenizer, source.cache)
    )
    settings = _settings(source, validation_fraction, split_seed, append_eos, shard_bytes)
    recorded = read_json(out / METADATA) or read_json(out / MANIFEST)
    if recorded is not None:
        _check_store(out, recorded, source, tokenizer, settings)
        manifest = read_json(out / MANIFEST) or recorded
        return Plan(out, source, tokenizer, settings, manifest, created=False)
    if out.exists() and any(out.iterdir()):
        raise CorpusError(f"{out} exists and is not a token store; choose another out_dir (--out).")
    manifest = _new_manifest(source, tokenizer, settings, shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / MANIFEST, manifest)
    return Plan(out, source, tokenizer, settings, manifest, created=True)


# ------------------------------------------------------------------------------------------------ one shard


@dataclasses.dataclass
class ShardJob:
    """What a worker process needs to write shard ``index`` (picklable)."""

    out: str
    index: int
    source: Source
    inputs: list[int]
    tokenizer: TokenizerLike
    settings: dict
    batch_docs: int
    only_shard: bool  # the store's one shard: a split that leaves no train document is refused before any work


def _batches(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _split_mask(job: ShardJob, inputs: list[InputFile]) -> np.ndarray:
    """Pass 1: counts the shard's documents (reading, not tokenising) and marks its validation ones."""
    n = sum(1 for _ in job.source.documents(inputs))
    fraction = job.settings["validation_fraction"]
    members = validation_members(n, fraction, job.settings["split_seed"], job.index)
    if job.only_shard and fraction > 0 and len(members) >= n:
        raise CorpusError(
            f"{n} document(s) is too few for a validation split of {fraction}; add documents or pass "
            "validation_fraction=0."
        )
    mask = np.zeros(n, bool)
    mask[members] = True
    return mask


def prepare_shard(job: ShardJob) -> dict:
    """Tokenises one shard into its folder and writes its done.json (what it returns) last: counts, the inputs'
    content hashes, wall and CPU seconds, and the process's peak RSS so far (what bench/bench_data.py reports)."""
    start, cpu = time.perf_counter(), time.process_time()
    folder = run_path(job.out) / shard_name(job.index)
    remove_tree(folder)  # what a killed attempt left
    inputs = [job.source.inputs[i] for i in job.inputs]
    mask = _split_mask(job, inputs)
    writers = {split: SplitWriter(folder / split) for split in SPLITS}
    eos = [int(job.tokenizer.eos_id)] if job.settings["append_eos"] else []
    seen = 0
    for texts in _batches(job.source.documents(inputs), job.batch_docs):
        encoded = encode_documents(job.tokenizer, texts)
        if seen + len(encoded) > len(mask):
            raise CorpusError(f"shard {job.index} ({inputs[0].path} ...) changed while it was read; rerun.")
        for split, flag in (("train", False), ("validation", True)):
            docs = [ids + eos for ids, m in zip(encoded, mask[seen : seen + len(encoded)], strict=True) if m == flag]
            if docs:
                writers[split].add_documents(docs)
        seen += len(encoded)
    counts = {split: writer.close() for split, writer in writers.items()}
    done = {
        "shard": job.index,
        "inputs": [dict(f.listing(), sha256=content_sha256(f, job.source.cache)) for f in inputs],
        "splits": counts,
        "validation_documents": [int(i) for i in np.flatnonzero(mask)],
        "seconds": round(time.perf_counter() - start, 3),
        "cpu_seconds": round(time.process_time() - cpu, 3),
        "peak_rss_mb": peak_rss_mb(),
    }
    write_json(folder / DONE, done)
    _release_memory()
    return done


def _release_memory() -> None:
    """Hands the freed heap of a shard back to the system (glibc keeps it otherwise, and a worker's resident memory
    would creep up shard after shard)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MiB: Linux's VmHWM (a spawned worker's own; getrusage's
    ru_maxrss would start from its parent's at the fork), else getrusage."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _worker(conn) -> None:
    """A worker process: prepares the shards sent to it, one at a time, replying with each done record (or the
    error), and exits after WORKER_SHARDS of them or when sent None. It tokenises on its own core: the tokenizer's
    thread pool would compete with the other workers."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    for _ in range(WORKER_SHARDS):
        job = conn.recv()
        if job is None:
            return
        try:
            conn.send(("done", prepare_shard(job)))
        except BaseException as err:  # reported by the parent, which stops the others
            conn.send(("error", err))
            return


def prepare_shards(plan: Plan, shards: Sequence[int], *, workers: int = 1, batch_docs: int = 64) -> list[dict]:
    """Writes ``shards`` of ``plan`` in ``workers`` spawned worker processes, each taking the next unwritten shard
    (in this process when one worker has at most WORKER_SHARDS shards to write); returns their done records."""
    jobs = [
        ShardJob(
            os.fspath(plan.out),
            k,
            plan.source,
            plan.shards[k],
            plan.tokenizer,
            plan.settings,
            batch_docs,
            len(plan.shards) == 1,
        )
        for k in shards
    ]
    if len(jobs) <= 1 or (workers <= 1 and len(jobs) <= WORKER_SHARDS):
        return [prepare_shard(job) for job in jobs]
    return _in_workers(jobs, max(1, workers))


def _in_workers(jobs: list[ShardJob], workers: int) -> list[dict]:
    """Runs ``jobs`` in up to ``workers`` processes at a time, a worker replaced after WORKER_SHARDS shards so its
    memory stays that of a few shards whatever the allocator keeps (bench/bench_data.py measures it). A worker that
    dies (killed, out of memory) is an error naming its shard; the others are stopped."""
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold JAX's threads
    pending, running, done = list(reversed(jobs)), {}, {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                conn, child = context.Pipe()
                proc = context.Process(target=_worker, args=(child,), daemon=True)
                proc.start()
                child.close()
                running[conn] = (proc, pending.pop(), 1)
                conn.send(running[conn][1])
            for conn in multiprocessing.connection.wait(list(running)):  # a reply, or the end of a dead worker
                proc, job, count = running.pop(conn)
                done[job.index] = _reply(conn, proc, job)
                if pending and count < WORKER_SHARDS:
                    running[conn] = (proc, pending.pop(), count + 1)
                    conn.send(running[conn][1])
                    continue
                if count < WORKER_SHARDS:
                    conn.send(None)  # nothing left for it
                proc.join()
    finally:
        for proc, _, _ in running.values():
            proc.kill()
    return [done[job.index] for job in jobs]


def _reply(conn, proc, job: ShardJob) -> dict:
    """A worker's done record for ``job``; its error raised here; its death an error naming the shard."""
    try:
        kind, value = conn.recv()
    except EOFError:
        proc.join()
        raise CorpusError(
            f"the worker preparing shard {job.index} died (exit code {proc.exitcode}; out of memory?). Fix: rerun "
            "to resume (with fewer --workers if memory is short)."
        ) from None
    if kind == "error":
        raise value
    return value


# ------------------------------------------------------------------------------------------------ completion


def finalize_store(plan: Plan, fix: str = "run the preparation on every host, then rerun") -> dict:
    """Writes metadata.json once every shard is done (idempotent: any host may do it): the counts, the inputs'
    content hashes, and the validation documents' indices in input order (as stores had them before). A missing
    shard is refused with ``fix``."""
    dones = [plan.done(k) for k in range(len(plan.shards))]
    missing = [k for k, d in enumerate(dones) if d is None]
    if missing:
        raise CorpusError(
            f"token store {plan.out}: shards {missing[:8]} of {len(dones)} are not done (each host writes its own "
            f"shards into this folder, so all hosts must see the same one). Fix: {fix}."
        )
    splits = _counts([d["splits"] for d in dones])
    if plan.settings["validation_fraction"] > 0 and splits["train"]["documents"] == 0:
        raise CorpusError(
            f"token store {plan.out}: every document went to validation (fraction "
            f"{plan.settings['validation_fraction']}). Fix: more documents, or validation_fraction=0; {_REBUILD_FIX}"
        )
    validation, base = [], 0
    for d in dones:
        validation += [base + i for i in d["validation_documents"]]
        base += d["splits"]["train"]["documents"] + d["splits"]["validation"]["documents"]
    meta = dict(
        plan.manifest,
        inputs=[i for d in dones for i in d["inputs"]],
        shards=[{"inputs": plan.shards[k], "splits": d["splits"]} for k, d in enumerate(dones)],
        splits=splits,
        validation_documents=validation,
    )
    write_json(plan.out / METADATA, meta)
    return meta


def finalize_from_manifest(out, **fix) -> dict:
    """``finalize_store`` for the store at ``out`` from its manifest alone (the host that completes a store
    prepared by several need not have its source or tokenizer)."""
    out = run_path(out)
    manifest = read_json(out / MANIFEST)
    return finalize_store(Plan(out, None, None, manifest["settings"], manifest, created=False), **fix)


def _counts(records: list[dict]) -> dict:
    return {s: {k: sum(r[s][k] for r in records) for k in ("documents", "tokens")} for s in SPLITS}


def summarize(plan: Plan, prepared: list[dict], seconds: float) -> dict:
    """The preparation's JSON summary: the store's counts (over its done shards while it is unfinished) and what
    this call did."""
    meta = read_json(plan.out / METADATA)
    if meta is not None:
        splits, shards, done = meta["splits"], len(meta.get("shards", [0])), len(meta.get("shards", [0]))
    else:
        records = [d["splits"] for d in (plan.done(k) for k in range(len(plan.shards))) if d is not None]
        splits, shards, done = _counts(records), len(plan.shards), len(records)
    tokens_now = sum(d["splits"][s]["tokens"] for d in prepared for s in SPLITS)
    return {
        "store": os.fspath(plan.out),
        "complete": meta is not None,
        "documents": sum(splits[s]["documents"] for s in SPLITS),
        "tokens": sum(splits[s]["tokens"] for s in SPLITS),
        "splits": splits,
        "shards": shards,
        "shards_done": done,
        "shards_prepared": len(prepared),
        "tokens_prepared": tokens_now,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens_now / seconds, 1) if seconds > 0 else None,
        "peak_rss_mb": peak_rss_mb(),
    }


# ------------------------------------------------------------------------------------------------ entry points


def run_preparation(
    tokenizer: TokenizerLike,
    source=ENWIKI,
    *,
    out_dir=None,
    validation_fraction: float = 0.02,
    split_seed: int = 0,
    text_field: str = "text",
    txt_split: str = "file",
    append_eos: bool = True,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    rebuild: bool = False,
    cache: str | Path | None = None,
    store_root=None,
    batch_docs: int = 64,
    workers: int = 1,
    host_index: int = 0,
    host_count: int = 1,
    finalize: bool = True,
) -> dict:
    """Prepares this host's unfinished shards and, when every shard is done and ``finalize``, completes the store;
    returns the summary (``summarize``). The store: ``out_dir``, else ``store_root`` (default: the cache's
    corpora/) / its identity. A failure in a store this call created, before any shard was done,
    removes the store again; a store being rebuilt comes back when its replacement got no shard done."""
    start = time.perf_counter()
    if not 0 <= host_index < host_count:
        raise CorpusError(f"host_index must be in [0, {host_count}), not {host_index}.")
    src = resolve_source(source, text_field=text_field, txt_split=txt_split, shard_bytes=shard_bytes, cache=cache)
    out = (
        run_path(out_dir, what="--out")
        if out_dir is not None
        else default_store_path(src, tokenizer, cache, store_root)
    )
    aside = _set_aside(out) if rebuild and out.exists() else None
    plan = plan_store(
        tokenizer,
        src,
        out,
        validation_fraction=validation_fraction,
        split_seed=split_seed,
        append_eos=append_eos,
        shard_bytes=shard_bytes,
    )
    prepared: list[dict] = []
    try:
        if not (out / METADATA).exists():
            done = set(plan.finished())
            mine = [k for k in range(len(plan.shards)) if k % host_count == host_index and k not in done]
            prepared = prepare_shards(plan, mine, workers=workers, batch_docs=batch_docs)
            if finalize and len(plan.finished()) == len(plan.shards):
                finalize_store(plan)
    except BaseException:
        if (plan.created or aside is not None) and not plan.finished():
            remove_tree(out)
            if aside is not None:
                move(aside, out)
        raise
    if aside is not None:
        remove_tree(aside)
    return summarize(plan, prepared, time.perf_counter() - start)


def _set_aside(out):
    aside = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    move(out, aside)
    return aside


def prepare_corpus(tokenizer: TokenizerLike, source=ENWIKI, *, out_dir=None, **options):
    """Tokenises ``source`` into a complete token store (reusing a matching one; ``run_preparation``'s options)
    and returns its path. A prepared store's folder as ``source`` is returned as it is (its tokenizer checked)."""
    if isinstance(source, (str, os.PathLike)) and is_store(source):
        path = run_path(source)
        check_tokenizer(path, read_metadata(path), tokenizer, "prepare the corpus with the teacher's tokenizer.")
        return path
    summary = run_preparation(tokenizer, source, out_dir=out_dir, **options)
    if not summary["complete"]:
        raise CorpusError(
            f"token store {summary['store']} is unfinished ({summary['shards_done']} of {summary['shards']} shards "
            "done; the rest belong to other hosts). Fix: run the preparation on every host, then rerun."
        )
    return run_path(summary["store"])
