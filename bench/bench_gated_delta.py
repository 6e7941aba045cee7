"""Chunked gated delta rule: our XLA path vs transformers' pure-torch chunked rule (Qwen3-Next), same inputs, CPU.

    python bench/bench_gated_delta.py                    # T = 1K, 4K, 8K, 16K; B=1, H=16, K=V=128; fwd and fwd+bwd
    python bench/bench_gated_delta.py --heads 8 --dim 64
    python bench/bench_gated_delta.py --quick            # smoke run
    python bench/bench_gated_delta.py --segments --heads 8 --dim 64   # packed documents: T = 8K with/without ids

Both sides get identical fp32 inputs (q, k, v ~ N(0,1), g = −softplus-like log decays in [−0.4, 0], β = sigmoid
of N(0,1)), chunk 64, q/k L2-normalised inside the rule, no initial state, final state returned. Before timing,
outputs and final states are checked to agree (max abs difference ≤ 2e-4 on O(1) values); a mismatch is an
error. Forward: ``chunk_gated_delta_rule(..., implementation="xla")`` under jit vs
``torch_chunk_gated_delta_rule`` under ``torch.no_grad``. Forward+backward: gradients of Σ o·do w.r.t.
q, k, v, g, β (JAX autodiff of the chunked XLA path vs torch autograd). Timing: ``--runs`` (default 3) runs of
interleaved repeats after a warm-up (bench/_common.py), each run's median, then the minimum over runs for each side
(the least disturbed figure on a shared machine); the ratio is of those minima. torch uses
``torch.set_num_threads(n)`` with n = the number of cores, the thread count of JAX's CPU client.
Memory: the compiled fwd+bwd temporaries of our rule (XLA memory_analysis, deterministic) in MiB and in units of one
fp32 [B,T,H,K] input (the size all chunk-start states would take at C = K; the XLA rule saves one per 256-token
block).

``--segments`` (packed documents, issue #15): our XLA rule alone on the same inputs, once without segment ids and
once with the ids of documents of about ``--doc-len`` tokens (bench_segments.packed_segment_ids: lengths uniform in
[doc_len/2, 3·doc_len/2]), at T = 8K unless ``--seq`` is given; timing as above, the ratio is (time without ids) /
(time with ids), so < 1 is the price of the document masks (the chunked rule does the same work either way).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_segments import packed_segment_ids  # noqa: E402

from pallas_kernels.gated_delta import chunk_gated_delta_rule  # noqa: E402

AGREE_ATOL = 2e-4


def make_inputs(T: int, B: int, H: int, K: int, V: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K), np.float32)
    k = rng.standard_normal((B, T, H, K), np.float32)
    v = rng.standard_normal((B, T, H, V), np.float32)
    g = (-0.4 * rng.random((B, T, H))).astype(np.float32)  # log decay ≤ 0: α = e^g ∈ [0.67, 1]
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    do = rng.standard_normal((B, T, H, V), np.float32)
    return q, k, v, g, beta, do


def jax_fns(inputs, chunk: int, segment_ids=None):
    q, k, v, g, beta, do = map(jnp.asarray, inputs)
    ids = None if segment_ids is None else jnp.asarray(segment_ids)

    def rule(q, k, v, g, beta):
        return chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            output_final_state=True,
            use_qk_l2norm=True,
            chunk_size=chunk,
            segment_ids=ids,
            implementation="xla",
        )

    fwd = jax.jit(rule)
    grad = jax.jit(jax.grad(lambda q, k, v, g, beta: jnp.vdot(rule(q, k, v, g, beta)[0], do), argnums=(0, 1, 2, 3, 4)))
    args = (q, k, v, g, beta)
    return (lambda: fwd(*args)), (lambda: grad(*args))


def torch_fns(inputs, chunk: int):
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as rule

    q, k, v, g, beta, do = (torch.from_numpy(np.ascontiguousarray(x)) for x in inputs)

    def fwd():
        with torch.no_grad():
            return rule(q, k, v, g, beta, chunk_size=chunk, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def fwdbwd():
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        o, _ = rule(*leaves, chunk_size=chunk, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return torch.autograd.grad((o * do).sum(), leaves)

    return fwd, fwdbwd


def rule_memory_mib(T: int, B: int, H: int, D: int, chunk: int) -> float:
    """Compiled fwd+bwd temporary bytes of our XLA rule (what the backward keeps and builds), in MiB."""
    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
    gate = jax.ShapeDtypeStruct((B, T, H), jnp.float32)

    def loss(q, k, v, g, beta):
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=chunk, implementation="xla")
        return jnp.sum(o * o)

    compiled = jax.jit(jax.grad(loss, argnums=range(5))).lower(x, x, x, gate, gate).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def check_agreement(inputs, chunk: int):
    """Max abs difference of outputs and final states between the two implementations (raises on mismatch)."""
    jf, _ = jax_fns(inputs, chunk)
    tf, _ = torch_fns(inputs, chunk)
    o_j, s_j = jf()
    o_t, s_t = tf()
    d_o = float(np.max(np.abs(np.asarray(o_j) - o_t.numpy())))
    d_s = float(np.max(np.abs(np.asarray(s_j) - s_t.numpy())))
    if not (d_o <= AGREE_ATOL and d_s <= AGREE_ATOL):
        raise AssertionError(
            f"XLA and torch chunked gated delta rules disagree: max |Δo| = {d_o:.3g}, "
            f"max |ΔS| = {d_s:.3g} (tolerance {AGREE_ATOL}); timing them would be meaningless."
        )
    return d_o, d_s


def segments_main(args):
    """``--segments``: the XLA rule with packed-document segment ids vs the same inputs without ids."""
    B, H, D = args.batch, args.heads, args.dim
    rows, ratios = [], {}
    for T in args.seq:
        inputs = make_inputs(T, B, H, D, D)
        ids = packed_segment_ids(B, T, args.doc_len)
        docs = len(np.unique(ids[0]))
        plain, packed = jax_fns(inputs, args.chunk), jax_fns(inputs, args.chunk, ids)
        for mode in args.modes:
            pick = 0 if mode == "fwd" else 1
            fns = {"no ids": plain[pick], "packed": packed[pick]}
            runs = [C.time_interleaved(fns, args.repeats, budget_s=args.budget_s) for _ in range(args.runs)]
            t = {name: min(r[name] for r in runs) for name in fns}
            r = t["no ids"] / t["packed"]
            ratios[(mode, T)] = r
            name = "forward" if mode == "fwd" else "fwd+bwd"
            rows.append([T, docs, name, C.fmt_s(t["no ids"]), C.fmt_s(t["packed"]), C.fmt_ratio(r)])
            print(f"  T={T} {mode}: no ids {C.fmt_s(t['no ids'])}, packed {C.fmt_s(t['packed'])}, ratio {r:.2f}x")
    table = C.markdown_table(["T", "documents", "pass", "no ids", "packed", "no ids / packed"], rows)
    settings = (
        f"chunk_gated_delta_rule implementation='xla', B={B}, H={H}, K=V={D}, chunk {args.chunk}, fp32, q/k L2-norm, "
        f"documents of ~{args.doc_len} tokens (uniform in [{args.doc_len // 2}, {3 * args.doc_len // 2}]), median of "
        f"{args.repeats} interleaved repeats, min over {args.runs} runs"
    )
    C.append_results(
        "Packed documents (segment ids): gated delta rule XLA path (bench_gated_delta.py --segments)",
        table + "\n",
        settings=settings,
        record=not args.no_record,
    )
    return ratios


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=None, help="default 1K 4K 8K 16K; 8K with --segments")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="key and value head dim")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs; the minimum over runs is reported")
    ap.add_argument("--budget-s", type=float, default=120.0, help="fewer repeats when they would take longer")
    ap.add_argument(
        "--bwd-max-seq",
        type=int,
        default=4096,
        help="largest T of the fwd+bwd pass (torch autograd of the chunked rule is slow)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke settings: T 256, H 2, dim 32, 1 repeat, no record")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--segments", action="store_true", help="time packed documents (segment ids) against no ids")
    ap.add_argument("--doc-len", type=int, default=500, help="mean document length of --segments")
    args = ap.parse_args(argv)
    if args.seq is None:
        args.seq = [8192] if args.segments else [1024, 4096, 8192, 16384]
    if args.quick:
        args.seq, args.heads, args.dim, args.repeats, args.runs, args.no_record = [256], 2, 32, 1, 1, True
        args.doc_len = min(args.doc_len, 64)
    if args.segments:
        return segments_main(args)

    import torch

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)

    B, H, D = args.batch, args.heads, args.dim
    d_o, d_s = check_agreement(make_inputs(min(512, min(args.seq)), B, H, D, D, seed=1), args.chunk)
    print(f"agreement (T={min(512, min(args.seq))}): max |Δo| = {d_o:.2e}, max |ΔS| = {d_s:.2e}", flush=True)

    rows, ratios = [], {}
    for T in args.seq:
        inputs = make_inputs(T, B, H, D, D)
        jf, jg = jax_fns(inputs, args.chunk)
        tf, tg = torch_fns(inputs, args.chunk)
        for mode in args.modes:
            if mode == "fwdbwd" and T > args.bwd_max_seq:
                continue
            fns = {"xla": jf, "torch": tf} if mode == "fwd" else {"xla": jg, "torch": tg}
            runs = [C.time_interleaved(fns, args.repeats, budget_s=args.budget_s) for _ in range(args.runs)]
            t = {name: min(r[name] for r in runs) for name in fns}
            r = t["torch"] / t["xla"]
            ratios[(mode, T)] = r
            tok = B * T
            mem = f"{rule_memory_mib(T, B, H, D, args.chunk):.0f} MiB" if mode == "fwdbwd" else ""
            rows.append(
                [
                    T,
                    "forward" if mode == "fwd" else "fwd+bwd",
                    C.fmt_s(t["xla"]),
                    f"{tok / t['xla']:,.0f}",
                    C.fmt_s(t["torch"]),
                    f"{tok / t['torch']:,.0f}",
                    C.fmt_ratio(r),
                    mem,
                ]
            )
            print(f"  T={T} {mode}: xla {C.fmt_s(t['xla'])}, torch {C.fmt_s(t['torch'])}, ratio {r:.2f}x", flush=True)

    table = C.markdown_table(
        [
            "T",
            "pass",
            "XLA chunked (ours)",
            "XLA tokens/s",
            "torch chunked (transformers)",
            "torch tokens/s",
            "speed-up (torch time / ours)",
            "our fwd+bwd temporaries (compiled)",
        ],
        rows,
    )
    goal_lines = []
    for mode in args.modes:
        long = [ratios[(mode, T)] for T in args.seq if T >= 4096 and (mode, T) in ratios]
        goal_lines.append(
            C.goal_line(
                f"gated delta rule {mode} time, torch / ours, min over T >= 4K",
                min(long) if long else None,
                2.0,
                why_missed="see the gated delta notes in RESULTS.md",
            )
        )
    body = (
        table
        + f"\n\nOutputs checked first: max |Δo| = {d_o:.2e}, max |ΔS| = {d_s:.2e}.\n\n"
        + "\n".join(f"- {g}" for g in goal_lines)
        + "\n"
    )
    settings = (
        f"B={B}, H={H}, K=V={D}, chunk {args.chunk}, fp32, q/k L2-norm in the rule, repeats {args.repeats} "
        f"(median of interleaved repeats, min over {args.runs} runs; fewer repeats when over {args.budget_s:g} s), fwd+bwd up to T={args.bwd_max_seq}; torch.set_num_threads({threads}) = JAX's CPU thread count"
    )
    C.append_results(
        "Gated delta rule: XLA chunked vs transformers torch chunked (bench_gated_delta.py)",
        body,
        settings=settings,
        record=not args.no_record,
    )
    for g in goal_lines:
        print(g)
    return ratios


if __name__ == "__main__":
    main()
