"""Long context: prefill and decode cost at 8K / 32K / 128K tokens, teacher vs HydraHead 7:1 with pure Gated DeltaNet
LA heads and with streaming LA heads (`make demo`'s student) (SmolLM2-135M shapes), and the longest context each
fits in a memory budget (24 GiB by default).

    python bench/bench_long_context.py                                   # 8K, 32K, 128K; times what is cheap
    python bench/bench_long_context.py --time-prefill-max 32768 --time-decode-max 131072   # a quiet, big box
    python bench/bench_long_context.py --quick                           # smoke run (2 layers, small contexts)

Models: the shapes of bench_decode.py (SmolLM2-135M: 30 layers, d 576, 9 q / 3 kv heads, head_dim 64, vocab 49,152)
with random weights, and the HydraHead students with bench_decode's 7:1 global head map (11 FA groups of 90; the
streaming one adds to each LA head its teacher head's softmax over 4 sinks and the last 64 tokens). The
executables are the evaluation runner's (``hydrahead_jax.evaluation.runner``): a prefill that fills the decode cache
and projects only the last position, and a one-token decode step with the cache donated.

Per model and context, compile-only (nothing allocated, so every context is reported):
  prefill memory   argument + output + temp − alias bytes of the compiled prefill (parameters, cache, activations)
  decode memory    the same for one decode step at that context
  cache bytes      the decode cache at that context (``hybrid.cache_bytes``: KV of FA groups + GDN/conv state)
Measured where ``--time-prefill-max`` / ``--time-decode-max`` allow (and the compiled need fits in free memory):
  prefill time     one prefill of random ids (the median of ``--prefill-repeats`` interleaved runs)
  decode time      per token, median over ``--steps`` interleaved steps from a cache pre-filled with random values
Longest context in the budget: need(T) = max(prefill, decode memory) is affine in T for both models (flash attention
keeps no [T, T] matrix; the cache and the chunked GDN states grow linearly), so T* is solved from the two largest
measured contexts and checked by compiling at T* (stepping down 5 % while it does not fit).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import SHAPES  # noqa: E402
from bench_decode import GDN, STREAMING, filled_cache, hydrahead_map  # noqa: E402
from flax import nnx  # noqa: E402

from hydrahead_jax.evaluation.runner import _decode, _prefill, available_memory_bytes, compiled_bytes  # noqa: E402
from hydrahead_jax.hybrid import HybridConfig, build_model, cache_bytes  # noqa: E402
from hydrahead_jax.models import Transformer  # noqa: E402

TITLE = "Long context: prefill / decode cost at 8K-128K and the longest context in 24 GiB (bench_long_context.py)"
OUT = Path(__file__).with_name("results") / "long_context"


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def compiled_needs(graphdef, state_sds, model, context: int, extra: int) -> dict:
    """Compile-only memory of prefill (context tokens into a cache of context + extra) and of a decode step."""
    cache = abstract(jax.eval_shape(lambda: model.init_cache(1, context + extra)))
    ids = jax.ShapeDtypeStruct((1, context), jnp.int32)
    t0 = time.perf_counter()
    prefill = compiled_bytes(_prefill.lower(graphdef, state_sds, ids, cache).compile())
    token = jax.ShapeDtypeStruct((1,), jnp.int32)
    decode = compiled_bytes(_decode.lower(graphdef, state_sds, token, cache).compile())
    return {"prefill_bytes": prefill, "decode_bytes": decode, "compile_s": time.perf_counter() - t0}


def longest_context(graphdef, state_sds, model, points: dict[int, int], budget: int, extra: int) -> dict:
    """The largest T (a multiple of 1024) whose compiled need fits ``budget``, from the affine fit of ``points``
    (context → need bytes) checked by compiling at it."""
    (t1, m1), (t2, m2) = sorted(points.items())[-2:]
    slope = (m2 - m1) / (t2 - t1)
    guess = int((budget - (m2 - slope * t2)) / slope) // 1024 * 1024
    for _ in range(6):
        need = compiled_needs(graphdef, state_sds, model, guess, extra)
        top = max(need["prefill_bytes"], need["decode_bytes"])
        if top <= budget:
            return {"tokens": guess, "need_bytes": top, "slope_bytes_per_token": slope}
        guess = int(guess * 0.95) // 1024 * 1024
    return {"tokens": None, "need_bytes": None, "slope_bytes_per_token": slope}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--budget-gib", type=float, default=24.0, help="memory budget for the longest-context search")
    ap.add_argument("--time-prefill-max", type=int, default=8192, help="largest context whose prefill is timed")
    ap.add_argument("--time-decode-max", type=int, default=32768, help="largest context whose decode is timed")
    ap.add_argument("--prefill-repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="timed decode tokens per model and context")
    ap.add_argument("--no-longest", action="store_true", help="skip the longest-context search")
    ap.add_argument("--quick", action="store_true", help="smoke settings: 2 layers, contexts 512/1024, tiny budget")
    ap.add_argument("--no-record", action="store_true", help="print only; do not touch RESULTS.md or results/")
    args = ap.parse_args(argv)
    cfg = SHAPES["smollm2"]
    budget = int(args.budget_gib * C.GiB)
    if args.quick:
        cfg = cfg.replace(num_layers=2, vocab_size=1024, name="SmolLM2 shapes, 2 layers (quick)")
        args.contexts, args.steps, args.no_record = [512, 1024], 2, True
        args.time_prefill_max = args.time_decode_max = 1024
        budget = 256 * C.MiB

    head_map = hydrahead_map(cfg)
    hc = HybridConfig(attention_implementation="xla", gdn_implementation="xla")
    streaming = hc.replace(la_window=64, la_sinks=4, fusion_init="fit")
    builders = {
        "teacher": lambda: Transformer(cfg, rngs=nnx.Rngs(0), attention_impl="xla"),
        GDN: lambda: build_model(cfg, head_map, hc, nnx.Rngs(0)),
        STREAMING: lambda: build_model(cfg, head_map, streaming, nnx.Rngs(0)),
    }
    abstract_models = {name: nnx.eval_shape(b) for name, b in builders.items()}
    split = {name: nnx.split(m) for name, m in abstract_models.items()}
    extra = 1 + args.steps + 2  # decode slots after the context: the timed steps and 2 warm-up steps
    free, free_source = available_memory_bytes()
    print(f"{cfg.name}; HydraHead: {head_map.num_fa_groups()} FA groups; free memory {C.fmt_bytes(free)}", flush=True)

    results: dict = {name: {} for name in builders}
    for ctx in args.contexts:
        for name, m in abstract_models.items():
            gd, st = split[name]
            rec = compiled_needs(gd, abstract(nnx.as_pure(st)), m, ctx, extra)
            rec["cache_bytes"] = int(cache_bytes(m, context_len=ctx)["total_bytes"])
            results[name][ctx] = rec
            print(
                f"  {name} @ {ctx}: prefill {C.fmt_bytes(rec['prefill_bytes'])}, decode "
                f"{C.fmt_bytes(rec['decode_bytes'])}, cache {C.fmt_bytes(rec['cache_bytes'])} "
                f"(compiled in {rec['compile_s']:.0f} s)",
                flush=True,
            )

    # timings: real (random) weights; a model is materialised only when something of it is timed
    timed = [c for c in args.contexts if c <= max(args.time_prefill_max, args.time_decode_max)]
    if timed:
        # pure states, as compiled_needs lowered them: the same programs, so jit reuses those executables
        models = {}
        for name, build in builders.items():
            gd, st = nnx.split(build())
            models[name] = (gd, nnx.as_pure(st))
        for ctx in timed:
            fits = {
                n: max(results[n][ctx]["prefill_bytes"], results[n][ctx]["decode_bytes"]) < 0.8 * free for n in models
            }
            if ctx <= args.time_prefill_max and all(fits.values()):
                ids = jnp.asarray(np.random.default_rng(ctx).integers(0, cfg.vocab_size, (1, ctx)), jnp.int32)

                def prefill(gd, st, m, ids=ids, length=ctx + extra):
                    return _prefill(gd, st, ids, m.init_cache(1, length))[0]

                fns = {n: functools.partial(prefill, gd, st, abstract_models[n]) for n, (gd, st) in models.items()}
                for n, s in C.time_interleaved(fns, args.prefill_repeats).items():
                    results[n][ctx]["prefill_s"] = s
            if ctx <= args.time_decode_max and all(fits.values()):
                caches = {n: filled_cache(abstract_models[n], ctx, ctx + extra, seed=i) for i, n in enumerate(models)}
                token = jnp.zeros((1,), jnp.int32)
                samples = {n: [] for n in models}
                for step in range(2 + args.steps):
                    for n, (gd, st) in models.items():  # interleaved: a token of each model in turn
                        t0 = time.perf_counter()
                        logits, caches[n] = _decode(gd, st, token, caches[n])
                        jax.block_until_ready(logits)
                        if step >= 2:
                            samples[n].append(time.perf_counter() - t0)
                del caches
                for n, s in samples.items():
                    results[n][ctx]["decode_s_per_token"] = statistics.median(s)
            print(f"  timed @ {ctx}: " + ", ".join(f"{n} {results[n][ctx]}" for n in models), flush=True)
        del models

    longest = {}
    if not args.no_longest and len(args.contexts) >= 2:
        for name, m in abstract_models.items():
            gd, st = split[name]
            points = {c: max(r["prefill_bytes"], r["decode_bytes"]) for c, r in results[name].items()}
            longest[name] = longest_context(gd, abstract(nnx.as_pure(st)), m, points, budget, extra)
            print(f"  longest context of {name} in {C.fmt_bytes(budget)}: {longest[name]}", flush=True)

    report(cfg, head_map, args, results, longest, budget, free, free_source)
    return results, longest


def report(cfg, head_map, args, results, longest, budget, free, free_source):
    teacher = results["teacher"]
    rows = []
    for ctx in args.contexts:
        t = teacher[ctx]
        for name, by_ctx in results.items():
            r = by_ctx[ctx]
            memory = [C.fmt_bytes(r[k]) for k in ("prefill_bytes", "decode_bytes", "cache_bytes")]
            ratios = [
                C.fmt_ratio(t[k] / r[k]) if r.get(k) and t.get(k) else "—"
                for k in ("cache_bytes", "prefill_s", "decode_s_per_token")
            ]
            rows.append(
                [ctx, name, *memory, ratios[0], C.fmt_s(r.get("prefill_s")), ratios[1]]
                + [C.fmt_s(r.get("decode_s_per_token")), ratios[2]]
            )
    table = C.markdown_table(
        [
            "context",
            "model",
            "prefill mem",
            "decode mem",
            "cache",
            "cache: teacher / this",
            "prefill",
            "prefill: teacher / this",
            "s/token",
            "decode: teacher / this",
        ],
        rows,
    )
    lines = [table, ""]
    for name, r in longest.items():
        lines.append(
            f"- longest context of {name} in {C.fmt_bytes(budget)}: "
            + (
                f"{r['tokens']:,} tokens (compiled need {C.fmt_bytes(r['need_bytes'])}; "
                f"{r['slope_bytes_per_token'] / 1024:.1f} KiB per token)"
                if r["tokens"]
                else "not found"
            )
        )
    untimed = [c for c in args.contexts if c > args.time_prefill_max]
    lines.append(
        "- memory is compile-only (XLA memory_analysis, nothing allocated); '—' = not timed in this run"
        + (f" (prefill above {args.time_prefill_max}, decode above {args.time_decode_max} tokens)" if untimed else "")
        + f"; free memory at the start {C.fmt_bytes(free)} ({free_source})"
    )
    settings = (
        f"{cfg.name}, random weights, batch 1, fp32 params and cache, attention and GDN 'xla'; HydraHead 7:1 global "
        f"map, {head_map.num_fa_groups()} FA groups (streaming: 4 sinks + 64 recent tokens per LA head); "
        f"{args.steps} timed decode tokens (median, interleaved, 2 warm-up)"
    )
    body = "\n".join(lines) + "\n"
    if args.no_record:
        print(body)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(
        json.dumps(
            {
                "results": {n: {str(c): r for c, r in v.items()} for n, v in results.items()},
                "longest": longest,
                "budget_bytes": budget,
                "settings": settings,
                "machine": C.machine_line(),
            },
            indent=1,
        )
    )
    plot(results, longest, budget, OUT / "long_context.png")
    body += "\n![long context](results/long_context/long_context.png)\n"
    replace_results_section(TITLE, body, settings)


def plot(results, longest, budget, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("prefill_bytes", "prefill memory (GiB, compiled)", C.GiB),
        ("decode_bytes", "decode-step memory (GiB, compiled)", C.GiB),
        ("cache_bytes", "decode cache (GiB)", C.GiB),
    ]
    if any(r.get("decode_s_per_token") is not None for by_ctx in results.values() for r in by_ctx.values()):
        panels.append(("decode_s_per_token", "decode time per token (ms)", 1e-3))  # a run that timed decoding
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (key, title, div) in zip(axes, panels):
        for name, by_ctx in results.items():
            pts = sorted((c, r[key] / div) for c, r in by_ctx.items() if r.get(key) is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, linestyle="--" if name == "teacher" else "-")
        if key.endswith("bytes") and key != "cache_bytes":
            ax.axhline(budget / div, color="gray", linestyle=":", linewidth=1)
            for r in longest.values():
                if r.get("tokens"):
                    ax.plot([r["tokens"]], [r["need_bytes"] / div], marker="*", markersize=10, color="gray")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("context (tokens)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_results_section(title: str, body: str, settings: str) -> None:
    """Write this benchmark's section of bench/RESULTS.md, replacing its earlier one (one section per benchmark)."""
    section = f"## {title}\n\n- machine: {C.machine_line()}\n- settings: {settings}\n\n{body.rstrip()}\n"
    print(section)
    text = C.RESULTS.read_text() if C.RESULTS.exists() else "# Benchmark results\n"
    start = text.find(f"## {title}\n")
    if start < 0:
        text = text.rstrip() + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + ("" if end < 0 else text[end:])
    C.RESULTS.write_text(text)


if __name__ == "__main__":
    main()
