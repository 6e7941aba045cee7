"""Check and benchmark the Pallas flash-attention kernel on a GPU (one part of bench/gpu_check.sh).

    python bench/gpu_check_flash_attention.py [--mode full|quick|dry-run] [--deadline UNIX_TIME] [--out DIR]

1. Correctness of ``flash_attention(..., implementation="pallas")``: the output and dq, dk, dv against
   ``attention_reference`` in float32 and bfloat16, at head_dim 64 and 128, 1, 4 and 8 query heads per KV head,
   causal and not, lengths that are no block multiple, T ≠ S, a q_offset and a decode step (T = 1). The same for
   ``implementation="cudnn"`` (NVIDIA's fused attention behind our switch) in bfloat16 on every case it covers
   (``cudnn_unsupported``), rows "[cudnn]". The error protocol and its limits are in bench/_gpu_check.py.
2. Speed, bf16, causal, H = 16 heads (MHA), B·T = 32K tokens per row, T = 4K to 32K, head_dim 64 and 128, forward
   and forward+backward, beside the peers measured in the same process: cuDNN's fused attention through our
   switch (``flash_attention(..., implementation="cudnn")``, what ``auto`` runs on a GPU for these calls), XLA's
   dense attention (``jax.nn.dot_product_attention(..., implementation="xla")``; only up to T = 8K since it
   materialises the B·H·T² scores) and this package's blockwise XLA path (``implementation="xla"``).
3. Packed documents (segment ids), checked in --quick and full: output and gradients with the ids of documents of
   ragged lengths against ``attention_reference`` given the same ids. Timed in every mode, before the rows of 2:
   one row (D = 128, T = 8K; the dry run at its tiny shape), documents of ~500 tokens, Pallas with the ids
   ("pallas", pass "fwd packed" / "fwd+bwd packed") against Pallas on the same tensors without them
   ("pallas_unmasked", one causal sequence): the ratio is the effect of skipping the tiles of other documents.
   Its TFLOP/s count only the visible pairs, Σ over documents of the causal FLOPs above at T = the document's length.
   FLOPs: the causal forward is 2·2·B·H·T²·D/2 (q·kᵀ and p·v, 2·T²·D each, half of the pairs masked); the backward
   is 2.5x the forward (five matmuls: the scores recomputed, dv, dp, dq, dk), so forward+backward is 3.5x.
Rows run most important first (D = 128 at 8K) and are skipped with a note once the time budget is spent.
Imports only jax, numpy, this checkout's pallas_kernels and bench/bench_segments.py (the document packer).
"""

from __future__ import annotations

import os
import sys
from functools import cache, partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _gpu_check import Budget, Report, budgeted_rows, first_line, run_script, time_variants  # noqa: E402
from bench_segments import packed_segment_ids  # noqa: E402

from pallas_kernels.flash_attention import BlockSizes, attention_reference, flash_attention  # noqa: E402
from pallas_kernels.flash_attention.cudnn import cudnn_unsupported  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
NAMES = ("out", "dq", "dk", "dv")

# (B, T, S, Hq, Hkv, D, causal, q_offset); every (D, group size, causal) pair the recipes use is covered at full.
CASES = {
    "full": [
        (2, 1000, 1000, 8, 8, 64, True, None),
        (1, 777, 1100, 16, 4, 64, False, None),
        (1, 1500, 1500, 32, 4, 64, True, None),
        (1, 600, 600, 16, 2, 64, False, None),
        (1, 517, 1200, 16, 2, 128, True, 100),
        (2, 300, 300, 8, 8, 128, False, None),
        (1, 640, 640, 8, 2, 128, True, None),
        (1, 700, 900, 32, 8, 128, False, None),
        (1, 1, 4097, 8, 2, 128, True, None),
    ],
    "quick": [
        (1, 777, 1100, 16, 4, 64, False, None),
        (1, 517, 1200, 16, 2, 128, True, 100),
        (2, 1000, 1000, 8, 8, 128, True, None),
    ],
    "dry-run": [  # the first has the benchmark row's shape: the dry run reuses its compilations
        (1, 64, 64, 2, 2, 16, True, None),
        (1, 33, 70, 4, 1, 32, False, None),
    ],
}
# Packed documents, (B, T, S, Hq, Hkv, D, causal, mean document length): checked against the reference with the ids.
SEGMENT_CASES = {
    "full": [(2, 1000, 1000, 8, 2, 128, True, 150), (1, 777, 777, 16, 4, 64, False, 100)],
    "quick": [(2, 1000, 1000, 8, 2, 128, True, 150)],
    "dry-run": [],
}
# The packed-documents timing row: (D, T, mean document length).
PACKED_ROW = {"full": (128, 8192, 500), "quick": (128, 8192, 500), "dry-run": (16, 64, 16)}
# (D, T), most important first: the budget drops the tail.
ROWS = {
    "full": [(128, 8192), (64, 8192), (128, 32768), (64, 32768), (128, 4096), (64, 4096), (128, 16384), (64, 16384)],
    "quick": [(128, 8192), (64, 8192), (128, 32768)],
    "dry-run": [(16, 64)],
}
TOKENS = {"full": 32768, "quick": 32768, "dry-run": 64}  # B·T per row
HEADS = {"full": 16, "quick": 16, "dry-run": 2}
REPEATS = {"full": 10, "quick": 5, "dry-run": 1}
SECONDS_PER_TIMING = {"full": 2.0, "quick": 1.0, "dry-run": 1.0}
DENSE_MAX_T = 8192


def _inputs(seed, b, t, s, hq, hkv, d, dtype):
    rng = np.random.default_rng(seed)
    shapes = [(b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, t, hq, d)]
    return [jnp.asarray(rng.standard_normal(sh, dtype=np.float32)).astype(dtype) for sh in shapes]


def _fwd_and_grads(attn, q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return (out, *vjp(do))


@cache
def jitted(impl: str, causal: bool = True, q_offset: int | None = None, segmented: bool = False):
    """(forward, forward+gradients) of one implementation, jitted once so checks and benchmark rows share
    compilations. impl: "reference", or an implementation of flash_attention ("pallas", "xla", "cudnn"), or
    "xla_dense" (jax.nn.dot_product_attention). segmented: both take the segment ids [B, T] as a last argument."""
    if impl == "xla_dense":
        attn = partial(jax.nn.dot_product_attention, is_causal=causal, implementation="xla")
    elif impl == "reference":
        attn = partial(attention_reference, causal=causal, q_offset=q_offset)
    else:
        attn = partial(flash_attention, causal=causal, q_offset=q_offset, implementation=impl)
    if not segmented:
        return jax.jit(attn), jax.jit(partial(_fwd_and_grads, attn))

    def fwd(q, k, v, ids):
        return attn(q, k, v, segment_ids=ids)

    def fwd_bwd(q, k, v, do, ids):
        return _fwd_and_grads(partial(attn, segment_ids=ids), q, k, v, do)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def _cudnn_covers(q, k, causal, q_offset, segmented) -> bool:
    """Whether flash_attention(implementation="cudnn") computes this call (its own rule, asked on this machine)."""
    offset = (k.shape[1] - q.shape[1]) if q_offset is None else q_offset
    return cudnn_unsupported(q, k, causal=causal, q_offset=offset, segments_given=segmented) is None


def run_checks(report: Report, budget: Budget, cases, segment_cases=(), on_gpu: bool = False) -> None:
    cases = [(*c, None) for c in cases] + [
        (b, t, s, hq, hkv, d, c, None, n) for b, t, s, hq, hkv, d, c, n in segment_cases
    ]
    for seed, (b, t, s, hq, hkv, d, causal, q_offset, doc_len) in enumerate(cases):
        case = f"B={b} T={t} S={s} Hq={hq} Hkv={hkv} D={d} {'causal' if causal else 'non-causal'}"
        case += f" q_offset={q_offset}" if q_offset is not None else ""
        segmented = doc_len is not None
        reference = jitted("reference", causal, q_offset, segmented)[1]
        kernels = {"pallas": jitted("pallas", causal, q_offset, segmented)[1]}
        if on_gpu:
            kernels["cudnn"] = jitted("cudnn", causal, q_offset, segmented)[1]
        if segmented:
            ids = jnp.asarray(packed_segment_ids(b, t, doc_len, seed=seed))
            case += f" packed {int(ids.max())} docs of ~{doc_len}"
            reference = partial(reference, ids=ids)
            kernels = {name: partial(fn, ids=ids) for name, fn in kernels.items()}
        x32 = _inputs(seed, b, t, s, hq, hkv, d, F32)
        for dtype in (F32, BF16):
            name = jnp.dtype(dtype).name
            x = [a.astype(dtype) for a in x32]
            for impl, kernel in kernels.items():
                row = case if impl == "pallas" else f"{case} [{impl}]"
                if impl == "cudnn" and not _cudnn_covers(x[0], x[1], causal, q_offset, segmented):
                    continue
                if not budget.allows(5):
                    report.check_skipped(row, name, f"time budget spent ({budget.left():.0f} s left)")
                    continue
                try:
                    oracle = reference(*(a.astype(F32) for a in x))  # fp32 on the same (rounded) inputs
                    got = kernel(*x)
                    report.check(row, name, NAMES, got, oracle, reference(*x) if dtype == BF16 else None)
                except Exception as e:  # lowering / compile / runtime error: a failed check, the others go on
                    report.check_error(row, name, e)


def run_packed_bench(report: Report, budget: Budget, mode: str) -> None:
    """Pallas with the segment ids of ~500-token documents vs Pallas without them, same tensors (item 3 above)."""
    d, t, doc_len = PACKED_ROW[mode]
    if mode != "dry-run" and not budget.allows(30):
        report.note(f"packed-documents row skipped: time budget spent ({budget.left():.0f} s left)")
        return
    b, heads = max(1, TOKENS[mode] // t), HEADS[mode]
    q, k, v, do = _inputs(2, b, t, t, heads, heads, d, BF16)
    ids = packed_segment_ids(b, t, doc_len)
    lengths = np.concatenate([np.bincount(row)[1:] for row in ids])
    flops_fwd = float(np.sum(2 * 2 * heads * lengths.astype(np.float64) ** 2 * d / 2))
    ids = jnp.asarray(ids)
    packed, unmasked = jitted("pallas", True, None, True), jitted("pallas", True, None)
    for direction, flops in (("fwd packed", flops_fwd), ("fwd+bwd packed", 3.5 * flops_fwd)):
        if direction == "fwd packed":
            fns = {"pallas": partial(packed[0], q, k, v, ids), "pallas_unmasked": partial(unmasked[0], q, k, v)}
        else:
            fns = {"pallas": partial(packed[1], q, k, v, do, ids), "pallas_unmasked": partial(unmasked[1], q, k, v, do)}
        row = dict(D=d, T=t, B=b, H=heads, direction=direction)
        time_variants(report, fns, flops=flops, row=row, repeats=REPEATS[mode], seconds=SECONDS_PER_TIMING[mode])
    report.note(
        f"packed rows: {len(lengths)} documents of ~{doc_len} tokens per {t}; pallas vs pallas_unmasked = the time "
        "without segment ids / with them (the tiles of other documents skipped); TFLOP/s of visible pairs only"
    )


def run_bench(report: Report, budget: Budget, mode: str, on_gpu: bool) -> None:
    if not on_gpu:
        report.note("cudnn skipped: cuDNN attention needs a CUDA GPU (this run's backend is cpu)")
    heads = HEADS[mode]
    for d, t in budgeted_rows(report, budget, ROWS[mode], min_row_s=0 if mode == "dry-run" else 10):
        b = max(1, TOKENS[mode] // t)
        q, k, v, do = _inputs(1, b, t, t, heads, heads, d, BF16)
        impls = ["pallas"] + ["cudnn"] * on_gpu + ["xla_dense"] * (t <= DENSE_MAX_T) + ["xla_blockwise"]
        if t > DENSE_MAX_T and not any("xla_dense skipped" in n for n in report.notes):
            report.note(f"xla_dense skipped above T={DENSE_MAX_T}: it materialises the B·H·T² score matrix")
        flops_fwd = 2 * 2 * b * heads * t * t * d / 2
        for direction, flops in (("fwd", flops_fwd), ("fwd+bwd", 3.5 * flops_fwd)):
            fns = {}
            for name in impls:
                fwd, fwd_bwd = jitted("xla" if name == "xla_blockwise" else name, True, None)
                fns[name] = partial(fwd, q, k, v) if direction == "fwd" else partial(fwd_bwd, q, k, v, do)
            row = dict(D=d, T=t, B=b, H=heads, direction=direction)
            time_variants(report, fns, flops=flops, row=row, repeats=REPEATS[mode], seconds=SECONDS_PER_TIMING[mode])


def steps(report: Report, budget: Budget, mode: str, on_gpu: bool) -> None:
    try:  # informative only: the block table may change shape while the kernels are tuned
        report.info["pallas blocks"] = str(BlockSizes.default("gpu"))
    except Exception as e:
        report.info["pallas blocks"] = f"unknown ({first_line(e)})"
    run_checks(report, budget, CASES[mode], SEGMENT_CASES[mode], on_gpu)
    # The packed row first: its implementations then lead the table's columns, and every row of run_bench keeps
    # its ratio against the last peer in the last column.
    run_packed_bench(report, budget, mode)
    run_bench(report, budget, mode, on_gpu)


def main(argv=None) -> int:
    return run_script("flash_attention", __doc__.splitlines()[0], argv, steps)


if __name__ == "__main__":
    sys.exit(main())
