"""One attention block (q/k/v projections + attention + o_proj): teacher vs HydraHead 7:1 vs layer-wise 3:1 / 7:1.

    python bench/bench_attention.py                      # both shapes, T = 1K … 64K as far as time allows
    python bench/bench_attention.py --shapes qwen3 --seq 8192 32768
    python bench/bench_attention.py --quick              # smoke run (small T, one repeat, nothing recorded)

Blocks measured (batch 1, fp32, random weights — cost does not depend on the values):
  teacher      every KV group softmax, our blockwise ``flash_attention`` (XLA path, recomputing custom_vjp):
               the FAIR baseline (docs/design.md §10) — O(T) memory, like the hybrid.
  xla-dense    the same block with XLA's ``jax.nn.dot_product_attention``, which materialises the [T, T] scores:
               the second baseline (what a user gets without a blockwise kernel).
  1-FA         HydraHead block with one FA KV group, the others Gated DeltaNet (conv, output gate, fusion on).
  all-LA       every group Gated DeltaNet (a layer-wise hybrid's LA layers; a HydraHead layer with no FA group).

Variants reported (cost per layer, averaged over the model's L-layer attention stack, from the blocks above):
  HydraHead 7:1   Qwen3-1.7B (8 groups/layer): 1 FA group in every layer = the 1-FA block.
                  SmolLM2 (3 groups/layer, 90 in all): 7:1 needs global allocation, round(90/8) = 11 FA groups;
                  we take them in 11 distinct layers (the usual outcome of a global top-k), so the stack costs
                  (11·t(1-FA) + 19·t(all-LA)) / 30 per layer.
  layer-wise r    every p-th layer all-FA (HeadMap.layerwise: 3:1 → p = 4, 7:1 → p = 8, ending at the last
                  layer), the rest all-LA: (n_FA·t(teacher) + (L − n_FA)·t(all-LA)) / L.
Time is the median of interleaved repetitions (bench/_common.py); memory is the compiled executable's
argument + output + temp bytes (XLA memory_analysis), deterministic and available without running; in fwd+bwd
the cotangent dy reaches the backward only once the block's output exists, as in a training step. For the
stack variants the memory column is the same per-layer average (what one layer of the stack holds on average).
Every ratio is teacher / variant (> 1: the variant is faster / smaller) from numbers measured in this run.

A T whose predicted time (quadratic extrapolation from the last measured T) exceeds --max-call-s is not timed
(reported as skipped with that reason); its memory is still reported. An OOM is caught and reported.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hydrahead_jax.config import ModelConfig  # noqa: E402
from hydrahead_jax.hybrid import HeadMap, HybridConfig, HydraHeadAttention, fa_budget  # noqa: E402
from hydrahead_jax.models.attention import Attention  # noqa: E402

SHAPES = {
    # SmolLM2-135M: 30 layers, d 576, 9 q / 3 kv heads, head_dim 64.
    "smollm2": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=1e5,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        name="SmolLM2-135M shapes",
    ),
    # Qwen3-1.7B: 28 layers, d 2048, 16 q / 8 kv heads, head_dim 128, q/k RMSNorm.
    "qwen3": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        architecture="qwen3",
        qk_norm=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        name="Qwen3-1.7B shapes",
    ),
}
BLOCKS = ("teacher", "1-FA", "all-LA", "xla-dense")
VARIANTS = ("teacher", "HydraHead 7:1", "layer-wise 3:1", "layer-wise 7:1", "xla-dense")


class DenseAttention(Attention):
    """The teacher block with XLA's materialising ``jax.nn.dot_product_attention`` (the second baseline)."""

    takes_sharded_order = False  # no context-parallel kernel: under a sequence mesh it runs on the natural order

    def full_attention(self, q, k, v, cache, cache_index, segment_ids=None):
        if segment_ids is not None:
            raise ValueError("the dense baseline runs one sequence per row (segment_ids=None).")
        return jax.nn.dot_product_attention(q, k, v, scale=self.scale, is_causal=True), cache


def make_block(cfg: ModelConfig, kind: str) -> Attention:
    hc = HybridConfig(attention_implementation="xla", gdn_implementation="xla")
    rngs = nnx.Rngs(0)
    if kind == "teacher":
        return Attention(cfg, rngs=rngs, attention_impl="xla")
    if kind == "xla-dense":
        return DenseAttention(cfg, rngs=rngs, attention_impl="xla")
    if kind == "1-FA":
        return HydraHeadAttention(cfg, rngs=rngs, fa_counts=(1,), hybrid_cfg=hc)
    if kind == "all-LA":
        return HydraHeadAttention(cfg, rngs=rngs, fa_counts=(0,), hybrid_cfg=hc)
    raise ValueError(kind)


def stack_weights(cfg: ModelConfig) -> dict[str, dict[str, float]]:
    """Per-layer weights of the measured blocks in each variant's L-layer stack (see module doc)."""
    L = cfg.num_layers
    out = {"teacher": {"teacher": 1.0}, "xla-dense": {"xla-dense": 1.0}}
    if cfg.num_kv_heads >= 8:  # per-layer allocation: one FA group in every layer
        out["HydraHead 7:1"] = {"1-FA": 1.0}
    else:
        n = fa_budget(cfg, "7:1", "global")
        if n > L:
            raise ValueError(f"{n} FA groups do not fit in {L} distinct layers")
        out["HydraHead 7:1"] = {"1-FA": n / L, "all-LA": (L - n) / L}
    for r in ("3:1", "7:1"):
        n = sum(1 for g in HeadMap.layerwise(cfg, r).fa_groups if g)
        out[f"layer-wise {r}"] = {"teacher": n / L, "all-LA": (L - n) / L}
    return out


def build_fns(block: Attention, T: int, mode: str):
    """(jitted fn, args) of the block's forward (mode 'fwd') or forward+backward (mode 'fwdbwd') at length T."""
    graphdef, state = nnx.split(block)
    d = block.cfg.hidden_size
    kx, kd = jax.random.split(jax.random.key(T))
    x = jax.random.normal(kx, (1, T, d), jnp.float32)
    positions = jnp.arange(T, dtype=jnp.int32)[None]

    def fwd(state, x):
        return nnx.merge(graphdef, state)(x, positions)[0]

    if mode == "fwd":
        return jax.jit(fwd), (state, x)
    dy = jax.random.normal(kd, (1, T, d), jnp.float32)

    def loss(state, x, dy):
        # The barrier hands dy to the backward only once the block's output exists, as in a training step (where a
        # layer's cotangent comes back through every later layer): with dy a free argument, XLA would start the
        # backward's dy-only work (dy · W_oᵀ, its transposes) before the forward and hold it through the forward.
        y, dy = jax.lax.optimization_barrier((fwd(state, x), dy))
        return jnp.vdot(y, dy)

    def fwdbwd(state, x, dy):
        # Gradients w.r.t. every parameter and the input, for the cotangent dy: one training step's attention work.
        return jax.grad(loss, argnums=(0, 1))(state, x, dy)

    return jax.jit(fwdbwd), (state, x, dy)


def _available_bytes():
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_shape(
    name: str,
    cfg: ModelConfig,
    seqs,
    modes,
    *,
    repeats: int,
    max_call_s: float,
    dense_time_max: int,
    time_max_seq: int = 1 << 30,
    log=print,
):
    """results[mode][T] = {"time": {block: s | None}, "mem": {block: bytes | None}, "note": {block: str}}."""
    blocks = {k: make_block(cfg, k) for k in BLOCKS}
    results = {m: {} for m in modes}
    for mode in modes:
        last: dict[str, tuple[int, float]] = {}  # block -> (T, seconds) of its last measurement
        for T in seqs:
            res = {"time": {}, "mem": {}, "note": {}}
            compiled, args_of = {}, {}
            for k, blk in blocks.items():
                try:
                    fn, args = build_fns(blk, T, mode)
                    exe = fn.lower(*args).compile()
                    ma = exe.memory_analysis()
                    res["mem"][k] = int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes)
                    compiled[k], args_of[k] = exe, args
                except Exception as e:  # noqa: BLE001 — report and go on: a bench fails only on real errors
                    if not C.is_oom(e):
                        raise
                    res["mem"][k], res["note"][k] = None, "OOM at compile"
            timed = {}
            for k, exe in compiled.items():
                avail = _available_bytes()
                if avail is not None and res["mem"][k] > 0.85 * avail:
                    # A kernel OOM kill cannot be caught: do not run what would not fit. Blocks run one at a time
                    # (compiled executables hold no buffers), so only the one running needs to fit.
                    res["note"][k] = f"not run: needs {C.fmt_bytes(res['mem'][k])}, {C.fmt_bytes(avail)} available"
                    continue
                if T > time_max_seq:
                    res["note"][k] = f"memory only (T > --time-max-seq {time_max_seq})"
                    continue
                if k == "xla-dense" and T > dense_time_max:
                    res["note"][k] = f"not timed above T={dense_time_max} (materialises {C.fmt_bytes(res['mem'][k])})"
                    continue
                if k in last:
                    # all-LA is linear in T; everything with softmax heads is extrapolated as quadratic. The hybrid
                    # blocks get 4x the budget: whether they run at long T is itself a goal.
                    t0, s0 = last[k]
                    predicted = s0 * (T / t0) ** (1 if k == "all-LA" else 2)
                    limit = max_call_s * (4 if k in ("1-FA", "all-LA") else 1)
                    if predicted > limit:
                        res["note"][k] = f"not timed: predicted {predicted:.0f} s > {limit:g} s"
                        continue
                timed[k] = lambda exe=exe, a=args_of[k]: exe(*a)
            try:
                # One warm-up round; calls of several seconds are then timed once more only, short ones `repeats` times.
                t_first = {}
                for k, f in timed.items():
                    t0 = time.perf_counter()
                    C.block(f())
                    t_first[k] = time.perf_counter() - t0
                slowest = max(t_first.values(), default=0.0)
                reps = repeats if slowest < 2.0 else (2 if slowest < max_call_s / 3 else 1)
                times = C.time_interleaved(timed, reps, warmup=False) if timed else {}
            except Exception as e:  # noqa: BLE001
                if not C.is_oom(e):
                    raise
                times = {}
                for k in timed:
                    res["note"][k] = f"OOM when run: {str(e).splitlines()[0][:80]}"
            for k in blocks:
                res["time"][k] = times.get(k)
                if k in times:
                    last[k] = (T, times[k])
            results[mode][T] = res
            log(
                f"  [{name} {mode} T={T}] "
                + ", ".join(f"{k}: {C.fmt_s(res['time'][k])} / {C.fmt_bytes(res['mem'][k])}" for k in blocks)
            )
            del compiled
    return results


def combine(res, weights) -> tuple[dict, dict]:
    """Per-variant time and memory from the measured blocks (None when a needed block is missing)."""
    time_v, mem_v = {}, {}
    for v, w in weights.items():
        for src, dst in (("time", time_v), ("mem", mem_v)):
            vals = [res[src].get(b) for b in w]
            dst[v] = None if any(x is None for x in vals) else sum(res[src][b] * f for b, f in w.items())
    return time_v, mem_v


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def tables(name, cfg, results, weights):
    out, summary = [], {}
    for mode, per_t in results.items():
        label = "forward" if mode == "fwd" else "forward+backward"
        rows_t, rows_m = [], []
        for T, res in per_t.items():
            tv, mv = combine(res, weights)
            summary[(mode, T)] = (tv, mv)
            rows_t.append(
                [T]
                + [C.fmt_s(tv["teacher"])]
                + [f"{C.fmt_s(tv[v])} ({C.fmt_ratio(ratio(tv['teacher'], tv[v]))})" for v in VARIANTS[1:]]
            )
            rows_m.append(
                [T]
                + [C.fmt_bytes(mv["teacher"])]
                + [f"{C.fmt_bytes(mv[v])} ({C.fmt_ratio(ratio(mv['teacher'], mv[v]))})" for v in VARIANTS[1:4]]
                + [f"{C.fmt_bytes(mv['xla-dense'])} ({C.fmt_ratio(ratio(mv['xla-dense'], mv['HydraHead 7:1']))})"]
            )
            notes = "; ".join(f"{k}: {n}" for k, n in res["note"].items())
            if notes:
                rows_t[-1].append(notes)
            else:
                rows_t[-1].append("")
        out.append(
            f"**{cfg.name}, one block, {label}: time per layer (teacher / variant in parentheses)**\n\n"
            + C.markdown_table(["T", "teacher (blockwise FA)"] + [f"{v}" for v in VARIANTS[1:]] + ["notes"], rows_t)
        )
        out.append(
            f"**{cfg.name}, one block, {label}: compiled memory per layer (teacher / variant; last column: "
            "xla-dense and dense / HydraHead 7:1)**\n\n"
            + C.markdown_table(
                [
                    "T",
                    "teacher (blockwise FA)",
                    "HydraHead 7:1",
                    "layer-wise 3:1",
                    "layer-wise 7:1",
                    "xla-dense (dense / HydraHead)",
                ],
                rows_m,
            )
        )
    return "\n\n".join(out), summary


def plot(all_results, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(all_results)
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 4.6 * len(names)), squeeze=False)
    styles = {
        "teacher": "k-o",
        "HydraHead 7:1": "C3-s",
        "layer-wise 3:1": "C0-^",
        "layer-wise 7:1": "C2-v",
        "xla-dense": "C7--x",
    }
    for row, name in enumerate(names):
        cfg, summary = all_results[name]
        mode = "fwdbwd" if any(m == "fwdbwd" for m, _ in summary) else "fwd"
        Ts = sorted(T for m, T in summary if m == mode)
        for col, (idx, ylabel) in enumerate(((0, "seconds per layer"), (1, "compiled bytes per layer"))):
            ax = axes[row][col]
            for v in VARIANTS:
                pts = [(T, summary[(mode, T)][idx][v]) for T in Ts if summary[(mode, T)][idx][v] is not None]
                if pts:
                    ax.plot(*zip(*pts), styles[v], label=v, ms=4)
            ref = [(T, summary[(mode, T)][idx]["teacher"]) for T in Ts if summary[(mode, T)][idx]["teacher"]]
            if ref:
                t0, y0 = ref[0]
                xs = np.array([Ts[0], Ts[-1]], float)
                ax.plot(xs, y0 * (xs / t0), ":", color="gray", lw=1, label="∝ T (linear)")
                ax.plot(xs, y0 * (xs / t0) ** 2, "--", color="gray", lw=1, label="∝ T² (quadratic)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(ylabel)
            what = "time" if idx == 0 else "memory"
            ax.set_title(f"{cfg.name}: {what}, {'fwd+bwd' if mode == 'fwdbwd' else 'fwd'}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goals(all_results) -> list[str]:
    lines = []
    for cfg, summary in all_results.values():
        s = summary.get(("fwdbwd", 8192))
        if s is None:
            lines.append(f"{cfg.name} HydraHead 7:1 fwd+bwd at T=8K: not measured (T=8192 not in this run)")
        else:
            tv, mv = s
            why = (
                "Amdahl: the q/k/v/o projections (and the GDN heads' own work) are the same or larger in the "
                "hybrid, only the FA share of the quadratic work shrinks; see RESULTS.md notes"
            )
            lines.append(
                C.goal_line(
                    f"{cfg.name} block fwd+bwd T=8K time, teacher (blockwise FA) / HydraHead 7:1",
                    ratio(tv["teacher"], tv["HydraHead 7:1"]),
                    4,
                    why_missed=why,
                )
            )
            lines.append(  # both are O(T) with a blockwise teacher (docs/design.md §10): the aim is a bound on the excess
                C.goal_line(
                    f"{cfg.name} block fwd+bwd T=8K peak memory, HydraHead 7:1 / teacher (blockwise FA)",
                    ratio(mv["HydraHead 7:1"], mv["teacher"]),
                    1.5,
                    at_most=True,
                )
            )
            lines.append(
                C.goal_line(
                    f"{cfg.name} block fwd+bwd T=8K peak memory, XLA materialising attention / HydraHead 7:1",
                    ratio(mv["xla-dense"], mv["HydraHead 7:1"]),
                    4,
                )
            )
        s32 = summary.get(("fwdbwd", 32768))
        runs = s32 is not None and s32[0]["HydraHead 7:1"] is not None
        lines.append(
            f"{cfg.name} HydraHead 7:1 fwd+bwd at T=32K (aim: runs): "
            + (f"{C.fmt_s(s32[0]['HydraHead 7:1'])} per layer, met" if runs else "not run")
        )
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--modes", nargs="+", default=["fwdbwd", "fwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds for calls under 2 s")
    ap.add_argument(
        "--max-call-s",
        type=float,
        default=90.0,
        help="do not time a block whose predicted single-call time exceeds this",
    )
    ap.add_argument("--time-max-seq", type=int, default=32768, help="above this T report memory only")
    ap.add_argument("--dense-time-max", type=int, default=4096, help="largest T at which xla-dense is timed")
    ap.add_argument(
        "--plot",
        default=None,
        help="where the scaling plot goes (default: bench/scaling.png when recording, else "
        "$TMPDIR/hydrahead_bench/scaling.png: a --no-record run leaves the checkout as it was)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke settings: SmolLM2 shapes, T 256, fwd+bwd, 1 repeat, no plot, nothing recorded",
    )
    ap.add_argument("--no-record", action="store_true", help="do not write bench/RESULTS.md or bench/scaling.png")
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.seq, args.modes, args.repeats = ["smollm2"], [256], ["fwdbwd"], 1
        args.plot, args.no_record = "", True
    if args.plot is None:
        scratch = Path(tempfile.gettempdir()) / "hydrahead_bench"
        args.plot = str(scratch / "scaling.png" if args.no_record else Path(__file__).with_name("scaling.png"))
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)

    all_results, bodies = {}, []
    for name in args.shapes:
        cfg = SHAPES[name]
        weights = stack_weights(cfg)
        print(f"{cfg.name}: stack weights per variant {weights}", flush=True)
        results = run_shape(
            name,
            cfg,
            sorted(args.seq),
            args.modes,
            repeats=args.repeats,
            max_call_s=args.max_call_s,
            dense_time_max=args.dense_time_max,
            time_max_seq=args.time_max_seq,
            log=lambda s: print(s, flush=True),
        )
        body, summary = tables(name, cfg, results, weights)
        all_results[name] = (cfg, summary)
        bodies.append(body)
    goal_lines = goals(all_results)
    if args.plot:
        plot(all_results, Path(args.plot))
        print(f"plot written to {args.plot}")
    body = "\n\n".join(bodies) + "\n\n" + "\n".join(f"- {g}" for g in goal_lines) + "\n"
    settings = (
        f"batch 1, fp32, shapes {args.shapes}, T {sorted(args.seq)}, modes {args.modes}, repeats "
        f"{args.repeats} (median, interleaved), --max-call-s {args.max_call_s:g}, timed up to T={args.time_max_seq}, xla-dense timed up to "
        f"T={args.dense_time_max}; random weights; JAX threads = all {jax.devices()[0].platform} cores"
    )
    C.append_results(
        "Attention block: teacher vs HydraHead 7:1 vs layer-wise (bench_attention.py)",
        body,
        settings=settings,
        record=not args.no_record,
    )
    for g in goal_lines:
        print(g)
    return all_results


if __name__ == "__main__":
    main()
