"""Context parallelism: one SmolLM2-shaped transformer layer, fwd+bwd, tokens split over ``sequence`` = 8 devices
against one device (``sequence`` = 1), on 8 simulated CPU devices.

    python bench/bench_context_parallel.py                 # T = 64K: compiled memory and collective bytes; time
                                                           # at the lengths --time-max-seq allows
    python bench/bench_context_parallel.py --quick         # smoke run (T = 512, one repeat, nothing recorded)

Layers (``models.transformer.Block``: norms, attention, MLP; batch 1, fp32, random weights, XLA kernels):
  teacher   every KV group softmax attention.
  1-FA      HydraHead layer with one FA KV group, the others Gated DeltaNet (conv, output gate, fusion on).
  all-LA    every KV group Gated DeltaNet.
  7:1       the SmolLM2 7:1 stack's per-layer average (bench_attention.stack_weights: 11 of 30 layers 1-FA, the
            rest all-LA).

The layer runs as inside the model under a sequence mesh: its input [1, T, d] in the model's sharded token order
(``context_parallel.layout.MODEL_LAYOUT``) with the tokens split over ``sequence``, positions permuted alike.
Measured, from one run:
  memory    compiled per-device bytes (XLA memory_analysis: arguments + outputs + temporaries) of fwd+bwd;
            goal: sequence=8 needs ≤ 1/6 of sequence=1 (ratio ≥ 6x).
  time      min of --repeats calls of the compiled fwd+bwd (only up to --time-max-seq; CPU devices share the
            machine's cores, so this shows the work split, not a pod's speed-up).
  bytes     bytes each device sends in collectives per fwd+bwd, from the compiled HLO, with the ring algorithms'
            costs: all-gather result − operand, reduce-scatter operand − result, all-reduce 2(n−1)/n × operand,
            all-to-all (n−1)/n × operand, collective-permute the operand; × the trip count of the loops they sit
            in; goal: the 7:1 stack moves ≤ 1/4 of the teacher's (ratio ≥ 4x). Also shown without the all-reduces
            (here: the parameter gradients summed over the sequence devices, independent of T; a data-parallel
            run reduces them anyway): the tokens' share (K/V of the FA groups, GDN chunk states, halos).
Every ratio is computed from numbers measured in this run.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import SHAPES, make_block, stack_weights  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from hydrahead_jax.models.transformer import Block, to_model_order  # noqa: E402
from hydrahead_jax.training.sharding import make_mesh  # noqa: E402

LAYERS = ("teacher", "1-FA", "all-LA")
COLLECTIVES = ("all-gather", "collective-permute", "all-reduce", "reduce-scatter", "all-to-all")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def _shape_bytes(text: str) -> int:
    """Bytes of an HLO type string: ``f32[1,64]{1,0}`` or a tuple of them."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * DTYPE_BYTES.get(dtype, 4)
    return total


def _group_size(line: str) -> int | None:
    """Devices per replica group of a collective, from its ``replica_groups`` (``mesh['s'=8] {'s'}``,
    ``{{0,1,..}}`` or the iota form ``[groups,size]<=[..]``); None when absent."""
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if named:
        sizes = dict(re.findall(r"'([\w]+)'=(\d+)", named.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([\w]+)'", named.group(2)) if a in sizes)
    listed = re.search(r"replica_groups=\{\{([\d,\s]+)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    return int(iota.group(2)) if iota else None


def _sent_bytes(op: str, operand: int, result: int, n: int | None) -> float:
    """Bytes one device sends for one collective, as the ring algorithms do (n: devices in its group)."""
    if op == "all-gather":
        return result - operand  # receives the other n−1 shards, forwards as many
    if op == "reduce-scatter":
        return operand - result
    if op == "all-reduce":
        return operand * (2 * (n - 1) / n if n else 2)  # reduce-scatter + all-gather
    if op == "all-to-all":
        return operand * ((n - 1) / n if n else 1)
    return operand  # collective-permute: the operand, once


def collective_bytes(hlo: str) -> dict[str, int]:
    """{collective op: bytes one device sends for it per execution of the module} from compiled HLO text
    (``_sent_bytes``).

    Each computation's direct collectives are summed (operand types looked up by name; an async ``-start`` counts,
    its ``-done`` does not), then the entry computation's total is accumulated through the computations it calls,
    a while loop's body weighted by its ``known_trip_count``."""
    computations: dict[str, list[str]] = {}
    current, entry = None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)  # a computation header (no indent)
        if head:
            current = head.group(2)
            computations[current] = []
            if head.group(1):
                entry = current
            continue
        if current is not None and line.strip() and line.strip() != "}":
            computations[current].append(line)
    memo: dict[str, dict[str, int]] = {}

    def total(name: str) -> dict[str, int]:
        if name in memo:
            return memo[name]
        memo[name] = {}
        types: dict[str, str] = {}
        out: dict[str, int] = {}
        for line in computations.get(name, []):
            m = _INSTR.match(line)
            if not m:
                continue
            var, rtype, op, rest = m.groups()
            types[var] = rtype
            base = op.removesuffix("-start")
            if base in COLLECTIVES and not op.endswith("-done"):
                operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
                size = sum(_shape_bytes(types.get(o, "")) for o in operands) or _shape_bytes(rtype)
                out[base] = out.get(base, 0) + _sent_bytes(base, size, _shape_bytes(rtype), _group_size(line))
            trips = 1
            if op == "while":
                found = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                trips = int(found.group(1)) if found else 1
            for callee in re.findall(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%?([\w.\-, %]+)", line):
                for c in re.split(r",\s*%?", callee):
                    c = c.strip().lstrip("%")
                    if c in computations and c != name:
                        weight = trips if f"body=%{c}" in line or f"body={c}" in line else 1
                        for k, v in total(c).items():
                            out[k] = out.get(k, 0) + weight * v
        memo[name] = out
        return out

    return total(entry) if entry else {}


def layer_step(cfg, kind: str, T: int, mesh):
    """(jitted fwd+bwd of one layer, abstract arguments, concrete-argument maker) under ``mesh``."""
    layer = Block(cfg, make_block(cfg, kind), rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(layer)
    n = int(mesh.shape["sequence"])
    tokens = NamedSharding(mesh, P(None, "sequence" if n > 1 else None, None))
    ids_sharding = NamedSharding(mesh, P(None, "sequence" if n > 1 else None))
    replicated = NamedSharding(mesh, P())

    def loss(state, x, positions, dy):
        y, _ = nnx.merge(graphdef, state)(x, positions)
        # dy reaches the backward only once the layer's output exists, as in a training step (bench_attention).
        y, dy = jax.lax.optimization_barrier((y, dy))
        return jnp.vdot(y, dy)

    step = jax.jit(
        jax.grad(loss, argnums=(0, 1)),
        in_shardings=(replicated, tokens, ids_sharding, tokens),
        out_shardings=(replicated, tokens),
    )
    d = cfg.hidden_size
    abstract = (
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state),
        jax.ShapeDtypeStruct((1, T, d), jnp.float32),
        jax.ShapeDtypeStruct((1, T), jnp.int32),
        jax.ShapeDtypeStruct((1, T, d), jnp.float32),
    )

    def concrete():
        kx, kd = jax.random.split(jax.random.key(T))
        positions = to_model_order(jnp.arange(T, dtype=jnp.int32)[None], n)
        return (
            jax.device_put(state, replicated),
            jax.device_put(jax.random.normal(kx, (1, T, d), jnp.float32), tokens),
            jax.device_put(positions, ids_sharding),
            jax.device_put(jax.random.normal(kd, (1, T, d), jnp.float32), tokens),
        )

    return step, abstract, concrete


def measure(cfg, T: int, sequence: int, *, timed: bool, repeats: int, log=print) -> dict[str, dict]:
    """{layer: {"mem": bytes, "bytes": collective bytes, "by_op": {...}, "time": s | None}} at length T."""
    devices = jax.devices()[:sequence]
    mesh = make_mesh(1, 1, 1, devices=devices, sequence=sequence)
    out = {}
    for kind in LAYERS:
        step, abstract, concrete = layer_step(cfg, kind, T, mesh)
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = step.lower(*abstract).compile()
        ma = compiled.memory_analysis()
        mem = int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes)
        by_op = collective_bytes(compiled.as_text())
        tokens = sum(v for k, v in by_op.items() if k != "all-reduce")
        res = {"mem": mem, "bytes": sum(by_op.values()), "tokens": tokens, "by_op": by_op, "time": None}
        if timed:
            args = concrete()
            with jax.set_mesh(mesh):
                C.block(compiled(*args))  # warm-up
                samples = []
                for _ in range(repeats):
                    t1 = time.perf_counter()
                    C.block(compiled(*args))
                    samples.append(time.perf_counter() - t1)
            res["time"] = min(samples)
        log(
            f"  T={T} sequence={sequence} {kind}: mem {C.fmt_bytes(mem)}, collectives {C.fmt_bytes(res['bytes'])} "
            f"{by_op}, time {C.fmt_s(res['time'])} (compile {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        out[kind] = res
    weights = stack_weights(cfg)["HydraHead 7:1"]
    out["7:1"] = {
        key: (None if any(out[k][key] is None for k in weights) else sum(w * out[k][key] for k, w in weights.items()))
        for key in ("mem", "bytes", "tokens", "time")
    }
    return out


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[65536])
    ap.add_argument("--sequence", type=int, default=8, help="devices the tokens are split over")
    ap.add_argument("--time-max-seq", type=int, default=8192, help="time only lengths up to this")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq, args.repeats, args.no_record, args.time_max_seq = [512], 1, True, 512
    if jax.device_count() < args.sequence:
        raise SystemExit(f"needs {args.sequence} devices, {jax.device_count()} visible (set XLA_FLAGS before jax).")
    cfg = SHAPES["smollm2"]
    results = {}
    for T in args.seq:
        if T % (2 * args.sequence):
            raise SystemExit(f"--seq {T} must be a multiple of 2 x --sequence = {2 * args.sequence}.")
        timed = T <= args.time_max_seq
        one = measure(cfg, T, 1, timed=timed, repeats=args.repeats)
        split = measure(cfg, T, args.sequence, timed=timed, repeats=args.repeats)
        results[T] = (one, split)
    n = args.sequence
    rows = []
    for T, (one, split) in results.items():
        for kind in (*LAYERS, "7:1"):
            a, b = one[kind], split[kind]
            rows.append(
                [
                    T,
                    kind,
                    C.fmt_bytes(a["mem"]),
                    f"{C.fmt_bytes(b['mem'])} ({C.fmt_ratio(_ratio(a['mem'], b['mem']))})",
                    C.fmt_s(a["time"]),
                    f"{C.fmt_s(b['time'])} ({C.fmt_ratio(_ratio(a['time'], b['time']))})",
                    C.fmt_bytes(b["bytes"]),
                    C.fmt_ratio(_ratio(split["teacher"]["bytes"], b["bytes"])),
                    C.fmt_bytes(b["tokens"]),
                    C.fmt_ratio(_ratio(split["teacher"]["tokens"], b["tokens"])),
                ]
            )
    header = [
        "T",
        "layer",
        "memory seq=1",
        f"memory seq={n} (1/x)",
        "time seq=1",
        f"time seq={n} (speed-up)",
        f"bytes sent seq={n}",
        "teacher / layer",
        "without all-reduce",
        "teacher / layer",
    ]
    body = C.markdown_table(header, rows)
    T_last = max(results)
    one, split = results[T_last]
    goals = [
        C.goal_line(
            f"7:1 layer memory per device, seq=1 / seq={n} at T={T_last}",
            _ratio(one["7:1"]["mem"], split["7:1"]["mem"]),
            6.0,
        ),
        C.goal_line(
            f"collective bytes at T={T_last}, teacher / 7:1",
            _ratio(split["teacher"]["bytes"], split["7:1"]["bytes"]),
            4.0,
        ),
    ]
    body += "\n\n" + "\n".join(goals)
    body += (
        f"\n(without the all-reduces of parameter gradients, teacher / 7:1 = "
        f"{C.fmt_ratio(_ratio(split['teacher']['tokens'], split['7:1']['tokens']))}: what the tokens cost)"
    )
    C.append_results(
        "Context parallelism: one SmolLM2-shaped layer, fwd+bwd, sequence=8 vs 1 (bench_context_parallel.py)",
        body,
        settings=f"T {args.seq}, sequence {n} vs 1 on {jax.device_count()} CPU devices, batch 1, fp32, "
        f"time up to T={args.time_max_seq} (min of {args.repeats})",
        record=not args.no_record,
    )
    return results


if __name__ == "__main__":
    main()
