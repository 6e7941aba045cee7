"""Smoke run of the paper recipe before a paid cluster run: ``configs/qwen3_1p7b_hydrahead.py:7to1`` end to end
(stage 0 selection → 1 align → 2 distil → 3 long → ``final/`` export) through ``train.py``, on one machine.

    python scripts/qwen3_smoke.py --workdir /tmp/qwen3_smoke            # writes inputs, runs, checks; exit 0 = pass
    python scripts/qwen3_smoke.py --workdir /tmp/qwen3_smoke --steps 3  # more steps per stage

What it writes under ``--workdir`` before training (nothing is downloaded):

- ``teacher/``: a Hugging Face folder of a random-weight Qwen3 with the real Qwen3-1.7B layer shapes (hidden 2048,
  16 query / 8 KV heads, head_dim 128, intermediate 6144, QK-norm, rope_theta 1e6, tied embeddings, vocab 151,936
  rows) but only 2 layers, in bf16: ``config.json`` (``Qwen3ForCausalLM``), ``model.safetensors`` (about 0.8 GB),
  ``tokenizer.json`` (a byte-level BPE trained on the corpus below, with ``<|endoftext|>``, ``<|im_start|>`` and
  ``<|im_end|>``; its few hundred ids are far below the 151,936 embedding rows, as Qwen3's 151,669 are) and
  ``tokenizer_config.json`` (``<|im_end|>`` as EOS, as Qwen3's chat models).
- ``corpus.jsonl``: seeded English-like prose, the training corpus and the haystack of the selection probes.

So the recipe's real paths run: the HF loader, the tokenizer-against-model checks, the ``paper`` selection preset
(``combined`` method: retrieval + ablation probes; only the probe counts and lengths are cut), the f32-master /
bf16-compute trainer with gradient accumulation and remat, per-stage compiled memory reports and the export. Every
stage runs ``--steps`` steps of 2 rows × 128 tokens (2 micro-batches of one row, as the recipe accumulates), with
``--config.distributed=False --config.mesh.fsdp=1`` on one CPU device. Passing means: every stage finished with
finite losses, each stage printed its compiled step memory per device, and ``final/`` loads with
``hydrahead_jax.load_hydrahead`` with bf16 parameters. The run itself is in ``WORKDIR/run`` (its output in
``WORKDIR/train.log``).

Status and cost (2026-11-30, shared 2-core, 23 GB machine): PASS in 314 s — inputs ~12 s (model.safetensors
824 MB), selection ~80 s, then stage 1 (losses 0.568, 0.555; compiled peak 1.66 GiB per device), stage 2 (0.669,
0.672; 9.19 GiB) and stage 3 (12.50, 12.48; 9.77 GiB), and ``final/`` loads with bf16 parameters. Stages 2-3 train
all 0.41 B parameters (0.31 B of them the 151,936 × 2048 tied embedding) with f32 master weights and AdamW moments;
the whole run peaked at 16.7 GB RSS (GNU time, a rerun with packed-document masking: same stage 1-2 losses, stage 3
12.50, 12.46; 17 min on the then heavily loaded machine): give it ~18 GB free (an earlier attempt was OOM-killed in
stage 3 while other jobs held ~13 GB). A killed or interrupted smoke run resumes: rerun the same command (the inputs are reused and train.py
continues).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "qwen3_1p7b_hydrahead.py:7to1"
STAGE_DIRS = ("stage1_align", "stage2_distil", "stage3_long")

# Qwen3-1.7B's config.json, with 2 of its 28 layers.
QWEN3_1P7B_2_LAYERS = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151_936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=40_960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rope_scaling=None,
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    use_cache=True,
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB = 512

_SUBJECTS = ("The old harbor", "A quiet teacher", "The northern forest", "The city council", "A young painter")
_SUBJECTS += ("The mountain road", "The harbor master", "A travelling merchant", "The small village", "A farmer")
_VERBS = ("watched", "crossed", "described", "remembered", "followed", "visited", "measured", "admired")
_OBJECTS = (
    "the morning fog over the fields",
    "a long line of carts",
    "the stone bridge near the mill",
    "the autumn market in the square",
    "the lights of distant ships",
    "an orchard of apple trees",
    "the bells of the chapel",
    "a map of the valley",
)


def write_corpus(path: Path, *, documents: int = 200, sentences: int = 40, seed: int = 0) -> list[str]:
    """``documents`` seeded prose documents as JSONL ({"text": ...}); returns the texts."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(documents):
        words = [
            f"{_SUBJECTS[rng.integers(len(_SUBJECTS))]} {_VERBS[rng.integers(len(_VERBS))]} "
            f"{_OBJECTS[rng.integers(len(_OBJECTS))]} in {1700 + int(rng.integers(300))}."
            for _ in range(sentences)
        ]
        texts.append(" ".join(words))
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def write_tokenizer(folder: Path, texts: list[str]) -> int:
    """A byte-level BPE (Qwen-style specials, ``<|im_end|>`` as EOS) trained on ``texts``; returns its id count."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "tokenizer_class": "Qwen2Tokenizer",
            }
        )
    )
    return tok.get_vocab_size(with_added_tokens=True)


def write_teacher(folder: Path, texts: list[str], *, seed: int = 0) -> Path:
    """The random 2-layer Qwen3-1.7B-shaped bf16 HF folder described in the module docstring."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    n_ids = write_tokenizer(folder, texts)
    c = QWEN3_1P7B_2_LAYERS
    assert n_ids <= c["vocab_size"]
    hidden, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_dim, kv_dim = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    gen = torch.Generator().manual_seed(seed)

    def linear(out_dim: int, in_dim: int) -> torch.Tensor:  # N(0, 1/fan_in): O(1) activations through the layers
        return (torch.randn(out_dim, in_dim, generator=gen) / math.sqrt(in_dim)).to(torch.bfloat16)

    def norm(dim: int) -> torch.Tensor:  # RMSNorm gains ≈ 1
        return (1.0 + 0.1 * torch.randn(dim, generator=gen)).to(torch.bfloat16)

    # Tied embeddings: the embedding is also the LM head, so its scale sets the logits' (std 0.02 as HF inits).
    tensors = {
        "model.embed_tokens.weight": (0.02 * torch.randn(c["vocab_size"], hidden, generator=gen)).to(torch.bfloat16),
        "model.norm.weight": norm(hidden),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": linear(q_dim, hidden),
            p + "self_attn.k_proj.weight": linear(kv_dim, hidden),
            p + "self_attn.v_proj.weight": linear(kv_dim, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, q_dim),
            p + "self_attn.q_norm.weight": norm(hd),
            p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
        }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {f"{kind}_token_id": tok.token_to_id(t) for kind, t in (("bos", "<|endoftext|>"), ("eos", "<|im_end|>"))}
    (folder / "config.json").write_text(json.dumps(dict(c, **ids), indent=2))
    return folder


def write_inputs(workdir: Path) -> tuple[Path, Path]:
    """(teacher folder, corpus file) under ``workdir``; reused when already there (the teacher takes ~1 min)."""
    workdir.mkdir(parents=True, exist_ok=True)
    corpus, teacher = workdir / "corpus.jsonl", workdir / "teacher"
    texts = write_corpus(corpus)
    if not (teacher / "config.json").is_file():
        write_teacher(teacher, texts)
    return teacher, corpus


def train_overrides(teacher: Path, corpus: Path, *, steps: int = 2) -> list[str]:
    """train.py flags that shrink the recipe to a one-CPU smoke run: budgets, shapes, probe sizes, cluster settings.
    Everything else (losses, lr schedule shape, remat, f32 master weights, selection method and preset) is the
    recipe's."""
    flags = [
        f"--config.teacher.source={teacher}",
        f"--config.data.source={corpus}",
        "--config.distributed=False",
        "--config.mesh.fsdp=1",
        "--config.data.num_threads=1",
        "--config.data.prefetch=2",
        # synchronous saves: an async save first copies the 4.9 GB train state to host memory, which on a CPU
        # backend is a second copy in the same RAM
        "--config.logging.async_save=False",
        # the paper preset's probes, fewer and shorter (the ablation keeps the preset's all-position scope)
        f"--config.selection.haystack={corpus}",
        "--config.selection.niah_prompts=2",
        "--config.selection.niah_lengths=256",
        "--config.selection.niah_depths=0.5",
        "--config.selection.niah_needle_types=number",
        "--config.selection.ablation_prompts=2",
        "--config.selection.ablation_length=256",
        "--config.selection.batch_size=2",
    ]
    for n in (1, 2, 3):
        flags += [
            f"--config.stage{n}.steps={steps}",
            f"--config.stage{n}.seq_len=128",
            f"--config.stage{n}.batch_size=2",
            # Stage 1 accumulates 2 micro-batches as the recipe does; stages 2-3 train all 0.4 B parameters (f32
            # master + AdamW moments: 4.9 GB), where an f32 accumulator would add 1.6 GB on a shared 24 GB machine.
            f"--config.stage{n}.micro_batches={2 if n == 1 else 1}",
            f"--config.stage{n}.loss_chunk=64",
            f"--config.stage{n}.warmup_steps=1",
            f"--config.stage{n}.checkpoint_every={steps}",
        ]
    return flags


def run_train(workdir: Path, flags: list[str], log: Path, *, timeout: float) -> subprocess.CompletedProcess:
    """train.py on the recipe in a subprocess on one CPU device; its output is also written to ``log``."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        str(ROOT / "configs" / RECIPE),
        "--workdir",
        str(workdir),
    ]
    proc = subprocess.run(cmd + flags, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    log.write_text(proc.stdout + proc.stderr)
    return proc


def verify(run_dir: Path, output: str, *, steps: int) -> dict:
    """Checks a finished smoke run; returns {stage dir: {"losses": [...], "memory": line}} or raises AssertionError
    naming what is wrong."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = {}
    for stage in STAGE_DIRS:
        losses = [row["loss"] for row in rows if row["stage"] == stage and "split" not in row]  # training rows
        assert len(losses) == steps, f"{stage}: {len(losses)} steps logged in metrics.jsonl, not {steps}"
        assert all(math.isfinite(x) for x in losses), f"{stage}: non-finite losses {losses}"
        memory = [line for line in output.splitlines() if f"[{stage}] compiled step memory per device" in line]
        assert memory, f"{stage}: the trainer printed no compiled step memory"
        summary[stage] = {"losses": losses, "memory": memory[-1]}
    assert (run_dir / "final").is_dir(), "the run did not reach final/"
    return summary


def export_param_dtypes(final: Path) -> set[str]:
    """The dtypes of the parameters of the export at ``final``, loaded as a user loads it."""
    import jax
    from flax import nnx

    import hydrahead_jax

    model, _ = hydrahead_jax.load_hydrahead(final)
    return {str(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, type=Path, help="inputs, the run and its log go here")
    parser.add_argument("--steps", type=int, default=2, help="training steps per stage")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the run is stopped")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    teacher, corpus = write_inputs(args.workdir)
    print(f"inputs ready in {time.perf_counter() - start:.0f} s: {teacher}, {corpus}", flush=True)
    run_dir, log = args.workdir / "run", args.workdir / "train.log"
    proc = run_train(run_dir, train_overrides(teacher, corpus, steps=args.steps), log, timeout=args.timeout)
    if proc.returncode != 0:
        print(f"FAIL: train.py exited with {proc.returncode}; its output is in {log}:", file=sys.stderr)
        print((proc.stdout + proc.stderr)[-4000:], file=sys.stderr)
        return 1
    try:
        summary = verify(run_dir, proc.stdout + proc.stderr, steps=args.steps)
        dtypes = export_param_dtypes(run_dir / "final")
        assert dtypes == {"bfloat16"}, f"exported parameters are {dtypes}, not bfloat16"
    except AssertionError as error:
        print(f"FAIL: {error} (output in {log})", file=sys.stderr)
        return 1
    for stage, s in summary.items():
        print(f"{stage}: losses {[round(x, 4) for x in s['losses']]}; {s['memory'].split('] ', 1)[1]}")
    print(f"PASS in {time.perf_counter() - start:.0f} s: {run_dir / 'final'} loads, parameters bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
