"""Evidence that selection finds retrieval-critical groups: ablate the chosen FA groups together, and as many
random groups (several seeded draws), and compare the teacher's retrieval accuracy and answer log-probability.

Accuracy is exact-match under teacher forcing: a prompt counts as correct when every answer token is the argmax
given the prompt and the preceding answer tokens, which is exactly when greedy decoding emits the answer first.
The evaluation prompts use other seeds than the selection probes.

    python -m hydrahead_jax.selection.evidence --source smollm2-135m --head_map DIR/head_map.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hydrahead_jax.selection import probes
from hydrahead_jax.selection.select import fa_groups_as_pairs, make_haystack

EVAL_SEED_OFFSET = 7_777_777  # keeps evaluation prompts disjoint from the selection probes' seeds


def random_group_sets(
    num_layers: int, num_groups: int, count: int, draws: int, seed: int, exclude: Sequence[tuple[int, int]] = ()
) -> list[list[list[int]]]:
    """``draws`` seeded uniform draws of ``count`` (layer, group) pairs (avoiding ``exclude``), as per-layer lists."""
    pool = [(l, g) for l in range(num_layers) for g in range(num_groups) if (l, g) not in set(exclude)]
    if count > len(pool):
        raise ValueError(f"cannot draw {count} random groups from the {len(pool)} not selected.")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        sets = [[] for _ in range(num_layers)]
        for i in rng.choice(len(pool), size=count, replace=False):
            sets[pool[i][0]].append(pool[i][1])
        out.append([sorted(s) for s in sets])
    return out


def ablation_evidence(
    model,
    tokenizer,
    fa_groups: Sequence[Sequence[int]],
    *,
    tasks: Sequence[str] = ("passkey", "niah_single"),
    num_prompts: int = 8,
    length: int = 512,
    random_draws: int = 5,
    mode: str = "mean",
    seed: int = 0,
    exclude_selected: bool = True,
    haystack=None,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Accuracy and mean answer log-prob of the teacher: clean, with the selected groups ablated, and with as many
    random groups ablated (``random_draws`` draws; with ``exclude_selected`` the random sets avoid the selected)."""
    if mode not in ("mean", "zero"):
        raise ValueError(f"ablation mode {mode!r} is unknown; use 'mean' or 'zero'.")
    cfg = model.cfg
    if length + 64 > cfg.max_position_embeddings:
        raise ValueError(f"length={length} exceeds the model's context ({cfg.max_position_embeddings}).")
    from hydrahead_jax.data.synthetic import generate

    haystack = make_haystack(tokenizer) if haystack is None else haystack
    examples = [
        generate(
            tasks[i % len(tasks)],
            tokenizer,
            haystack,
            length=length,
            seed=seed + EVAL_SEED_OFFSET + i,
            depth=(i // len(tasks) + 0.5) / max(1, -(-num_prompts // len(tasks))),
        )
        for i in range(num_prompts)
    ]
    teacher = probes.functional_teacher(model)
    selected = fa_groups_as_pairs(fa_groups)
    randoms = random_group_sets(
        cfg.num_layers,
        cfg.num_kv_heads,
        len(selected),
        random_draws,
        seed + 1,
        exclude=selected if exclude_selected else (),
    )
    variants = {"clean": None, "selected": [list(g) for g in fa_groups]}
    variants.update({f"random_{i}": r for i, r in enumerate(randoms)})
    correct = {name: [] for name in variants}
    logp = {name: [] for name in variants}
    for start in range(0, num_prompts, batch_size):
        chunk = examples[start : start + batch_size]
        batch = probes.make_batch([e.prompt_ids for e in chunk], [e.answer_ids for e in chunk])
        clean = probes.run_forward(teacher, batch, collect=(mode == "mean"))
        fill = probes.head_means(clean["heads"], batch.lengths) if mode == "mean" else None
        for name, groups in variants.items():
            if groups is None:
                out = clean
            else:
                keep = probes.group_ablation_masks(groups, cfg.num_heads, cfg.num_kv_heads)
                out = probes.run_forward(teacher, batch, head_keep=keep, head_fill=fill)
            ok = np.all((out["pred"] == batch.targets) | ~batch.row_mask, axis=-1)
            correct[name].extend(ok.tolist())
            logp[name].extend(((out["logp"] * batch.row_mask).sum(-1)).tolist())
    summary = {
        name: {"accuracy": float(np.mean(correct[name])), "mean_logp": float(np.mean(logp[name]))} for name in variants
    }
    rand_acc = [summary[n]["accuracy"] for n in variants if n.startswith("random_")]
    rand_logp = [summary[n]["mean_logp"] for n in variants if n.startswith("random_")]
    return {
        "settings": {
            "tasks": list(tasks),
            "num_prompts": num_prompts,
            "length": length,
            "mode": mode,
            "random_draws": random_draws,
            "num_groups_ablated": len(selected),
            "seed": seed,
            "exclude_selected": exclude_selected,
        },
        "clean": summary["clean"],
        "selected": summary["selected"],
        "random": {
            "accuracy_mean": float(np.mean(rand_acc)),
            "accuracy_each": rand_acc,
            "mean_logp_mean": float(np.mean(rand_logp)),
            "mean_logp_each": rand_logp,
        },
        "per_prompt_tasks": [e.task for e in examples],
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="smollm2-135m", help="teacher: smollm2-135m, a .gguf or an HF folder")
    parser.add_argument("--head_map", required=True, help="head_map.json written by head selection")
    parser.add_argument("--tasks", default="passkey,niah_single")
    parser.add_argument("--num_prompts", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--random_draws", type=int, default=5)
    parser.add_argument("--mode", default="mean", choices=("mean", "zero"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    from hydrahead_jax.hybrid.head_map import HeadMap
    from hydrahead_jax.models import load_pretrained

    model, tokenizer = load_pretrained(args.source)
    head_map = HeadMap.load(args.head_map, model.cfg)
    started = time.time()
    result = ablation_evidence(
        model,
        tokenizer,
        head_map.fa_groups,
        tasks=args.tasks.split(","),
        num_prompts=args.num_prompts,
        length=args.length,
        random_draws=args.random_draws,
        mode=args.mode,
        seed=args.seed,
    )
    result["head_map"] = {
        "path": args.head_map,
        "method": head_map.method,
        "ratio": head_map.target_ratio,
        "allocation": head_map.allocation,
    }
    result["seconds"] = round(time.time() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
