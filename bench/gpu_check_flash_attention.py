"""Check and benchmark the Pallas flash-attention kernel on a GPU (or, with --quick, smoke-run on CPU).

  python bench/gpu_check_flash_attention.py            # on the GPU box (jax 0.11.2 + CUDA, H200)
  python bench/gpu_check_flash_attention.py --quick    # anywhere: tiny shapes, Pallas in interpret mode

1. Correctness: Pallas fwd + grads vs the exact fp32 reference on a few shapes (GQA, ragged lengths,
   causal offset, non-causal). bf16: Frobenius error vs an fp32 oracle must be <= 2x the reference's
   own bf16 error; fp32: relative Frobenius error <= 1e-2 (Triton runs fp32 dots as TF32 by default).
   Prints the errors; exits with status 1 on any mismatch.
2. Speed: bf16, causal, T in {2K, 8K, 32K}, head_dim 64 and 128, B·H sized so every row is large
   work; TFLOP/s with FLOPs = 4·B·T·S·H·D (halved when causal) for the forward and 3.5x that for
   forward+backward (backward = 2.5x forward), beside the blockwise XLA path and cuDNN.
Imports only jax, numpy and pallas_kernels (no network needed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.flash_attention import BlockSizes, attention_reference, flash_attention  # noqa: E402

F32 = jnp.float32


def _inputs(seed, b, t, s, hq, hkv, d, dtype):
    rng = np.random.default_rng(seed)
    shapes = [(b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, t, hq, d)]
    return [jnp.asarray(rng.standard_normal(sh), dtype) for sh in shapes]


def _fwd_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))


def check(quick: bool) -> bool:
    # (B, T, S, Hq, Hkv, D, causal, q_offset)
    cases = (
        [(1, 40, 40, 4, 2, 16, True, None), (1, 33, 70, 2, 1, 32, True, 10)]
        if quick
        else [
            (2, 1000, 1000, 8, 2, 64, True, None),
            (1, 517, 1200, 4, 4, 128, True, None),
            (1, 300, 900, 6, 3, 64, True, 100),
            (2, 256, 200, 4, 1, 64, False, None),
            (1, 1, 4097, 8, 8, 128, True, None),
        ]
    )
    ok = True
    print("## correctness (Pallas fwd+grads vs fp32 reference)\n")
    print("| shape (B,T,S,Hq,Hkv,D) | causal | q_offset | dtype | out | dq | dk | dv | ok |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, t, s, hq, hkv, d, causal, off in cases:
        q, k, v, do = _inputs(0, b, t, s, hq, hkv, d, F32)
        ref = lambda *a, causal=causal, off=off: attention_reference(*a, causal=causal, q_offset=off)
        pal = lambda *a, causal=causal, off=off: flash_attention(
            *a, causal=causal, q_offset=off, implementation="pallas"
        )
        oracle = _fwd_grads(ref, q, k, v, do)
        for dtype in (F32, jnp.bfloat16):
            args = [x.astype(dtype) for x in (q, k, v, do)]
            exact = [x.astype(F32) for x in args]
            oracle_d = oracle if dtype == F32 else _fwd_grads(ref, *exact)
            got = _fwd_grads(pal, *args)
            errs, row_ok = [], True
            if dtype == F32:
                for g, o in zip(got, oracle_d):
                    rel = float(jnp.linalg.norm(g - o) / jnp.linalg.norm(o))
                    errs.append(f"{rel:.1e} rel")
                    row_ok &= bool(rel <= 1e-2)
            else:
                ref_bf16 = _fwd_grads(ref, *args)
                for g, r, o in zip(got, ref_bf16, oracle_d):
                    e, er = (float(jnp.linalg.norm(x.astype(F32) - o)) for x in (g, r))
                    errs.append(f"{e / max(er, 1e-30):.2f}x ref")
                    row_ok &= bool(e <= 2 * er)
            ok &= row_ok
            print(
                f"| {(b, t, s, hq, hkv, d)} | {causal} | {off} | {jnp.dtype(dtype).name} | "
                + " | ".join(errs)
                + f" | {'yes' if row_ok else '**NO**'} |"
            )
    return ok


def _time(fn, *args, min_time=0.3, max_iters=20):
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    start = time.perf_counter()
    while len(times) < max_iters and (time.perf_counter() - start < min_time or len(times) < 3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench(quick: bool):
    on_gpu = jax.default_backend() == "gpu"
    lengths = [128, 256] if quick else [2048, 8192, 32768]
    dims = [64] if quick else [64, 128]
    tokens = 512 if quick else 65536  # B·T per row, so short sequences get a large batch
    heads = 2 if quick else 16
    impls = {"pallas": dict(implementation="pallas"), "xla": dict(implementation="xla")}
    print("\n## speed (bf16, causal; TFLOP/s)\n")
    print("| D | T | B | H | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in dims:
        for t in lengths:
            b = max(1, tokens // t)
            q, k, v, do = _inputs(1, b, t, t, heads, heads, d, jnp.bfloat16)
            flops_fwd = 4 * b * t * t * heads * d / 2
            variants = {
                name: (lambda q, k, v, kw=kw: flash_attention(q, k, v, causal=True, **kw)) for name, kw in impls.items()
            }
            if on_gpu:
                variants["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, implementation="cudnn"
                )
            for name, attn in variants.items():
                fwd = jax.jit(attn)
                fwd_bwd = jax.jit(lambda q, k, v, do, attn=attn: jax.vjp(attn, q, k, v)[1](do))
                try:
                    tf = _time(fwd, q, k, v)
                    tb = _time(fwd_bwd, q, k, v, do)
                except Exception as e:  # e.g. cuDNN unavailable for this shape/version: report, keep going
                    print(f"| {d} | {t} | {b} | {heads} | {name} | n/a ({type(e).__name__}) | | | |")
                    continue
                print(
                    f"| {d} | {t} | {b} | {heads} | {name} | {tf * 1e3:.2f} | {flops_fwd / tf / 1e12:.1f} "
                    f"| {tb * 1e3:.2f} | {3.5 * flops_fwd / tb / 1e12:.1f} |",
                    flush=True,
                )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes; on a CPU the Pallas kernel runs in interpret mode"
    )
    parser.add_argument("--skip-bench", action="store_true", help="only the correctness check")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    if not args.quick and jax.default_backend() != "gpu":
        sys.exit("no GPU found: run with --quick for the CPU smoke test")
    print("default block sizes:", BlockSizes.default("gpu"), "\n")
    ok = check(args.quick)
    if not args.skip_bench:
        bench(args.quick)
    if not ok:
        print("\nMISMATCH: see the table above", file=sys.stderr)
        sys.exit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
