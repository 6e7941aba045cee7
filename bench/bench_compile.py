"""Compile time against depth: the teacher and the HydraHead student at full depth vs a short model.

The layers run as one ``lax.scan`` whose body switches over the layers' FA-group counts (``Transformer.scan_layers``),
so compilation should cost about the same at 30 layers as for a model with one layer of each distinct FA count.
For each model this compiles (never runs; abstract weights, ``nnx.eval_shape``):

- ``fwd+grad``: the gradient of the mean next-token cross-entropy with respect to every parameter;
- ``stage 1/2/3``: the real train step of each stage (``training.steps.make_train_step``: stage 1 the per-layer
  alignment on the new parameters, stage 2 the KL to the teacher, stage 3 CE), with its compiled memory
  (arguments + outputs + temporaries − aliased, XLA's ``memory_analysis``).

Models: SmolLM2-135M shapes (30 layers), the teacher and the 7:1 student with the global head map of
``bench_decode.hydrahead_map``, each against its short model (the teacher: 1 layer; the student: one layer per
distinct FA count of its map). ``--qwen3``: the Qwen3-1.7B 7:1 recipe (per-layer map, f = 1 in all 28 layers),
train steps only, full depth. ``--code DIR`` measures another checkout's ``hydrahead_jax`` (e.g. the code before
the layers were scanned) with this same script; ``--before DIR`` runs that in a subprocess and reports both.
Timings are wall-clock seconds of ``lower().compile()``; on a shared machine compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

if "--code" in sys.argv:  # another checkout's hydrahead_jax, imported before anything else can import ours
    _CODE = Path(sys.argv[sys.argv.index("--code") + 1]).resolve()
    sys.path.insert(0, str(_CODE))
    import hydrahead_jax

    # The benchmark helpers below put this checkout first on sys.path when imported; the package is bound now.
    if not Path(hydrahead_jax.__file__).resolve().is_relative_to(_CODE):
        sys.exit(f"--code {_CODE}: imported {hydrahead_jax.__file__} instead; is {_CODE}/hydrahead_jax a checkout?")
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import SHAPES  # noqa: E402
from bench_decode import hydrahead_map  # noqa: E402
from flax import nnx  # noqa: E402

from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_model, new_param_filter  # noqa: E402
from hydrahead_jax.models import Transformer  # noqa: E402
from hydrahead_jax.training.steps import LossSettings, make_optimizer, make_train_step  # noqa: E402

STAGES = (("stage 1", "align"), ("stage 2", "distil"), ("stage 3", "long"))
HC = HybridConfig(attention_implementation="xla", gdn_implementation="xla")


def abstract(make):
    return nnx.split(nnx.eval_shape(make))


def teacher_of(cfg):
    return abstract(lambda: Transformer(cfg, rngs=nnx.Rngs(0), attention_impl="xla"))


def student_of(cfg, head_map):
    return abstract(lambda: build_model(cfg, head_map, HC, nnx.Rngs(1)))


def short_map(cfg, head_map) -> tuple:
    """(config, head map) with one layer per distinct FA count of ``head_map`` (the FA groups of its first layer
    with that count)."""
    first = {}
    for groups in head_map.fa_groups:
        first.setdefault(len(groups), groups)
    groups = [first[f] for f in sorted(first)]
    short = cfg.replace(num_layers=len(groups))
    return short, HeadMap.from_fa_groups(short, groups, method="benchmark")


def timed_compile(fn, *args):
    t0 = time.perf_counter()
    exe = jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - t0, exe


def compiled_memory(exe) -> int:
    ma = exe.memory_analysis()
    return int(
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        + ma.temp_size_in_bytes
        - getattr(ma, "alias_size_in_bytes", 0)
    )


def fwd_grad_compile(model, seq: int, batch: int) -> float:
    graphdef, state = model

    def loss(state, ids):
        logits = nnx.merge(graphdef, state)(ids[:, :-1])
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    ids = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    return timed_compile(jax.grad(loss), state, ids)[0]


def step_compile(student, teacher, kind: str, seq: int, batch: int, chunk: int, remat: bool) -> tuple[float, int]:
    graphdef, state = student
    model = nnx.merge(graphdef, state)
    gd, params, frozen = nnx.split(model, new_param_filter if kind == "align" else nnx.Param, ...)
    t_gd, t_state = teacher
    settings = LossSettings(kind=kind, chunk=chunk, ce_weight=1.0 if kind == "long" else 0.0, remat=remat)
    tx, _ = make_optimizer(lr=1e-4, warmup_steps=1, total_steps=100)
    train_state = {
        "params": params,
        "frozen": frozen,
        "opt_state": jax.eval_shape(tx.init, params),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    data = {
        "input_ids": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
        "targets": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct((batch, seq), jnp.float32),
    }
    step = make_train_step(gd, t_gd, tx, settings)
    learning_rate = jax.ShapeDtypeStruct((), jnp.float32)
    seconds, exe = timed_compile(step, train_state, t_state if settings.needs_teacher else None, data, learning_rate)
    return seconds, compiled_memory(exe)


def measure(args) -> dict:
    """{row name: {column: seconds or bytes}} for this checkout's code."""
    out: dict = {}
    cfg = SHAPES["smollm2"]
    full_map = hydrahead_map(cfg)
    small_cfg, small = short_map(cfg, full_map)
    models = {
        "teacher": ((teacher_of(cfg), None), (teacher_of(cfg.replace(num_layers=1)), None)),
        "student": (
            (student_of(cfg, full_map), teacher_of(cfg)),
            (student_of(small_cfg, small), teacher_of(small_cfg)),
        ),
    }
    for name, ((long_model, long_teacher), (short_model, short_teacher)) in models.items():
        for depth, model, teacher in (("full", long_model, long_teacher), ("short", short_model, short_teacher)):
            row = out.setdefault(f"{name} {depth}", {})
            row["layers"] = nnx.merge(*model).cfg.num_layers
            row["fwd+grad"] = fwd_grad_compile(model, args.seq, args.batch)
            print(f"  {name} {depth}: fwd+grad {row['fwd+grad']:.1f} s", flush=True)
            if name == "student" and not args.skip_steps:
                for label, kind in STAGES:
                    row[label], row[label + " memory"] = step_compile(
                        model, teacher, kind, args.seq, args.batch, args.chunk, args.remat
                    )
                    print(f"  {name} {depth}: {label} {row[label]:.1f} s", flush=True)
    if args.qwen3:
        qcfg = SHAPES["qwen3"]
        qmap = HeadMap.from_fa_groups(qcfg, [[0]] * qcfg.num_layers, method="benchmark", target_ratio="7:1")
        student, teacher = student_of(qcfg, qmap), teacher_of(qcfg)
        row = out.setdefault("qwen3-1.7B 7:1 full", {"layers": qcfg.num_layers})
        for label, kind in STAGES:
            row[label], row[label + " memory"] = step_compile(
                student, teacher, kind, args.qwen3_seq, 1, args.chunk, True
            )
            print(f"  qwen3: {label} {row[label]:.1f} s, {C.fmt_bytes(row[label + ' memory'])}", flush=True)
    return out


def table(results: dict, label: str) -> str:
    rows = []
    for name, row in results.items():
        cells = [f"{label}: {name}", row.get("layers", "—"), C.fmt_s(row.get("fwd+grad"))]
        for stage, _ in STAGES:
            cells += [C.fmt_s(row.get(stage)), C.fmt_bytes(row.get(stage + " memory"))]
        rows.append(cells)
    for name in ("teacher", "student"):
        full, short = results.get(f"{name} full", {}), results.get(f"{name} short", {})
        ratio = [f"{label}: {name} full / short", "", C.fmt_ratio(full["fwd+grad"] / short["fwd+grad"])]
        for stage, _ in STAGES:
            ratio += [C.fmt_ratio(full[stage] / short[stage]) if stage in full else "—", ""]
        rows.append(ratio)
    header = ["model", "layers", "fwd+grad compile"]
    for stage, _ in STAGES:
        header += [f"{stage} step compile", f"{stage} compiled memory"]
    return C.markdown_table(header, rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=256, help="token chunk of the KL / CE loops")
    ap.add_argument("--remat", action="store_true", help="per-layer rematerialisation in the train steps")
    ap.add_argument("--skip-steps", action="store_true", help="fwd+grad only")
    ap.add_argument("--qwen3", action="store_true", help="also the Qwen3-1.7B 7:1 recipe's train steps")
    ap.add_argument("--qwen3-seq", type=int, default=2048)
    ap.add_argument("--code", default=None, help="measure this checkout's hydrahead_jax (prints JSON)")
    ap.add_argument("--before", default=None, help="also measure this checkout (subprocess) and report both")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    if args.code:
        print("JSON " + json.dumps(measure(args)), flush=True)
        return None
    sections = []
    if args.before:
        passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--before", args.before)]
        proc = subprocess.run(
            [sys.executable, __file__, *passthrough, "--code", args.before],
            capture_output=True,
            text=True,
            check=True,
        )
        before = json.loads(next(line[5:] for line in proc.stdout.splitlines() if line.startswith("JSON ")))
        sections.append(table(before, "before"))
    after = measure(args)
    sections.append(table(after, "after"))
    settings = (
        f"compile only (abstract weights), SmolLM2-135M shapes, 7:1 global map of bench_decode.hydrahead_map; "
        f"seq {args.seq}, batch {args.batch}, loss chunk {args.chunk}, remat {args.remat}, XLA attention and "
        f"delta rule, fp32, one device"
        + (f"; Qwen3-1.7B seq {args.qwen3_seq}, remat" if args.qwen3 else "")
        + (f"; before = {args.before} measured by this script in the same run" if args.before else "")
    )
    C.append_results(
        "Compile time against depth (bench_compile.py)",
        "\n\n".join(sections) + "\n",
        settings=settings,
        record=not args.no_record,
    )
    return after


if __name__ == "__main__":
    main()
