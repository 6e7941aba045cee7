"""Decode: per-token latency and cache memory vs context length, teacher vs HydraHead 7:1 (SmolLM2-135M shapes),
with pure Gated DeltaNet LA heads (the paper's) and with streaming LA heads (`make demo`'s student).

    python bench/bench_decode.py                         # contexts 1K … 32K
    python bench/bench_decode.py --contexts 32768 --steps 16
    python bench/bench_decode.py --quick                 # smoke run

Both models have the SmolLM2-135M shapes (30 layers, d 576, 9 q / 3 kv heads, head_dim 64, vocab 49,152, tied
embeddings) with RANDOM weights: decode cost does not depend on the values. The HydraHead model uses a 7:1
global head map: round(90/8) = 11 FA groups (group 0 of 11 evenly spaced layers), the other 79 groups Gated
DeltaNet (conv, output gate, fusion on); the streaming student has the same map and adds to each LA head its
teacher head's softmax over its first 4 and last 64 tokens (``HybridConfig(la_window=64, la_sinks=4)``, a
constant-size ring cache). Each step is the model's own jitted decode step
(``hydrahead_jax.models.generate._decode_step``: one token, cache donated and updated in place).

The cache is pre-filled to the context length with random values of the right shapes (k/v for the FA groups,
GDN state, conv state and the streaming heads' window for the LA groups, index = context) instead of running a
prefill: one decode step's
cost depends only on the cache sizes, and a 32K teacher prefill would take far longer than the measurement.
Latency: median over ``--steps`` tokens, the three models' steps interleaved, after 2 warm-up steps each.
Cache memory: ``cache_bytes`` (the analytic formula in hydrahead_jax/hybrid/cache.py) and the bytes of the
actual cache pytree ``model.init_cache(1, context)`` allocates (they agree; the pytree adds the int32 index).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import SHAPES  # noqa: E402
from flax import nnx  # noqa: E402

from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_model, cache_bytes, fa_budget  # noqa: E402
from hydrahead_jax.models import Transformer  # noqa: E402
from hydrahead_jax.models.generate import _decode_step  # noqa: E402

GDN = "HydraHead 7:1"
STREAMING = "HydraHead 7:1 streaming"


def hydrahead_map(cfg) -> HeadMap:
    """7:1 global map: n FA groups (group 0) in n evenly spaced layers, ending at the last layer."""
    n = fa_budget(cfg, "7:1", "global")
    layers = {int(round(cfg.num_layers - 1 - j * cfg.num_layers / n)) for j in range(n)}
    return HeadMap.from_fa_groups(
        cfg,
        [[0] if i in layers else [] for i in range(cfg.num_layers)],
        method="benchmark",
        target_ratio="7:1",
        allocation="global",
    )


def filled_cache(model, context: int, capacity: int, seed: int):
    """A decode cache of ``capacity`` slots holding ``context`` random entries (random GDN / conv / window states)."""
    cache = model.init_cache(1, capacity)
    key = jax.random.key(seed)
    layers = []
    for layer in cache["layers"]:  # one stack per layer kind: [layers of the kind, batch, ...]
        new = {}
        for name, x in layer.items():
            key, sub = jax.random.split(key)
            if name in ("k", "v"):
                vals = jax.random.normal(sub, x.shape[:2] + (context,) + x.shape[3:], x.dtype)
                new[name] = x.at[:, :, :context].set(vals)
            else:  # gdn_state / conv_state / win_k / win_v: constant size, any finite value
                new[name] = (0.1 * jax.random.normal(sub, x.shape, jnp.float32)).astype(x.dtype)
        layers.append(new)
    return {"index": jnp.asarray(context, jnp.int32), "layers": tuple(layers)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--steps", type=int, default=10, help="timed tokens per model and context")
    ap.add_argument("--quick", action="store_true", help="smoke settings: 2 layers, contexts 256/512, 2 steps")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    cfg = SHAPES["smollm2"]
    if args.quick:
        cfg = cfg.replace(num_layers=2, vocab_size=1024, name="SmolLM2 shapes, 2 layers (quick)")
        args.contexts, args.steps, args.no_record = [256, 512], 2, True

    head_map = hydrahead_map(cfg)
    hc = HybridConfig(attention_implementation="xla", gdn_implementation="xla")
    models = {
        "teacher": Transformer(cfg, rngs=nnx.Rngs(0), attention_impl="xla"),
        GDN: build_model(cfg, head_map, hc, nnx.Rngs(0)),
        STREAMING: build_model(cfg, head_map, hc.replace(la_window=64, la_sinks=4, fusion_init="fit"), nnx.Rngs(0)),
    }
    split = {name: nnx.split(m) for name, m in models.items()}
    print(
        f"HydraHead head map: {head_map.num_fa_groups()} FA groups of {cfg.num_layers * cfg.num_kv_heads}, "
        f"layers {[i for i, g in enumerate(head_map.fa_groups) if g]}",
        flush=True,
    )

    rows, per_token = [], {}
    warm = 2
    for ctx in args.contexts:
        caches, mem = {}, {}
        for i, (name, m) in enumerate(models.items()):
            caches[name] = filled_cache(m, ctx, ctx + warm + args.steps, seed=i)
            analytic = cache_bytes(m, context_len=ctx)["total_bytes"]
            actual = C.tree_bytes(jax.eval_shape(lambda m=m, ctx=ctx: m.init_cache(1, ctx)))
            mem[name] = (analytic, actual)
        token = jnp.zeros((1,), jnp.int32)
        samples = {name: [] for name in models}
        for step in range(warm + args.steps):
            for name in models:  # interleaved: teacher token, HydraHead token, …
                gd, st = split[name]
                t0 = time.perf_counter()
                logits, caches[name] = _decode_step(gd, st, token, caches[name])
                jax.block_until_ready(logits)
                if step >= warm:
                    samples[name].append(time.perf_counter() - t0)
        del caches
        med = {name: statistics.median(s) for name, s in samples.items()}
        per_token[ctx] = med
        row = [ctx, C.fmt_s(med["teacher"])]
        for name in (GDN, STREAMING):
            row += [C.fmt_s(med[name]), C.fmt_ratio(med["teacher"] / med[name])]
        for name in models:
            row += [C.fmt_bytes(b) for b in mem[name]]
        row += [C.fmt_ratio(mem["teacher"][0] / mem[name][0]) for name in (GDN, STREAMING)]
        rows.append(row)
        print(
            f"  context {ctx}: teacher {C.fmt_s(med['teacher'])}/token, HydraHead {C.fmt_s(med[GDN])}/token "
            f"({med['teacher'] / med[GDN]:.2f}x), streaming {C.fmt_s(med[STREAMING])}/token "
            f"({med['teacher'] / med[STREAMING]:.2f}x); cache {C.fmt_bytes(mem['teacher'][0])} vs "
            f"{C.fmt_bytes(mem[GDN][0])} vs {C.fmt_bytes(mem[STREAMING][0])}",
            flush=True,
        )

    header = ["context", "teacher s/token", f"{GDN} s/token", "speed-up", f"{STREAMING} s/token", "speed-up"]
    for name in models:
        header += [f"{name} cache (cache_bytes)", f"{name} cache (pytree)"]
    header += [f"cache ratio, {GDN}", f"cache ratio, {STREAMING}"]
    table = C.markdown_table(header, rows)
    top = max(args.contexts)
    goal = (
        C.goal_line(
            f"decode time per token at {top} context, teacher / HydraHead 7:1",
            per_token[top]["teacher"] / per_token[top][GDN],
            3,
            why_missed="per-token cost also reads all ~135M parameters (0.5 GB fp32) for both models; "
            "only the KV-cache reads shrink",
        )
        if top >= 32768
        else f"decode time per token at 32K context, teacher / HydraHead 7:1: not measured (largest context: {top})"
    )
    streaming = f"decode time per token at {top} context, teacher / {STREAMING}: " + C.fmt_ratio(
        per_token[top]["teacher"] / per_token[top][STREAMING]
    )
    body = table + "\n\n- " + goal + "\n- " + streaming + "\n"
    settings = (
        f"{cfg.name}, random weights, batch 1, fp32 params and cache, {args.steps} timed tokens per context "
        "(median, interleaved, 2 warm-up), cache pre-filled with random values; HydraHead: 7:1 global map, "
        f"{head_map.num_fa_groups()} FA groups; the streaming student the same map with 4 sinks + 64 recent tokens "
        "per LA head"
    )
    C.append_results(
        "Decode: per-token latency and cache vs context (bench_decode.py)",
        body,
        settings=settings,
        record=not args.no_record,
    )
    print(goal)
    print(streaming)
    return per_token


if __name__ == "__main__":
    main()
