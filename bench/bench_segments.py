"""Packed documents: the cost of segment-id masking in flash attention's XLA path on the CPU (issue #15, item 6).

    python bench/bench_segments.py                 # T = 8K, documents of ~500 tokens, B=1, H=8, D=64, causal, f32
    python bench/bench_segments.py --seq 4096 16384 --doc-len 1000
    python bench/bench_segments.py --quick         # smoke run (T=512), nothing recorded

Three calls of ``flash_attention(..., implementation="xla")`` on the same q, k, v, each forward and forward+backward
(gradients of Σ o·do w.r.t. q, k, v), jitted:
  unmasked    no segment ids: the row attended as one causal sequence (what the model did before packing masks);
  one doc     segment ids all equal: the same blocks computed, plus the id comparison in every score tile, so
              its ratio to unmasked is the price of the mask itself;
  packed      ids of documents of about --doc-len tokens (lengths uniform in [doc_len/2, 3·doc_len/2], the last one
              cut at T): the mask plus the skipped blocks (the loops only visit blocks whose id ranges meet).
Timing: ``--runs`` runs of interleaved repeats after a warm-up (bench/_common.py), each run's median, then the
minimum over runs per call; the ratios are unmasked time / call time (> 1: faster than unmasked).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.flash_attention import flash_attention  # noqa: E402


def packed_segment_ids(batch: int, t: int, doc_len: int, seed: int = 0) -> np.ndarray:
    """[batch, t] int32 ids 1, 2, ... of consecutive documents with lengths uniform in [doc_len/2, 3·doc_len/2]
    (the last one cut at t), as the data pipeline packs them."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < t:
            lengths.append(int(rng.integers(max(1, doc_len // 2), 3 * doc_len // 2 + 1)))
        rows.append(np.repeat(np.arange(1, len(lengths) + 1), lengths)[:t])
    return np.stack(rows).astype(np.int32)


def _calls(q, k, v, do, ids_by_name):
    """{name: (forward, forward+backward)} zero-argument callables, jitted, one per segment-id setting."""
    fns = {}
    for name, ids in ids_by_name.items():

        def attn(q, k, v, ids=ids):
            return flash_attention(q, k, v, segment_ids=ids, implementation="xla")

        def fwd_bwd(q, k, v, do, attn=attn):
            out, vjp = jax.vjp(attn, q, k, v)
            return out, vjp(do)

        fwd, fb = jax.jit(attn), jax.jit(fwd_bwd)
        fns[name] = (lambda fwd=fwd: fwd(q, k, v), lambda fb=fb: fb(q, k, v, do))
    return fns


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[8192])
    ap.add_argument("--doc-len", type=int, default=500, help="mean document length in tokens")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs; the minimum over runs is reported")
    ap.add_argument("--quick", action="store_true", help="smoke settings: T 512, H 2, D 16, docs of 64, 1 run")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq, args.heads, args.dim, args.doc_len, args.repeats, args.runs = [512], 2, 16, 64, 1, 1
        args.no_record = True

    B, H, D = args.batch, args.heads, args.dim
    rows, ratios = [], {}
    for T in args.seq:
        rng = np.random.default_rng(T)
        q, k, v, do = (jnp.asarray(rng.standard_normal((B, T, H, D), dtype=np.float32)) for _ in range(4))
        packed = packed_segment_ids(B, T, args.doc_len, seed=T)
        docs = int(packed.max())
        ids = {"unmasked": None, "one doc": jnp.ones((B, T), jnp.int32), "packed": jnp.asarray(packed)}
        calls = _calls(q, k, v, do, ids)
        for mode, index in (("forward", 0), ("fwd+bwd", 1)):
            fns = {name: pair[index] for name, pair in calls.items()}
            runs = [C.time_interleaved(fns, args.repeats) for _ in range(args.runs)]
            t = {name: min(r[name] for r in runs) for name in fns}
            ratio = {name: t["unmasked"] / t[name] for name in ("one doc", "packed")}
            ratios[(mode, T)] = ratio
            rows.append(
                [
                    T,
                    docs,
                    mode,
                    C.fmt_s(t["unmasked"]),
                    C.fmt_s(t["one doc"]),
                    C.fmt_ratio(ratio["one doc"]),
                    C.fmt_s(t["packed"]),
                    C.fmt_ratio(ratio["packed"]),
                ]
            )
            print(
                f"  T={T} {mode}: unmasked {C.fmt_s(t['unmasked'])}, one doc {C.fmt_s(t['one doc'])}, "
                f"packed ({docs} docs) {C.fmt_s(t['packed'])}",
                flush=True,
            )

    table = C.markdown_table(
        [
            "T",
            "documents",
            "pass",
            "unmasked",
            "one doc (mask only)",
            "unmasked / one doc",
            "packed",
            "unmasked / packed",
        ],
        rows,
    )
    settings = (
        f"flash_attention implementation='xla' (default 512x512 blocks), B={B}, H={H} (MHA), D={D}, causal, f32, "
        f"documents of ~{args.doc_len} tokens (uniform in [{args.doc_len // 2}, {3 * args.doc_len // 2}]), "
        f"median of {args.repeats} interleaved repeats, min over {args.runs} runs"
    )
    C.append_results(
        "Packed documents (segment ids): flash attention masking cost, XLA path (bench_segments.py)",
        table + "\n",
        settings=settings,
        record=not args.no_record,
    )
    return ratios


if __name__ == "__main__":
    main()
