"""Training-step throughput (tokens/s) of the SmolLM2 HydraHead recipe, per stage, with the real step functions.

    python bench/bench_train_step.py                     # stage 1 align, 2 distil, 3 long
    python bench/bench_train_step.py --seq 512 1024 2048 --batch 2 1 1
    python bench/bench_train_step.py --quick             # smoke run

What is timed: ``hydrahead_jax.training.steps.make_train_step`` (loss, gradients, AdamW update — exactly the
step ``train.py`` runs), jitted with the train state donated, on one device. Models have the SmolLM2-135M shapes
with RANDOM weights (throughput does not depend on the values): the teacher, and a HydraHead student built from
it (``build_student``) with a 7:1 global head map (11 FA groups, the rest Gated DeltaNet). Stage 1 trains only
the new parameters (GDN + fusion), stages 2 and 3 all of them; stage 1 and 2 run the frozen teacher inside the
step (stage 1: its hidden states per layer; stage 2: its logits for the KL), stage 3 does not.
Sequence lengths default to the recipe's (``configs/smollm2_hydrahead.py`` when present, else 512 / 1024 / 2048),
batch 1 unless given. tokens/s = batch · seq / median step time (after one warm-up step).
"""

from __future__ import annotations

import argparse
import importlib
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
from bench_decode import hydrahead_map  # noqa: E402
from flax import nnx  # noqa: E402

from hydrahead_jax.hybrid import HybridConfig, build_student, new_param_filter  # noqa: E402
from hydrahead_jax.models import Transformer  # noqa: E402
from hydrahead_jax.training.steps import LossSettings, make_optimizer, make_train_step  # noqa: E402

STAGES = (
    ("stage 1 align", "align", "stage1"),
    ("stage 2 distil", "distil", "stage2"),
    ("stage 3 long", "long", "stage3"),
)
DEFAULT_SEQ = (512, 1024, 2048)


def recipe_seq_lens() -> tuple[tuple[int, ...], str]:
    """Sequence lengths of the SmolLM2 recipe config, if that config exists; else the defaults."""
    try:
        cfg = importlib.import_module("configs.smollm2_hydrahead").get_config()
        return tuple(int(cfg[key].seq_len) for _, _, key in STAGES), "configs/smollm2_hydrahead.py"
    except Exception:  # noqa: BLE001 — the recipe config is optional here
        return DEFAULT_SEQ, "defaults (no configs/smollm2_hydrahead.py)"


def stage_step(student, teacher, kind: str, seq: int, batch: int, chunk: int, remat: bool = False):
    """(compiled step, its inputs (state, teacher_state, batch, learning rate), compiled bytes) of one stage."""
    trainable = new_param_filter if kind == "align" else nnx.Param
    gd, params, frozen = nnx.split(student, trainable, ...)
    # The step donates its state: copy, so the student/teacher arrays (shared by build_student) stay alive.
    params, frozen = jax.tree.map(jnp.copy, (params, frozen))
    t_gd, t_state = nnx.split(teacher)
    settings = LossSettings(kind=kind, chunk=chunk, ce_weight=1.0 if kind == "long" else 0.0, remat=remat)
    tx, schedule = make_optimizer(lr=1e-4, warmup_steps=1, total_steps=100)
    step = jax.jit(make_train_step(gd, t_gd, tx, settings), donate_argnums=(0,))
    state = {"params": params, "frozen": frozen, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    teacher_state = t_state if settings.needs_teacher else None
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, student.cfg.vocab_size, (batch, seq + 1)), jnp.int32)
    data = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.ones((batch, seq), jnp.float32)}
    learning_rate = schedule(1)  # the peak, after the one warm-up step
    exe = step.lower(state, teacher_state, data, learning_rate).compile()
    ma = exe.memory_analysis()
    nbytes = int(
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        + ma.temp_size_in_bytes
        - getattr(ma, "alias_size_in_bytes", 0)
    )
    return exe, (state, teacher_state, data, learning_rate), nbytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs=3, default=None, help="sequence length of stages 1, 2, 3")
    ap.add_argument("--batch", type=int, nargs=3, default=[1, 1, 1])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per stage (after one warm-up)")
    ap.add_argument("--loss-chunk", type=int, default=512, help="token chunk of the KL / CE loops")
    ap.add_argument("--quick", action="store_true", help="smoke settings: 2 layers, vocab 1024, seq 64, 1 step")
    ap.add_argument(
        "--remat",
        choices=["off", "on", "both"],
        default="off",
        help="per-layer rematerialisation (the stage config's remat); both: each stage without and with",
    )
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    cfg = SHAPES["smollm2"]
    seqs, source = (tuple(args.seq), "--seq") if args.seq else recipe_seq_lens()
    if args.quick:
        cfg = cfg.replace(num_layers=2, vocab_size=1024, name="SmolLM2 shapes, 2 layers (quick)")
        seqs, source, args.steps, args.loss_chunk, args.no_record = (64, 64, 64), "--quick", 1, 32, True

    teacher = Transformer(cfg, rngs=nnx.Rngs(0), attention_impl="xla")
    head_map = hydrahead_map(cfg)
    student = build_student(
        teacher, head_map, HybridConfig(attention_implementation="xla", gdn_implementation="xla"), rngs=nnx.Rngs(1)
    )
    rows, tps = [], {}
    remats = {"off": (False,), "on": (True,), "both": (False, True)}[args.remat]
    runs = [
        (label + (" (remat)" if remat else ""), kind, seq, batch, remat)
        for (label, kind, _), seq, batch in zip(STAGES, seqs, args.batch)
        for remat in remats
    ]
    for label, kind, seq, batch, remat in runs:
        t0 = time.perf_counter()
        exe, (state, *inputs), nbytes = stage_step(student, teacher, kind, seq, batch, args.loss_chunk, remat)
        compile_s = time.perf_counter() - t0
        times = []
        for i in range(1 + args.steps):
            t0 = time.perf_counter()
            state, metrics = exe(state, *inputs)
            jax.block_until_ready(metrics["loss"])
            if i:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        key = kind + (":remat" if remat else "")
        tps[key] = batch * seq / med
        rows.append(
            [
                label,
                seq,
                batch,
                C.fmt_s(med),
                f"{tps[key]:,.0f}",
                C.fmt_bytes(nbytes),
                f"{compile_s:.0f} s",
                f"{float(metrics['loss']):.3f}",
            ]
        )
        print(
            f"  {label}: seq {seq} batch {batch}: {C.fmt_s(med)}/step, {tps[key]:,.0f} tokens/s, {C.fmt_bytes(nbytes)}",
            flush=True,
        )
        del state
    table = C.markdown_table(
        ["stage", "seq", "batch", "step time", "tokens/s", "compiled memory", "compile", "loss (random weights)"], rows
    )
    settings = (
        f"{cfg.name}, random weights, HydraHead 7:1 global map ({head_map.num_fa_groups()} FA groups), "
        f"fp32, AdamW, seq lens from {source}, {args.steps} timed steps (median, 1 warm-up), "
        f"loss chunk {args.loss_chunk}, remat {args.remat}, one device"
    )
    C.append_results(
        "Training step throughput per stage (bench_train_step.py)",
        table + "\n",
        settings=settings,
        record=not args.no_record,
    )
    return tps


if __name__ == "__main__":
    main()
