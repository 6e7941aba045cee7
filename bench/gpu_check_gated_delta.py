"""Check and benchmark the Pallas gated delta rule kernel on a GPU (or smoke-run it on CPU with --quick).

    python bench/gpu_check_gated_delta.py            # GPU: correctness checks, then a bf16 benchmark table
    python bench/gpu_check_gated_delta.py --quick    # CPU: interpret mode, tiny shapes (checks the script)

Needs only jax, numpy and this checkout's pallas_kernels (no network, no other packages). Exits
non-zero with a message on any mismatch. GB/s counts the bytes a kernel must move at least: q, k, v,
g, beta read and o written, in the input dtype (the W/U/state traffic of the chunked algorithm is
extra, so this is a lower bound on real traffic).
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

from pallas_kernels.gated_delta import chunk_gated_delta_rule, naive_gated_delta_rule  # noqa: E402


def make_inputs(B, T, H, K, V, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, K), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, H, K), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, H, V), jnp.float32)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)) - 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = 0.5 * jax.random.normal(ks[5], (B, H, K, V), jnp.float32)
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta)) + (s0,)


def gdn(impl):
    def fn(q, k, v, g, beta, s0):
        if impl == "reference":
            return naive_gated_delta_rule(
                q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True
            )
        return chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True, implementation=impl
        )

    return fn


def loss_of(fn):
    def loss(*args):
        o, s = fn(*args)
        w = jnp.cos(jnp.arange(o.shape[-1], dtype=jnp.float32))
        return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(s)

    return loss


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check(shapes, oracle_impl):
    """Pallas fwd + grads vs an fp32 oracle; bf16 judged against the XLA path's own bf16 error."""
    names = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "ds0")
    failed = []
    for B, T, H, K, V in shapes:
        f32 = make_inputs(B, T, H, K, V, jnp.float32)
        bf16 = tuple(x.astype(jnp.bfloat16) for x in f32[:5]) + (f32[5],)

        def run(impl, args):
            out = jax.jit(gdn(impl))(*args)
            grads = jax.jit(jax.grad(loss_of(gdn(impl)), argnums=range(6)))(*args)
            return [np.asarray(x.astype(jnp.float32)) for x in (*out, *grads)]

        oracle = run(oracle_impl, f32)
        pal32, pal16, xla16 = run("pallas", f32), run("pallas", bf16), run("xla", bf16)
        for name, p32, p16, x16, want in zip(names, pal32, pal16, xla16, oracle):
            e32, e16, base16 = rel_err(p32, want), rel_err(p16, want), rel_err(x16, want)
            ok = e32 < 1e-4 and e16 <= 2 * base16 + 1e-3
            print(
                f"  B={B} T={T} H={H} K={K} V={V} {name:6s} f32 rel err {e32:.2e}   bf16 rel err {e16:.2e} "
                f"(xla bf16 {base16:.2e})  {'ok' if ok else 'MISMATCH'}"
            )
            if not ok:
                failed.append((B, T, H, K, V, name))
    if failed:
        raise SystemExit(f"FAILED: Pallas gated delta rule disagrees with the {oracle_impl} oracle on {failed}")
    print("all checks passed\n")


def timed(fn, args, iters):
    out = fn(*args)
    jax.block_until_ready(out)  # compile + warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench(Ts, Ds, B, H, iters):
    print(
        f"bf16 inputs, B={B}, H={H}, K=V=D, use_qk_l2norm, chunk 64, median of {iters} runs "
        f"(backend: {jax.default_backend()})\n"
    )
    print("| T | D | impl | fwd ms | fwd Mtok/s | fwd GB/s | fwd+bwd ms | fwd+bwd Mtok/s |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for T in Ts:
        for D in Ds:
            args = make_inputs(B, T, H, D, D, jnp.bfloat16)
            nbytes = sum(x.size * x.dtype.itemsize for x in args[:5]) + B * T * H * D * 2
            for impl in ("pallas", "xla"):
                fwd = jax.jit(lambda *a, impl=impl: gdn(impl)(*a)[0])
                bwd = jax.jit(jax.grad(loss_of(gdn(impl)), argnums=range(6)))
                try:
                    tf, tb = timed(fwd, args, iters), timed(bwd, args, iters)
                except Exception as e:  # e.g. out of memory for the XLA path at long T: report, go on
                    print(f"| {T} | {D} | {impl} | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} |||||")
                    continue
                tok = B * T
                print(
                    f"| {T} | {D} | {impl} | {tf * 1e3:.2f} | {tok / tf / 1e6:.3g} | {nbytes / tf / 1e9:.3g} | "
                    f"{tb * 1e3:.2f} | {tok / tb / 1e6:.3g} |",
                    flush=True,
                )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes; on CPU the kernel runs in interpret mode")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, devices: {jax.devices()}")
    if jax.default_backend() not in ("gpu",) and not args.quick:
        raise SystemExit("no GPU found: run with --quick for a CPU smoke run in interpret mode")
    if args.quick:
        if not args.skip_check:
            check([(1, 50, 2, 16, 16)], "reference")
        bench(Ts=(64, 256), Ds=(16, 32), B=1, H=2, iters=2)
        return
    if not args.skip_check:
        # Ragged T (not chunk multiples), both head sizes, the reference scan as oracle where it is cheap.
        check([(2, 300, 4, 64, 64), (1, 1000, 2, 128, 128)], "reference")
        check([(1, 4100, 4, 128, 128)], "xla")
    bench(Ts=(2048, 8192, 32768), Ds=(64, 128), B=args.batch, H=args.heads, iters=args.iters)


if __name__ == "__main__":
    main()
