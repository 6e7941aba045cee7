"""Stage 0: probe the teacher, choose the FA KV groups at a target ratio, write the head map and its heatmap.

Methods (scores are [layers × KV groups], higher = keep as full attention):
  retrieval   the retrieval score (probes.retrieval_scores), aggregated per KV group
  ablation    the drop in the answer log-probability when the group is ablated (probes.ablation_scores)
  combined    the mean of the two scores' normalised ranks: r(s)_i = rank_i / (n − 1) ∈ [0, 1] over all L·G
              groups (ties share their mean rank), combined = (r(retrieval) + r(ablation)) / 2. Ranks, because
              the two scores live on unrelated scales (a fraction of needle tokens vs nats)
  random      a seeded uniform draw (the baseline)
  layerwise   whole layers FA, the layer-wise hybrid baseline (HeadMap.layerwise; allocation is ignored)
Allocation: ``per_layer`` keeps the same number of FA groups k = f·G in every layer (f·G must be a whole number);
``global`` keeps the top round(f·L·G) groups of the whole model (``head_map.fa_group_count``, the one rule);
``whole_layers`` keeps whole layers, as many as the layer-wise baseline, but the ones whose groups score highest
on average (a layer-wise hybrid placed by the probe instead of by a fixed period: it separates where FA is kept
from the granularity it is kept at). Every head map records the FA-group budget it was sized to
(``HeadMap.budget``); the random baseline meets HydraHead's budget exactly, the layer-wise ones to the nearest
whole layer (``HeadMap.layerwise``, ``head_map.whole_layer_count``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hydrahead_jax.hybrid.head_map import ALLOCATIONS, HeadMap, HeadMapError, fa_group_count, parse_ratio
from hydrahead_jax.storage import run_path

METHODS = ("retrieval", "ablation", "combined", "random", "layerwise")


class SelectionError(ValueError):
    """Settings that head selection cannot honour; the message names the setting and the fix."""


# ------------------------------------------------------------------------------------------------------------
# Settings.


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
    """Head-selection settings. Defaults fit the CPU demo (≈ 2–4 min on SmolLM2-135M); ``paper()`` probes more."""

    method: str = "combined"
    ratio: str = "7:1"
    allocation: str = "global"
    seed: int = 0
    group_aggregate: str = "mean"  # retrieval score of a KV group: mean | max over its query heads
    # Retrieval probe: needle-in-a-haystack prompts, one per (length, depth, needle type) up to niah_prompts.
    niah_prompts: int = 6
    niah_lengths: tuple[int, ...] = (256, 512)
    niah_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    niah_needle_types: tuple[str, ...] = ("number", "word")
    decode: str = "greedy"  # greedy | teacher_forced
    max_extra_tokens: int = 4
    # Ablation probe: passkey and key-value retrieval prompts.
    ablation_tasks: tuple[str, ...] = ("passkey", "kv_retrieval")
    ablation_prompts: int = 8  # in all, split evenly over ablation_tasks
    ablation_length: int = 160
    ablation_mode: str = "mean"  # mean | zero
    ablation_scope: str = "answer"  # answer | all (see probes.ablation_scores)
    batch_size: int = 8
    haystack: str = "enwiki"  # corpus source for haystacks (hydrahead_jax.data.corpus.resolve_source)

    @classmethod
    def paper(cls, **overrides) -> SelectionConfig:
        """More, longer probes and the faithful all-position ablation (hours on a CPU; minutes on an accelerator)."""
        base = dict(
            niah_prompts=40,
            niah_lengths=(1024, 2048, 4096),
            niah_depths=(0.0, 0.25, 0.5, 0.75, 1.0),
            niah_needle_types=("number", "word", "uuid"),
            ablation_prompts=32,
            ablation_length=512,
            ablation_scope="all",
        )
        return cls(**{**base, **overrides})

    @classmethod
    def from_any(cls, cfg: Any) -> SelectionConfig:
        """From a SelectionConfig, a dict or an ml_collections ConfigDict of its fields.

        ``preset`` ("demo" or "paper") supplies every field the mapping leaves out or sets to None, so a field
        is taken from the preset unless it is set explicitly. List-valued fields accept a list/tuple, one value,
        or a comma-separated string ("256,512": how they come from ``--config.selection.niah_lengths=256,512``).
        """
        if isinstance(cfg, cls):
            return cfg
        if cfg is None:
            return cls()
        data = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        preset = data.pop("preset", None) or "demo"
        if preset not in PRESETS:
            raise SelectionError(f"selection preset {preset!r} is unknown; use one of {PRESETS}.")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise SelectionError(f"unknown selection settings {unknown}; valid ones are {sorted(known)}.")
        explicit = {k: _coerce_setting(k, v, known[k].default) for k, v in data.items() if v is not None}
        return cls.paper(**explicit) if preset == "paper" else cls(**explicit)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


PRESETS = ("demo", "paper")


def _coerce_setting(name: str, value: Any, default: Any) -> Any:
    """``value`` in the type of the field's default; tuples from lists, single values or "a,b,c" strings."""
    if isinstance(default, tuple):
        kind = type(default[0]) if default else str
        items = value if isinstance(value, (list, tuple)) else (value,)
        flat = []
        for item in items:
            if isinstance(item, str):
                flat.extend(part.strip() for part in item.split(",") if part.strip())
            else:
                flat.append(item)
        try:
            return tuple(kind(x) for x in flat)
        except (TypeError, ValueError):
            raise SelectionError(
                f"selection.{name}={value!r}: expected a comma-separated list of {kind.__name__} values, e.g. "
                f"--config.selection.{name}={','.join(str(x) for x in default)}."
            ) from None
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise SelectionError(f"selection.{name}={value!r}: expected True or False.")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SelectionError(f"selection.{name}={value!r}: expected an integer.")
        return value
    if isinstance(default, str) and not isinstance(value, str):
        raise SelectionError(f"selection.{name}={value!r}: expected a string.")
    return value


def validate_config(sel: SelectionConfig, model_cfg=None, tokenizer=None) -> None:
    """Every check that can fail before a probe runs: method, choices, lengths; with ``model_cfg`` the ratio
    and the lengths against the model; with ``tokenizer`` that every probe prompt fits its length."""
    if sel.method not in METHODS:
        raise SelectionError(f"selection method {sel.method!r} is unknown; choose one of {METHODS}.")
    if sel.allocation not in ALLOCATIONS:
        raise SelectionError(f"allocation {sel.allocation!r} is unknown; choose one of {ALLOCATIONS}.")
    try:
        parse_ratio(sel.ratio)
    except HeadMapError as e:
        raise SelectionError(str(e)) from None
    choices = {
        "group_aggregate": ("mean", "max"),
        "decode": ("greedy", "teacher_forced"),
        "ablation_mode": ("mean", "zero"),
        "ablation_scope": ("answer", "all"),
    }
    for name, allowed in choices.items():
        if getattr(sel, name) not in allowed:
            raise SelectionError(f"{name}={getattr(sel, name)!r}; choose one of {allowed}.")
    if model_cfg is not None:
        fa_count(sel.ratio, sel.allocation, model_cfg.num_layers, model_cfg.num_kv_heads)
    if sel.method in ("random", "layerwise"):
        return
    from hydrahead_jax.data.synthetic import NEEDLE_TYPES, TASKS

    if not sel.niah_lengths or not sel.niah_depths or not sel.niah_needle_types:
        raise SelectionError("niah_lengths, niah_depths and niah_needle_types need at least one value each.")
    unknown = [t for t in sel.niah_needle_types if t not in NEEDLE_TYPES]
    if unknown:
        raise SelectionError(f"niah_needle_types {unknown} are unknown; choose from {NEEDLE_TYPES}.")
    unknown = [t for t in sel.ablation_tasks if t not in TASKS]
    if unknown:
        raise SelectionError(f"ablation_tasks {unknown} are unknown; choose from {sorted(TASKS)}.")
    if any(not 0.0 <= d <= 1.0 for d in sel.niah_depths):
        raise SelectionError(f"niah_depths {list(sel.niah_depths)} must lie in [0, 1].")
    if min(sel.niah_lengths + (sel.ablation_length,)) < 64:
        raise SelectionError("probe lengths must be at least 64 tokens (room for the instructions and a needle).")
    if sel.method in ("retrieval", "combined") and sel.niah_prompts < 1:
        raise SelectionError("niah_prompts must be >= 1 for the retrieval score.")
    if sel.method in ("ablation", "combined") and (
        sel.ablation_prompts < len(sel.ablation_tasks) or not sel.ablation_tasks
    ):
        raise SelectionError("ablation_prompts must be >= the number of ablation_tasks (one prompt per task).")
    if sel.batch_size < 1:
        raise SelectionError(f"batch_size={sel.batch_size} must be >= 1.")
    if model_cfg is not None:
        limit = model_cfg.max_position_embeddings
        longest = max(sel.niah_lengths + (sel.ablation_length,)) + sel.max_extra_tokens + 64
        if longest > limit:
            raise SelectionError(
                f"probe prompts of up to {longest} tokens (longest probe length plus the answer) "
                f"exceed the model's context of {limit} tokens (max_position_embeddings); "
                "shorten niah_lengths / ablation_length."
            )
    if tokenizer is not None:
        _check_probe_prompts_fit(sel, tokenizer)


# Stand-in filler for the fit check: whether a length is too short depends only on the fixed parts of a prompt
# (instructions, needles, question), never on the haystack text.
_FILLER = "The committee met on a Tuesday and talked about the weather for most of the afternoon."


def _check_probe_prompts_fit(sel: SelectionConfig, tokenizer) -> None:
    """Build every probe prompt the selection will use (same seeds, a stand-in haystack) and refuse a length
    that cannot hold one, naming the setting: the probes themselves would fail only after loading the corpus."""
    from hydrahead_jax.data.synthetic import Haystack

    haystack = Haystack(_FILLER, tokenizer)
    probes = []
    if sel.method in ("retrieval", "combined"):
        probes.append(("niah_lengths", lambda: niah_examples(tokenizer, haystack, sel)))
    if sel.method in ("ablation", "combined"):
        probes.append(("ablation_length", lambda: ablation_examples(tokenizer, haystack, sel)))
    for setting, build in probes:
        try:
            build()
        except ValueError as err:
            value = ",".join(map(str, sel.niah_lengths)) if setting == "niah_lengths" else sel.ablation_length
            raise SelectionError(
                f"selection.{setting}={value}: {err} Fix: raise it, e.g. --config.selection.{setting}=..."
            ) from None


def check_probe_scores(name: str, scores: np.ndarray) -> np.ndarray:
    """``scores`` as float64 when every entry is finite; otherwise a SelectionError naming the probe.

    Call it on each probe's [layers, KV groups] matrix before scores are combined or ranked: rank normalisation
    turns NaN into ordinary ranks, so a failed probe would otherwise come out as a plausible-looking selection.
    """
    scores = np.asarray(scores, np.float64)
    bad = ~np.isfinite(scores)
    if bad.any():
        where = [tuple(int(i) for i in idx) for idx in np.argwhere(bad)[:4]]
        raise SelectionError(
            f"the {name} probe produced {int(bad.sum())} non-finite score(s) of {scores.size} (first at "
            f"[layer, group] {where}); no head map was written. Usual causes: a tokenizer whose ids exceed the "
            "model's vocabulary, or activations that overflow in the teacher's dtype (try teacher.dtype='float32')."
        )
    return scores


# ------------------------------------------------------------------------------------------------------------
# Selection.


def fa_count(ratio: str | float, allocation: str, num_layers: int, num_groups: int) -> int:
    """FA groups per layer (per_layer) or in the model (global) for a ratio, by ``head_map.fa_group_count``'s
    rule; head selection also needs at least one FA group. Errors are SelectionErrors."""
    try:
        f = parse_ratio(ratio)
        if f <= 0:
            raise SelectionError(
                f"ratio {ratio!r} keeps no FA group; head selection needs at least one "
                "(an all-linear model is HeadMap.all_la)."
            )
        return fa_group_count(ratio, allocation, num_layers, num_groups)
    except HeadMapError as e:
        raise SelectionError(str(e)) from None


def selection_budget(ratio: str | float, allocation: str, num_layers: int, num_groups: int) -> dict[str, Any]:
    """The FA-group budget of a score-based or random selection (``HeadMap.budget``): exact for per-layer and
    global allocation, the nearest whole layers for whole_layers."""
    k = fa_count(ratio, allocation, num_layers, num_groups)
    total = k * num_layers if allocation == "per_layer" else k
    target = total
    if allocation == "per_layer":
        rule = f"{k} per layer x {num_layers} layers"
    elif allocation == "global":
        rule = f"top {k} of the whole model"
    else:
        target = fa_count(ratio, "global", num_layers, num_groups)
        rule = (
            f"{k // num_groups} whole layer(s) of {num_groups} KV groups with the highest mean score "
            f"({target} / {num_groups} = {target / num_groups:.4g} layers, nearest; a tie takes the fewer)"
        )
    return {
        "matches": "hydrahead_fa_kv_groups",
        "ratio": str(ratio),
        "target_fa_groups": target,
        "fa_groups": total,
        "exact": total == target,
        "rule": f"{rule} ({allocation} allocation)",
    }


def rank_normalise(scores: np.ndarray) -> np.ndarray:
    """Ranks of all entries scaled to [0, 1] (lowest 0, highest 1); tied entries share their mean rank."""
    flat = np.asarray(scores, np.float64).ravel()
    order = np.argsort(flat, kind="stable")
    ranks = np.empty(flat.size)
    ranks[order] = np.arange(flat.size, dtype=np.float64)
    for value in np.unique(flat):  # average the ranks of ties so equal scores stay equal
        tie = flat == value
        ranks[tie] = ranks[tie].mean()
    return (ranks / max(flat.size - 1, 1)).reshape(np.shape(scores))


def _top(scores: np.ndarray, k: int) -> list[tuple[int, int]]:
    """Indices of the k largest entries; ties go to the lower (layer, group), so the result is deterministic."""
    flat = np.asarray(scores, np.float64).ravel()
    order = np.lexsort((np.arange(flat.size), -flat))[:k]
    cols = scores.shape[1]
    return [(int(i) // cols, int(i) % cols) for i in order]


def select_fa_groups(
    scores: np.ndarray | None,
    *,
    ratio: str | float,
    allocation: str = "global",
    method: str = "retrieval",
    seed: int = 0,
    num_layers: int | None = None,
    num_groups: int | None = None,
    layerwise_cfg=None,
) -> list[list[int]]:
    """FA KV groups per layer from a [L, G] score matrix (higher = keep FA).

    For method "random" the scores may be None (give num_layers and num_groups); "layerwise" needs the model
    config (``layerwise_cfg``) and returns HeadMap.layerwise's whole-layer choice. Score-based methods take the
    matrix as given (for "combined" pass the combined matrix, see ``combine_scores``).
    """
    if method not in METHODS:
        raise SelectionError(f"selection method {method!r} is unknown; choose one of {METHODS}.")
    if method == "layerwise":
        if layerwise_cfg is None:
            raise SelectionError("method 'layerwise' needs the model config (layerwise_cfg=model.cfg).")
        return HeadMap.layerwise(layerwise_cfg, ratio=ratio).fa_groups
    if scores is not None:
        scores = np.asarray(scores, np.float64)
        if scores.ndim != 2:
            raise SelectionError(f"scores must be a [layers, kv_groups] matrix, got shape {scores.shape}.")
        num_layers, num_groups = scores.shape
        if not np.all(np.isfinite(scores)):
            raise SelectionError("scores contain NaN or inf; the probe failed.")
    elif method != "random" or num_layers is None or num_groups is None:
        raise SelectionError(f"method {method!r} needs a score matrix (random needs num_layers and num_groups).")
    k = fa_count(ratio, allocation, num_layers, num_groups)
    if method == "random":
        scores = np.random.default_rng(seed).random((num_layers, num_groups))
    chosen: list[list[int]] = [[] for _ in range(num_layers)]
    if allocation == "per_layer":
        for layer in range(num_layers):
            chosen[layer] = sorted(g for _, g in _top(scores[layer : layer + 1], k))
    elif allocation == "whole_layers":
        for layer, _ in _top(scores.mean(axis=1, keepdims=True), k // num_groups):
            chosen[layer] = list(range(num_groups))
    else:
        for layer, g in _top(scores, k):
            chosen[layer].append(g)
        chosen = [sorted(c) for c in chosen]
    return chosen


def combine_scores(retrieval: np.ndarray, ablation: np.ndarray) -> np.ndarray:
    """(rank_normalise(retrieval) + rank_normalise(ablation)) / 2."""
    return (rank_normalise(retrieval) + rank_normalise(ablation)) / 2.0


# ------------------------------------------------------------------------------------------------------------
# Probe prompts.


def make_haystack(tokenizer, source: str = "enwiki"):
    """A Haystack of real text: the default Wikipedia corpus, or any source hydrahead_jax.data accepts."""
    from hydrahead_jax.data.corpus import load_enwiki_documents, resolve_source
    from hydrahead_jax.data.synthetic import Haystack

    docs = load_enwiki_documents() if source == "enwiki" else resolve_source(source).read_documents()
    return Haystack(docs, tokenizer)


def niah_examples(tokenizer, haystack, sel: SelectionConfig) -> list:
    """sel.niah_prompts NIAH prompts cycling over lengths, depths and needle types, seeded from sel.seed."""
    from hydrahead_jax.data.synthetic import niah

    # Cycle each setting independently, so a handful of prompts already mixes lengths, depths and needle types.
    picks = [
        (
            sel.niah_lengths[i % len(sel.niah_lengths)],
            sel.niah_depths[i % len(sel.niah_depths)],
            sel.niah_needle_types[i % len(sel.niah_needle_types)],
        )
        for i in range(sel.niah_prompts)
    ]
    return [
        niah(tokenizer, haystack, length=n, depth=d, needle_type=t, seed=sel.seed * 100_003 + i)
        for i, (n, d, t) in enumerate(picks)
    ]


def ablation_examples(
    tokenizer, haystack, sel: SelectionConfig, *, count: int | None = None, seed_offset: int = 0
) -> list:
    """Passkey / key-value prompts (evenly split over sel.ablation_tasks) at sel.ablation_length."""
    from hydrahead_jax.data.synthetic import generate

    count = sel.ablation_prompts if count is None else count
    tasks = sel.ablation_tasks
    return [
        generate(
            tasks[i % len(tasks)],
            tokenizer,
            haystack,
            length=sel.ablation_length,
            seed=sel.seed * 100_003 + 50_000 + seed_offset + i,
            depth=(i // len(tasks) + 0.5) / max(1, -(-count // len(tasks))),
        )
        for i in range(count)
    ]


# ------------------------------------------------------------------------------------------------------------
# The stage.


def run_selection(
    model, tokenizer, cfg: Any = None, out_dir: str | os.PathLike | None = None, *, haystack=None, log=print
) -> HeadMap:
    """Probe ``model``, choose FA groups, write ``out_dir/head_map.json`` and ``out_dir/head_scores.png``.

    cfg: SelectionConfig, a dict or an ml_collections ConfigDict of its fields. Deterministic for a seed (the
    prompts and the random baseline derive from ``seed``). Returns the HeadMap.
    """
    from hydrahead_jax.selection import probes

    sel = SelectionConfig.from_any(cfg)
    model_cfg = model.cfg
    validate_config(sel, model_cfg)
    started = time.time()
    scores: dict[str, np.ndarray] = {}
    head_scores: dict[str, np.ndarray] = {}
    probe_info: dict[str, Any] = {"settings": sel.to_dict()}
    needs_retrieval = sel.method in ("retrieval", "combined")
    needs_ablation = sel.method in ("ablation", "combined")
    if needs_retrieval or needs_ablation:
        haystack = make_haystack(tokenizer, sel.haystack) if haystack is None else haystack
        teacher = probes.functional_teacher(model)
    if needs_retrieval:
        examples = niah_examples(tokenizer, haystack, sel)
        r = probes.retrieval_scores(
            model,
            tokenizer,
            examples,
            decode=sel.decode,
            max_extra_tokens=sel.max_extra_tokens,
            batch_size=sel.batch_size,
            group_aggregate=sel.group_aggregate,
            teacher=teacher,
        )
        scores["retrieval"], head_scores["retrieval"] = r["group_scores"], r["head_scores"]
        probe_info["retrieval"] = {
            "num_prompts": r["num_prompts"],
            "num_correct": r["num_correct"],
            "prompts": r["prompts"],
        }
        log(
            f"[select] retrieval probe: {r['num_correct']}/{r['num_prompts']} NIAH prompts answered correctly "
            f"({time.time() - started:.0f}s)"
        )
        if r["num_correct"] == 0:
            log(
                "[select] WARNING: the teacher answered no NIAH prompt, so every retrieval score is 0; "
                "use shorter niah_lengths or the ablation method."
            )
    if needs_ablation:
        examples = ablation_examples(tokenizer, haystack, sel)
        drops, correct = [], []
        for start in range(0, len(examples), sel.batch_size):
            chunk = examples[start : start + sel.batch_size]
            batch = probes.make_batch([e.prompt_ids for e in chunk], [e.answer_ids for e in chunk])
            a = probes.ablation_scores(teacher, batch, mode=sel.ablation_mode, scope=sel.ablation_scope)
            drops.append(a["drop"])
            correct.extend(a["clean_correct"].tolist())
        drop = np.concatenate(drops, axis=-1)  # [L, G, prompts]
        scores["ablation"] = drop.mean(-1)
        probe_info["ablation"] = {
            "num_prompts": len(examples),
            "clean_correct": int(sum(correct)),
            "tasks": [e.task for e in examples],
        }
        log(
            f"[select] ablation probe on {len(examples)} prompts (teacher exact on {sum(correct)}) "
            f"({time.time() - started:.0f}s)"
        )
    scores = {name: check_probe_scores(name, s) for name, s in scores.items()}
    if sel.method == "combined":
        scores["combined"] = combine_scores(scores["retrieval"], scores["ablation"])
    fa_groups = select_fa_groups(
        scores.get(sel.method),
        ratio=sel.ratio,
        allocation=sel.allocation,
        method=sel.method,
        seed=sel.seed,
        num_layers=model_cfg.num_layers,
        num_groups=model_cfg.num_kv_heads,
        layerwise_cfg=model_cfg,
    )
    probe_info["seconds"] = round(time.time() - started, 1)
    if "retrieval" in head_scores:
        probe_info["retrieval_head_scores"] = np.round(head_scores["retrieval"], 6).tolist()
    allocation = sel.allocation if sel.method != "layerwise" else "global"
    if sel.method == "layerwise":
        budget = HeadMap.layerwise(model_cfg, ratio=sel.ratio).budget
    else:
        budget = selection_budget(sel.ratio, sel.allocation, model_cfg.num_layers, model_cfg.num_kv_heads)
    head_map = HeadMap.from_fa_groups(
        model_cfg,
        fa_groups,
        method=sel.method,
        target_ratio=sel.ratio,
        allocation=allocation,
        probe=probe_info,
        scores={k: np.round(v, 6).tolist() for k, v in scores.items()},
        budget=budget,
    )
    if out_dir is not None:
        out_dir = run_path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        head_map.save(out_dir / "head_map.json")
        if scores:
            from hydrahead_jax.selection.plot import plot_scores

            plot_scores(
                scores,
                fa_groups,
                out_dir / "head_scores.png",
                head_scores=head_scores.get("retrieval"),
                title=f"{model_cfg.name}: {sel.method}, {sel.ratio} {allocation}",
            )
        exact = "" if budget["exact"] else f" (HydraHead's budget is {budget['target_fa_groups']}: {budget['rule']})"
        log(
            f"[select] {head_map.num_fa_groups()} FA groups of {model_cfg.num_layers * model_cfg.num_kv_heads}"
            f"{exact}; wrote {out_dir / 'head_map.json'}"
        )
    return head_map


def fa_groups_as_pairs(fa_groups: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """[[groups of layer 0], ...] → [(layer, group), ...]."""
    return [(layer, g) for layer, groups in enumerate(fa_groups) for g in groups]
