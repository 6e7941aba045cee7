"""Data pipeline throughput vs. what a SmolLM2 training step consumes (issue 6: the pipeline must deliver
at least 10x the tokens/s of the step).

    python bench/bench_data.py                 # enwiki store (SmolLM2 tokenizer), seq 512 and 2048, batch 8
    python bench/bench_data.py --no-teacher    # pipeline only

Pipeline tokens/s = batches x batch x seq_len / wall time of `next(iterator)` after a warm-up (shuffle,
packing, batching and grain's thread prefetch all included). Teacher tokens/s = batch x seq_len / time of
one jitted forward+backward (masked next-token cross-entropy) of the SmolLM2 teacher, after compilation.
Appends a row to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import numpy as np


def pipeline_tokens_per_s(store, tokenizer, *, seq_len: int, batch: int, batches: int, synthetic_rate: float) -> float:
    from hydrahead_jax.data.pipeline import make_train_iterator

    it = make_train_iterator(
        store,
        seq_len=seq_len,
        batch_size=batch,
        seed=0,
        shard_index=0,
        shard_count=1,
        synthetic_rate=synthetic_rate,
        tokenizer=tokenizer if synthetic_rate else None,
    )
    for _ in range(3):  # warm-up: thread pool start, first epoch permutations, haystack build
        next(it)
    t = time.perf_counter()
    for _ in range(batches):
        b = next(it)
    dt = time.perf_counter() - t
    assert b["input_ids"].shape == (batch, seq_len)
    return batches * batch * seq_len / dt


def teacher_tokens_per_s(seq_len: int, batch: int, repeats: int = 2) -> float:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from hydrahead_jax.models import load_pretrained

    model, _ = load_pretrained("smollm2-135m")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def grad_step(params, rest, ids, targets, mask):
        def loss_fn(p):
            m = nnx.merge(graphdef, p, rest)
            logits = m(ids)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
            return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)

        return jax.value_and_grad(loss_fn)(params)

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (batch, seq_len)), jnp.int32)
    mask = jnp.ones((batch, seq_len), jnp.float32)
    jax.block_until_ready(grad_step(params, rest, ids, ids, mask))  # compile
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(grad_step(params, rest, ids, ids, mask))
        best = min(best, time.perf_counter() - t)
    return batch * seq_len / best


def _versions() -> str:
    import grain
    import jax

    return f"python {platform.python_version()}, jax {jax.__version__}, grain {grain.__version__}"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def append_result(line: str) -> None:
    path = Path(__file__).with_name("RESULTS.md")
    if not path.exists():
        path.write_text(
            "# Benchmark results\n\nOne row per run; each bench script appends its own rows.\n\n"
            "| date | script | machine | versions | result |\n|---|---|---|---|---|\n"
        )
    with open(path, "a") as f:
        f.write(line + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--synthetic-rate", type=float, default=0.1, help="also time the stage-3 mixture at this rate")
    ap.add_argument("--no-teacher", action="store_true")
    ap.add_argument(
        "--teacher-batch", type=int, default=1, help="batch of the timed teacher step (tokens/s is per token)"
    )
    ap.add_argument("--teacher-seq", type=int, default=512)
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    args = ap.parse_args()

    from hydrahead_jax.data.corpus import prepare_corpus
    from hydrahead_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    t = time.perf_counter()
    store = prepare_corpus(tok)  # enwiki extract; built once, then reused from the cache
    print(f"store {store} ready in {time.perf_counter() - t:.1f}s")

    results = []
    for seq in args.seq:
        tps = pipeline_tokens_per_s(store, tok, seq_len=seq, batch=args.batch, batches=args.batches, synthetic_rate=0)
        results.append((f"corpus seq {seq}", tps))
        print(f"pipeline  seq {seq:5d} batch {args.batch}: {tps:12,.0f} tokens/s")
        if args.synthetic_rate:
            tps = pipeline_tokens_per_s(
                store,
                tok,
                seq_len=seq,
                batch=args.batch,
                batches=max(20, args.batches // 4),
                synthetic_rate=args.synthetic_rate,
            )
            results.append((f"mix{args.synthetic_rate:g} seq {seq}", tps))
            print(
                f"mixture   seq {seq:5d} batch {args.batch} (synthetic {args.synthetic_rate:g}): {tps:12,.0f} tokens/s"
            )
    summary = "; ".join(f"{name}: {v:,.0f} tok/s" for name, v in results)
    if not args.no_teacher:
        teacher = teacher_tokens_per_s(args.teacher_seq, args.teacher_batch)
        ratio = min(v for _, v in results) / teacher
        print(
            f"teacher fwd+bwd seq {args.teacher_seq} batch {args.teacher_batch}: {teacher:,.0f} tokens/s; "
            f"slowest pipeline / teacher step = {ratio:,.0f}x (need >= 10x)"
        )
        summary += f"; SmolLM2 fwd+bwd (B{args.teacher_batch}xT{args.teacher_seq}): {teacher:,.0f} tok/s; min ratio {ratio:,.0f}x"
    if not args.no_record:
        date = datetime.date.today().isoformat()
        append_result(f"| {date} | bench_data.py (batch {args.batch}) | {_machine()} | {_versions()} | {summary} |")


if __name__ == "__main__":
    main()
