"""The corpus preparation step on the command line:

    python -m hydrahead_jax.data.prepare --source SRC --tokenizer TOK --out STORE [--workers N]

SRC: a file, folder, glob or gs:// URL of the corpus (or "enwiki"); TOK: "smollm2-135m", a .gguf file or a Hugging
Face folder, as ``teacher.source`` names one; STORE: a local folder or gs:// URL. Hosts: ``--host_index/--host_count``
(each host prepares shards k with k mod count = index; the one that finds every shard done completes the store), or
``--distributed`` (JAX's process index and count; process 0 completes the store after a barrier). Rerunning the same
command resumes a killed preparation. The last line printed is a JSON summary: "documents", "tokens", "splits",
"shards", "shards_done", "complete", and what this call did ("shards_prepared", "tokens_prepared", "seconds",
"tokens_per_second"). How the work is cut, the identity and the split: ``preparation.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from hydrahead_jax.data.corpus import CorpusError
from hydrahead_jax.data.preparation import DEFAULT_SHARD_BYTES, finalize_from_manifest, run_preparation
from hydrahead_jax.storage import run_path


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hydrahead_jax.data.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="a file, folder, glob or gs:// URL of the corpus, or 'enwiki'")
    p.add_argument("--tokenizer", required=True, help="'smollm2-135m', a .gguf file or a Hugging Face folder")
    p.add_argument("--out", required=True, help="the store's folder (local or gs://)")
    p.add_argument("--workers", type=int, default=1, help="worker processes on this host (one core each)")
    p.add_argument("--host_index", type=int, default=None, help="this host's index (default: JAX's, or 0)")
    p.add_argument("--host_count", type=int, default=None, help="the number of hosts (default: JAX's, or 1)")
    p.add_argument("--distributed", action="store_true", help="join a JAX cluster (jax.distributed.initialize)")
    p.add_argument("--validation_fraction", type=float, default=0.02)
    p.add_argument("--split_seed", type=int, default=0)
    p.add_argument("--text_field", default="text")
    p.add_argument("--txt_split", default="file", choices=("file", "paragraphs"))
    p.add_argument("--shard_mb", type=float, default=DEFAULT_SHARD_BYTES / 2**20, help="input MiB per output shard")
    p.add_argument("--rebuild", action="store_true", help="replace an existing store at --out")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    """The command line: prepares this host's shards; the last line printed is the JSON summary."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.workers < 1:
        raise SystemExit(f"--workers={args.workers}: must be >= 1.")
    host_index, host_count = args.host_index, args.host_count
    if args.distributed:
        import jax

        jax.distributed.initialize()
        host_index, host_count = jax.process_index(), jax.process_count()
    if (host_index is None) != (host_count is None):
        raise SystemExit("--host_index and --host_count go together (or neither: one host).")
    from hydrahead_jax.models.tokenizer import load_tokenizer  # the teacher's tokenizer, as train.py loads it

    options = dict(
        out_dir=args.out,
        validation_fraction=args.validation_fraction,
        split_seed=args.split_seed,
        text_field=args.text_field,
        txt_split=args.txt_split,
        shard_bytes=int(args.shard_mb * 2**20),
        rebuild=args.rebuild,
        workers=args.workers,
        host_index=host_index or 0,
        host_count=host_count or 1,
    )
    try:
        summary = run_preparation(load_tokenizer(args.tokenizer), args.source, **options, finalize=not args.distributed)
        if args.distributed:
            summary = _finalize_distributed(args, summary)
    except CorpusError as err:
        raise SystemExit(f"error: {err}") from None
    print(json.dumps(summary), flush=True)
    return summary


def _finalize_distributed(args, summary: dict) -> dict:
    """Every host waits for the others' shards; process 0 then completes the store, and the others wait for it."""
    import jax
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("hydrahead:prepare:shards")
    if jax.process_index() == 0 and not summary["complete"]:
        finalize_from_manifest(args.out)
    multihost_utils.sync_global_devices("hydrahead:prepare:metadata")
    return dict(summary, complete=(run_path(args.out) / "metadata.json").exists())


if __name__ == "__main__":
    main()
