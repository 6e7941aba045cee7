"""Equal-budget comparison of conversion variants: train each, evaluate each the same way, report side by side.

    python -m hydrahead_jax.experiments.compare --config configs/compare_smollm2.py --workdir runs/compare
    python -m hydrahead_jax.experiments.compare --config configs/compare_tiny.py --workdir runs/cmp \\
        --config.budget_scale=0.5

The comparison recipe (an ml_collections ConfigDict, ``--config.a.b=value`` overrides) holds

* ``base``: a normal run recipe (``configs/common.base()``); every variant starts from it,
* ``variants``: a list of ``{"name", "overrides": {"dotted.key": value}, "group" (optional)}``; a variant is the
  base recipe with its overrides set, so it trains on the same data order, seed and token budget as every other
  (overrides of the data, the teacher, the seed or a stage's budget are refused). Variants sharing a ``group``
  (e.g. random selection with three seeds) are reported as mean ± spread,
* ``eval``: the evaluation settings, the same for every model (``eval_settings``),
* ``budget_scale``: multiplies every stage's step count (rounded, at least 1) of the base and so of every variant,
* ``keep_checkpoints`` (default False): keep a finished variant's stage checkpoints. By default they are deleted
  once the variant's eval.json is written (``prune_checkpoints``: SmolLM2's three stages hold about 7 GB per
  variant, the exported model 0.5 GB), keeping the exported model, metrics and each stage's heldout.json.

Every variant is converted with ``RunConfig.from_recipe`` before any training, so a bad variant (an unknown key, a
bad value, a duplicate name) is refused at once with its name. Stage 0 probes the teacher once: the probe-selected
variants (retrieval / ablation / combined scores) all get head maps derived from the one probe's saved scores
(``workdir/probe``) and train on them as ``selection.method='given'``.

Layout of the workdir::

    probe/                  the one teacher probe (head_map.json with the retrieval, ablation and combined scores)
    head_maps/<name>.json   head maps derived from the probe's scores
    teacher/eval.json       the teacher's evaluation (run once, shared)
    variants/<name>/        a normal run workdir (run_pipeline: checkpoints, metrics.jsonl, final/; the stage
                            checkpoints are deleted once the variant is finished unless keep_checkpoints), plus
        timings.json        wall seconds per stage (summed over reruns; StageTimings)
        stage_running.json  the stage running now and its start (what a killed run's time is recovered from)
        eval_init.json      the student at initialisation (before stage 1), evaluated
        eval.json           the trained student, evaluated; its config_hash marks the variant finished
    results.json, report.md, pareto.png, loss_curves.png

Rerunning continues where a killed comparison stopped: a variant whose eval.json matches its config hash is
skipped, an unfinished one resumes inside ``run_pipeline`` (finished stages are skipped, a stage resumes from its
last checkpoint), and a killed final evaluation replays the prompts and windows its journal holds
(``<variant>/eval_progress/``, the teacher's in ``teacher/``) and runs the rest.

Evaluation of every model (``evaluate``): (1) the fixed held-out rows of the training data (``eval.data_rows`` ×
``eval.data_seq_len`` tokens: the corpus validation split, or unseen copy rows): KL(teacher ‖ model) and top-1
agreement per position and the model's perplexity, by ``evaluation.tasks.text_window``; this needs no tokenizer,
so it runs for every teacher; (2) where the teacher has a tokenizer, the evaluation suite (``eval.suite``: NIAH,
passkey, perplexity and agreement on the held-out text sources wiki-val and news); (3) KV-cache bytes per token
from the model's decode cache (``evaluation.tasks.cache_sizes``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydrahead_jax.config import ConfigError
from hydrahead_jax.experiments.report import ANSWER_NLL, WINDOWS
from hydrahead_jax.run_config import PROBE_METHODS, SELECT, STAGES, RunConfig

STAGE_ORDER = (SELECT,) + tuple(s.name for s in STAGES)
PROBE_SCORES = ("retrieval", "ablation", "combined")  # the score matrices one combined probe saves
# Overrides a variant may not make: they would change the data, its order, the teacher or the token budget.
FIXED_KEYS = ("seed", "teacher.", "data.", "mesh.", "distributed")
FIXED_STAGE_FIELDS = ("steps", "tokens", "batch_size", "seq_len", "synthetic_rate")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# ------------------------------------------------------------------------------------------------ the recipe


@dataclasses.dataclass(frozen=True)
class Variant:
    """One arm of the comparison: ``run`` is the base recipe with ``overrides`` set, validated."""

    name: str
    overrides: dict[str, Any]
    group: str
    run: RunConfig

    @property
    def probe_method(self) -> str | None:
        """The probe score this variant selects heads by, or None when it needs no probe."""
        return self.run.selection.method if self.run.selection.method in PROBE_METHODS else None


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """The evaluation every model gets. ``suite``: eval-suite names (evaluation.suite.SUITES) run where the
    teacher has a tokenizer; ``lengths``: their retrieval lengths; ``ppl_length``: the held-out text window."""

    suite: tuple[str, ...] = ("niah", "passkey", "ppl", "agreement")
    lengths: tuple[int, ...] = (512, 1024)
    ppl_length: int = 512
    ppl_windows: int = 1
    samples: int = 1
    depths: tuple[float, ...] = (0.1, 0.9)
    data_rows: int = 4
    data_seq_len: int = 256

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def _as_dict(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _as_dict(v) for k, v in value.items()}
    return value


def eval_settings(raw: Any) -> EvalSettings:
    """``config.eval`` as EvalSettings; unknown keys, suite names and bad values are refused (ConfigError)."""
    from hydrahead_jax.evaluation.inputs import RETRIEVAL_TASKS
    from hydrahead_jax.evaluation.suite import SuiteError, parse_lengths, parse_suite

    data = dict(_as_dict(raw) or {})
    known = {f.name for f in dataclasses.fields(EvalSettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config key 'eval.{unknown[0]}'; config.eval has the fields {sorted(known)}.")
    try:
        if "suite" in data:
            data["suite"] = parse_suite(data["suite"]) if data["suite"] else ()
        if "lengths" in data:
            lengths = data["lengths"]
            data["lengths"] = parse_lengths(lengths if isinstance(lengths, str) else ",".join(map(str, lengths)))
    except SuiteError as err:
        raise ConfigError(f"config.eval: {err}") from None
    comparable = set(RETRIEVAL_TASKS) | {"ppl", "agreement"}
    bad = sorted(set(data.get("suite", ())) - comparable)
    if bad:
        raise ConfigError(
            f"config.eval.suite: {bad} cannot be compared here (efficiency is measured by eval.py); "
            f"choose from {sorted(comparable)}."
        )
    if "depths" in data:
        data["depths"] = tuple(float(d) for d in data["depths"])
        if not data["depths"] or any(not 0 <= d <= 1 for d in data["depths"]):
            raise ConfigError(f"config.eval.depths={data['depths']}: give fractions in [0, 1].")
    minimum = {"ppl_length": 2, "data_seq_len": 2, "ppl_windows": 1, "samples": 1, "data_rows": 1}
    for key, least in minimum.items():
        value = data.get(key, least)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"config.eval.{key}={value!r}: must be an integer >= {least}.")
    return EvalSettings(**data)


def _set_dotted(recipe: dict, key: str, value: Any, where: str) -> None:
    """Set ``a.b.c`` in a nested dict; a missing section is an unknown key (RunConfig lists the valid ones)."""
    parts = key.split(".")
    node = recipe
    for depth, part in enumerate(parts[:-1]):
        if not isinstance(node.get(part), dict):
            from hydrahead_jax.run_config import section_fields

            valid = section_fields(tuple(parts[:depth]))
            raise ConfigError(
                f"{where}: unknown config key {key!r}: "
                f"{'config' if depth == 0 else 'config.' + '.'.join(parts[:depth])} has no section {part!r}"
                + (f"; its fields are {valid}." if valid else ".")
            )
        node = node[part]
    node[parts[-1]] = list(value) if isinstance(value, tuple) else value


def _check_fixed(name: str, key: str) -> None:
    stage_keys = {s.config_key for s in STAGES}
    head, _, field = key.partition(".")
    fixed = any(key == k or (k.endswith(".") and key.startswith(k)) for k in FIXED_KEYS)
    if fixed or (head in stage_keys and field in FIXED_STAGE_FIELDS):
        raise ConfigError(
            f"variant {name!r}: the override {key!r} would change the data, the teacher or the token budget, which "
            "every variant shares. Fix: set it in config.base (or config.budget_scale) for all variants."
        )


def scaled_base(config) -> dict[str, Any]:
    """``config.base`` as a dict with every stage's steps multiplied by ``config.budget_scale`` (at least 1)."""
    base = copy.deepcopy(_as_dict(config.base))
    scale = float(config.get("budget_scale", 1.0))
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"config.budget_scale={scale!r}: must be a number > 0 (1.0 = the recipe's budget).")
    for stage in STAGES:
        section = base.get(stage.config_key, {})
        for field in ("steps", "tokens"):
            if section.get(field):
                section[field] = max(1, int(round(section[field] * scale)))
    return base


def load_variants(config) -> list[Variant]:
    """Every variant of the comparison recipe, validated (before any training); raises ConfigError naming the
    variant and the fix."""
    base = scaled_base(config)
    try:
        RunConfig.from_recipe(base)
    except ConfigError as err:
        raise ConfigError(f"config.base: {err}") from None
    raw_variants = [_as_dict(v) for v in (config.get("variants") or [])]
    if not raw_variants:
        raise ConfigError("config.variants is empty; list at least one {'name': ..., 'overrides': {...}}.")
    variants, seen = [], set()
    for index, raw in enumerate(raw_variants):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise ConfigError(f"config.variants[{index}] = {raw!r}: each variant is a dict with a 'name'.")
        name = raw["name"]
        extra = sorted(set(raw) - {"name", "overrides", "group"})
        if extra:
            raise ConfigError(f"variant {name!r}: unknown fields {extra}; a variant has name, overrides and group.")
        if not NAME_PATTERN.match(name):
            raise ConfigError(f"variant name {name!r}: use letters, digits, '_', '-' and '.' (it names a folder).")
        if name in seen:
            raise ConfigError(f"variant name {name!r} appears twice in config.variants; give each variant its own.")
        seen.add(name)
        overrides = dict(raw.get("overrides") or {})
        recipe = copy.deepcopy(base)
        for key, value in overrides.items():
            _check_fixed(name, key)
            _set_dotted(recipe, key, value, f"variant {name!r}")
        try:
            run = RunConfig.from_recipe(recipe)
        except ConfigError as err:
            raise ConfigError(f"variant {name!r}: {err}") from None
        if (
            run.selection.method == "given"
            and run.selection.head_map_path
            and not Path(run.selection.head_map_path).is_file()
        ):
            raise ConfigError(
                f"variant {name!r}: selection.head_map_path={run.selection.head_map_path!r} is not a file."
            )
        variants.append(Variant(name, overrides, str(raw.get("group") or name), run))
    probes = [v for v in variants if v.probe_method]
    if probes:
        shared = {_probe_settings(v.run) for v in probes}
        if len(shared) > 1:
            raise ConfigError(
                "the probe-selected variants differ in probe settings (prompts, lengths, preset), so one probe "
                f"cannot serve them all: {[v.name for v in probes]}. Fix: set the probe settings in config.base."
            )
    return variants


def _probe_settings(run: RunConfig) -> str:
    """The selection settings that change the probe's scores (not the method, ratio, allocation or seed)."""
    settings = run.selection.to_dict()
    for key in ("method", "ratio", "allocation", "seed", "head_map_path"):
        settings.pop(key, None)
    return json.dumps(settings, sort_keys=True, default=str)


def config_hash(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_against_teacher(variants: list[Variant], cfg, tokenizer) -> None:
    """The pipeline's checks that need the teacher (selection ratio and allocation against its KV groups, probe
    prompts against its context, a given head map, the corpus), for every variant before any of them trains."""
    from hydrahead_jax.training.errors import USER_ERRORS
    from hydrahead_jax.training.pipeline import validate_against_teacher

    for v in variants:
        try:
            validate_against_teacher(v.run, cfg, tokenizer)
        except USER_ERRORS as err:
            raise ConfigError(f"variant {v.name!r}: {err}") from None


# ------------------------------------------------------------------------------------------------ probe once


def probe_once(variants: list[Variant], workdir: Path, base_run: RunConfig) -> dict[str, str]:
    """Probe the teacher once (stage 0 of ``base_run`` with the combined method, in workdir/probe) and write each
    probe variant's head map, derived from the saved scores, to workdir/head_maps/<name>.json. Returns {variant:
    map path}.

    The probe runs the base recipe, not a variant's: the probe reads only the teacher and the data, which no
    variant may change, and the probe directory's config guard then holds the same config whichever subset of
    variants (``--only``) reaches it first."""
    probes = [v for v in variants if v.probe_method]
    if not probes:
        return {}
    from hydrahead_jax.hybrid import HeadMap
    from hydrahead_jax.training.pipeline import run_pipeline

    probe_dir = workdir / "probe"
    probe_map = probe_dir / "head_map.json"
    if not probe_map.exists():
        settings = dataclasses.replace(base_run.selection.settings, method="combined")
        run = dataclasses.replace(base_run, selection=dataclasses.replace(base_run.selection, settings=settings))
        print(f"[compare] probing the teacher once for {[v.name for v in probes]} in {probe_dir}", flush=True)
        run_pipeline(run, probe_dir, until_stage=SELECT)
    probed = HeadMap.load(probe_map)
    missing = [s for s in PROBE_SCORES if s not in probed.scores]
    if missing:
        raise ConfigError(f"{probe_map} holds no {missing} scores; delete {probe_dir} and rerun to probe again.")
    paths = {}
    for v in probes:
        path = workdir / "head_maps" / f"{v.name}.json"
        derive_head_map(
            probed, v.probe_method, v.run.selection.settings.ratio, v.run.selection.settings.allocation
        ).save(path)
        paths[v.name] = str(path)
    return paths


def derive_head_map(probed, method: str, ratio, allocation: str):
    """The head map ``method`` (retrieval / ablation / combined) would choose at ``ratio`` and ``allocation``,
    from a combined probe's saved score matrices: the same rule as run_selection (select_fa_groups)."""
    import numpy as np

    from hydrahead_jax.selection.select import select_fa_groups, selection_budget

    scores = np.asarray(probed.scores[method], np.float64)
    fa_groups = select_fa_groups(scores, ratio=ratio, allocation=allocation, method=method)
    layers, groups = scores.shape
    return dataclasses.replace(
        probed,
        fa_groups=fa_groups,
        method=method,
        target_ratio=str(ratio),
        allocation=allocation,
        budget=selection_budget(ratio, allocation, layers, groups),
    ).validate()


def _with_head_map(run: RunConfig, path: str) -> RunConfig:
    settings = dataclasses.replace(run.selection.settings, method="given")
    return dataclasses.replace(run, selection=dataclasses.replace(run.selection, settings=settings, head_map_path=path))


# ------------------------------------------------------------------------------------------------ evaluation


class _Models:
    """The teacher (loaded once per source) and the held-out batches the comparison evaluates on."""

    def __init__(self):
        self._teachers: dict = {}
        self._stores: dict = {}

    def teacher(self, run: RunConfig):
        key = json.dumps(_as_dict(dataclasses.asdict(run.teacher)), sort_keys=True, default=str)
        if key not in self._teachers:
            from hydrahead_jax.training.pipeline import load_teacher

            self._teachers[key] = load_teacher(run.teacher)[:2]
        return self._teachers[key]

    def store(self, run: RunConfig, tokenizer):
        if run.data.source == "copy":
            return None
        key = json.dumps(dataclasses.asdict(run.data), sort_keys=True)
        if key not in self._stores:
            from hydrahead_jax.training.data import prepare_store

            self._stores[key] = prepare_store(run.data, tokenizer)
        return self._stores[key]

    def heldout_ids(self, run: RunConfig, tokenizer, settings: EvalSettings):
        """int32 [data_rows, data_seq_len]: the corpus validation split (in order), or copy rows of a seed no
        training iterator uses."""
        import numpy as np

        rows, seq_len = settings.data_rows, settings.data_seq_len
        if run.data.source == "copy":
            from hydrahead_jax.training.data import EVAL_SEED_INDEX, HELDOUT_SEED_OFFSET, make_stage_iterator

            it = make_stage_iterator(
                run.data,
                seq_len=seq_len,
                batch_size=rows,
                seed=run.seed + HELDOUT_SEED_OFFSET + EVAL_SEED_INDEX,
                vocab_size=self.teacher(run)[0].cfg.vocab_size,
                synthetic_rate=0.0,
                batch_rows=range(rows),
            )
        else:
            from hydrahead_jax.data.pipeline import make_train_iterator

            it = make_train_iterator(
                self.store(run, tokenizer),
                seq_len=seq_len,
                batch_size=rows,
                seed=run.seed,
                split="validation",
                shuffle=False,
                batch_rows=range(rows),
                num_threads=1,
            )
        return np.asarray(next(iter(it))["input_ids"], np.int32)


def data_agreement(model, teacher, ids) -> dict[str, float]:
    """Mean KL(teacher ‖ model) and top-1 agreement over every position of ``ids`` [R, T], and the model's
    perplexity exp(mean NLL of the next token); one row at a time through ``evaluation.tasks.text_window``."""
    import numpy as np

    from hydrahead_jax.evaluation.runner import Runner
    from hydrahead_jax.evaluation.tasks import text_window

    runner = Runner(model)
    reference = None if teacher is model else Runner(teacher)
    nll, top1, kl = [], [], []
    for row in ids:
        out = text_window(
            runner,
            row,
            want_nll=True,
            teacher=reference,
            teacher_hidden=None if reference is None else reference.hidden_states(np.asarray(row)[None]),
        )
        nll.append(out["nll"])
        if reference is not None:
            top1.append(out["top1"])
            kl.append(out["kl"])
    result = {"ppl": float(math.exp(np.concatenate(nll).mean())), "positions": int(ids.size)}
    if reference is not None:
        result.update(kl=float(np.concatenate(kl).mean()), top1=float(np.concatenate(top1).mean()))
    return result


def suite_metrics(
    model, tokenizer, teacher, teacher_tokenizer, run: RunConfig, settings: EvalSettings, name: str, suites, journal
):
    """The evaluation suite ``suites`` on one model (the teacher is the agreement reference), flattened to
    {"<task>@<length>": accuracy, "ppl/<source>", "kl/<source>", "top1/<source>"}, and a note (or None);
    ({}, note) without a tokenizer. ``journal``: a folder for the suite's journal (a killed evaluation resumes
    there, one journal per model and settings) or None."""
    if tokenizer is None or not suites:
        why = "eval.suite is empty" if not suites else "the teacher has no tokenizer (a random teacher)"
        return {}, f"evaluation suite {list(suites)} skipped: {why}; only the held-out data rows were evaluated"
    from hydrahead_jax.evaluation.models import EvalModel, describe
    from hydrahead_jax.evaluation.report import aggregate
    from hydrahead_jax.evaluation.suite import Settings, Suite

    data = dataclasses.asdict(run.data)
    corpus = (
        None
        if run.data.source == "copy"
        else {k: data[k] for k in ("source", "validation_fraction", "txt_split", "text_field")}
    )
    is_teacher = model is teacher
    evaluated = EvalModel(name, model, tokenizer, "teacher" if is_teacher else "hydrahead", info=describe(model))
    reference = None if is_teacher else EvalModel("teacher", teacher, teacher_tokenizer, "teacher")
    suite = Suite(
        [evaluated],
        Settings(
            suites=tuple(suites),
            retrieval_lengths=settings.lengths,
            ppl_lengths=(settings.ppl_length,),
            efficiency_lengths=(),
            depths=settings.depths,
            samples=settings.samples,
            ppl_windows=settings.ppl_windows,
            seed=0,
            corpus=corpus,
        ),
        teacher=reference,
    )
    if journal is not None:
        suite.resume(suite.journal(journal, per_run_folder=True))
    suite.run(progress=False)
    out = {}
    for rec in aggregate(suite):
        if rec["model"] != name:
            continue
        if rec["metric"] == "accuracy" and "depth" not in rec:
            out[f"{rec['task']}@{rec['length']}"] = rec["value"]
            if "answer_nll" in rec:
                out[f"{ANSWER_NLL}{rec['task']}@{rec['length']}"] = rec["answer_nll"]
        elif rec["metric"] == "accuracy":  # NIAH: one record per depth; the length's accuracy is their mean
            out.setdefault(f"_{rec['task']}@{rec['length']}", []).append(rec["value"])
            if "answer_nll" in rec:
                out.setdefault(f"_{ANSWER_NLL}{rec['task']}@{rec['length']}", []).append(rec["answer_nll"])
        elif rec["metric"] in ("perplexity", "kl", "top1"):
            out[f"{'ppl' if rec['metric'] == 'perplexity' else rec['metric']}/{rec['source']}"] = rec["value"]
            if len(rec.get("window_values") or []) > 1:  # the report's intervals and paired differences
                out[f"{WINDOWS}{rec['metric']}/{rec['source']}"] = rec["window_values"]
    for key in [k for k in out if k.startswith("_")]:
        values = out.pop(key)
        out[key[1:]] = float(sum(values) / len(values))
    skipped = "; ".join(f"{s['task']} {s['source']} {s['length']}: {s['reason'][:120]}" for s in suite.skipped)
    return out, (f"suite cells skipped: {skipped}" if skipped else None)


def evaluate(
    model, tokenizer, teacher, teacher_tokenizer, run, settings, ids, name, *, retrieval=True, journal=None
) -> dict:
    """Every number the comparison reports about one model (module doc); ``ids``: the held-out data rows.
    ``retrieval=False`` (the student at initialisation): the suite's text tasks only (ppl, agreement).
    ``journal``: where the suite journals its finished units (``suite_metrics``)."""
    from hydrahead_jax.evaluation.tasks import cache_sizes

    start = time.perf_counter()
    suites = [t for t in settings.suite if retrieval or t in ("ppl", "agreement")]
    suite, note = suite_metrics(model, tokenizer, teacher, teacher_tokenizer, run, settings, name, suites, journal)
    fa = model.fa_groups_per_layer
    return {
        "data": data_agreement(model, teacher, ids),
        "suite": suite,
        "notes": [note] if note else [],
        "fa_groups": int(sum(fa)),
        "kv_groups": int(model.cfg.num_layers * model.cfg.num_kv_heads),
        "kv_bytes_per_token": int(cache_sizes(model, settings.data_seq_len)["kv_bytes_per_token"]),
        "eval_seconds": round(time.perf_counter() - start, 1),
    }


# ------------------------------------------------------------------------------------------------ running


def _read_json(path: Path) -> Any:
    """The JSON in ``path``; None when it is missing, or damaged (said so: what it holds is computed again; the
    comparison writes its files atomically, so only damage makes one unreadable). Any other read error (a
    filesystem's, permissions) propagates: it is no reason to redo finished work."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        print(f"[compare] WARNING: {path} is damaged ({err}); computing it again", flush=True)
        return None


def _write_json(path: Path, data: Any) -> None:
    """Atomically (a temporary file, then rename): a killed comparison never leaves half a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


class StageTimings:
    """Wall seconds per stage of one variant (``timings.json``), summed over reruns.

    A stage that ends, raises or is stopped (SIGTERM) adds its time on the way out. A process killed outright (SIGKILL,
    a lost machine) cannot, so each stage first records when it starts (``stage_running.json``: the stage, its
    start as epoch seconds, and the seconds it had before); the next run that opens the variant adds to that stage
    the time from its start to the last write of ``metrics.jsonl`` (a row per training step), a lower bound that
    misses only what the killed process did after its last row. A marker whose stage already holds more than it
    had before is one the stage's own exit wrote past (killed between the two writes) and adds nothing."""

    def __init__(self, vdir: Path):
        self.path = vdir / "timings.json"
        self.marker = vdir / "stage_running.json"
        self.heartbeat = vdir / "metrics.jsonl"
        self.seconds: dict[str, float] = _read_json(self.path) or {}
        killed = _read_json(self.marker)
        if killed:
            if self.seconds.get(killed["stage"], 0.0) == killed["seconds_before"] and self.heartbeat.exists():
                self._add(killed["stage"], max(0.0, self.heartbeat.stat().st_mtime - killed["since"]))
            self.marker.unlink()

    def _add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = round(self.seconds.get(stage, 0.0) + seconds, 1)
        _write_json(self.path, self.seconds)

    @contextlib.contextmanager
    def stage(self, stage: str):
        before = self.seconds.get(stage, 0.0)
        _write_json(self.marker, {"stage": stage, "since": time.time(), "seconds_before": before})
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._add(stage, time.perf_counter() - t0)
            self.marker.unlink(missing_ok=True)


def _stage_finished(run: RunConfig, vdir: Path, stage: str) -> bool:
    from hydrahead_jax.training.checkpoint import finished_step

    if stage == SELECT:
        return (vdir / "head_map.json").exists()
    spec = next(s for s in STAGES if s.name == stage)
    done = finished_step(vdir / spec.directory)
    return done is not None and done >= run.stage(spec).total_steps


def run_stage(run: RunConfig, vdir: Path, stage: str) -> None:
    """One stage of one variant through the ordinary pipeline (it checkpoints, resumes and exports as any run)."""
    from hydrahead_jax.training.pipeline import run_pipeline

    run_pipeline(run, vdir, only_stage=stage)


def _eval_at_init(models: _Models, variant: Variant, run: RunConfig, vdir: Path, settings, ids) -> dict:
    from hydrahead_jax.hybrid import HeadMap
    from hydrahead_jax.training.pipeline import initial_student

    teacher, tokenizer = models.teacher(run)
    head_map = HeadMap.load(vdir / "head_map.json", teacher.cfg)
    student = initial_student(run, teacher, tokenizer, head_map, models.store(run, tokenizer))
    return evaluate(student, tokenizer, teacher, tokenizer, run, settings, ids, variant.name, retrieval=False)


def _eval_final(models: _Models, variant: Variant, run: RunConfig, vdir: Path, settings, ids) -> dict:
    from hydrahead_jax.export import load_hydrahead

    teacher, tokenizer = models.teacher(run)
    student, _ = load_hydrahead(vdir / "final")
    journal = vdir / "eval_progress"
    return evaluate(student, tokenizer, teacher, tokenizer, run, settings, ids, variant.name, journal=journal)


def _fmt_seconds(s: float) -> str:
    return f"{int(s // 3600)}:{int(s % 3600 // 60):02d}:{int(s % 60):02d}"


def select_variants(variants: list[Variant], only: list[str] | None) -> list[Variant]:
    """The variants named in ``only`` (in the recipe's order), or all of them when ``only`` is empty; an unknown
    name is refused with the recipe's names."""
    if not only:
        return variants
    names = [v.name for v in variants]
    unknown = [name for name in only if name not in names]
    if unknown:
        raise ConfigError(f"--only names {unknown}, which the comparison recipe does not list; its variants: {names}.")
    return [v for v in variants if v.name in only]


def run_comparison(config, workdir: str | Path, *, only: list[str] | None = None) -> dict[str, Any]:
    """Train and evaluate every variant of the comparison recipe ``config`` in ``workdir`` (or only those named
    in ``only``: to split one comparison across machines, each with its own workdir, and ``--merge`` their
    results afterwards), then write results.json, report.md and the plots; returns the results. Resumable (module
    doc). A second comparison on the same workdir is refused while one runs."""
    from hydrahead_jax.training.checkpoint import WorkdirLock

    workdir = Path(workdir).absolute()
    variants = load_variants(config)  # every variant is checked before any work
    chosen = select_variants(variants, only)
    settings = eval_settings(config.get("eval"))
    keep = config.get("keep_checkpoints", False)
    if not isinstance(keep, bool):
        raise ConfigError(f"config.keep_checkpoints={keep!r}: must be True or False.")
    lock = WorkdirLock(workdir)  # one comparison per workdir (each variant's run locks its own directory too)
    lock.acquire()
    try:
        _run_locked(workdir, comparison_base(config), chosen, settings, keep_checkpoints=keep)
        # One report path for a whole run, an --only run and --report_only: every variant of the recipe finished
        # in this workdir, the rest listed as unfinished.
        return report_finished(config, workdir)
    finally:
        lock.release()


def comparison_base(config) -> RunConfig:
    """The comparison's base recipe (budget scaled) as a RunConfig: what every variant starts from."""
    return RunConfig.from_recipe(scaled_base(config))


def _run_locked(
    workdir: Path,
    base_run: RunConfig,
    variants: list[Variant],
    settings: EvalSettings,
    *,
    keep_checkpoints: bool = False,
) -> None:
    """Probe, evaluate the teacher, then train and evaluate each of ``variants`` not finished yet (their files
    under ``workdir``; run_comparison reports them)."""
    from hydrahead_jax.compilation import release_compiled

    print(f"[compare] {len(variants)} variants in {workdir}: {', '.join(v.name for v in variants)}", flush=True)
    models = _Models()
    teacher, tokenizer = models.teacher(base_run)
    check_against_teacher(variants, teacher.cfg, tokenizer)  # still before any training
    head_maps = probe_once(variants, workdir, base_run)

    ids = models.heldout_ids(base_run, tokenizer, settings)
    teacher_hash = config_hash(
        {
            "teacher": dataclasses.asdict(base_run.teacher),
            "eval": settings.to_dict(),
            "data": dataclasses.asdict(base_run.data),
        }
    )
    teacher_file = workdir / "teacher" / "eval.json"
    teacher_eval = _read_json(teacher_file)
    if not teacher_eval or teacher_eval.get("config_hash") != teacher_hash:
        print("[compare] evaluating the teacher (once, shared by every variant)", flush=True)
        teacher_eval = {
            "config_hash": teacher_hash,
            **evaluate(
                teacher, tokenizer, teacher, tokenizer, base_run, settings, ids, "teacher", journal=teacher_file.parent
            ),
        }
        _write_json(teacher_file, teacher_eval)

    started, finished_times = time.perf_counter(), []
    for k, variant in enumerate(variants, 1):
        run, vdir, digest = _variant_run(variant, head_maps, workdir, settings)
        if _finished(vdir, digest):
            if not keep_checkpoints:
                prune_checkpoints(vdir)  # a comparison killed between eval.json and the deletion
            print(
                f"[compare] {k}/{len(variants)} {variant.name}: finished earlier (eval.json matches), skipped",
                flush=True,
            )
        else:
            variant_start = time.perf_counter()
            timings = StageTimings(vdir)
            for stage in STAGE_ORDER:
                if _stage_finished(run, vdir, stage):
                    continue
                print(f"[compare] {k}/{len(variants)} {variant.name}: stage {stage}", flush=True)
                try:
                    with timings.stage(stage):
                        run_stage(run, vdir, stage)
                finally:
                    release_compiled()  # the stage's executables do not run again (compilation.py)
                if stage == SELECT and not (vdir / "eval_init.json").exists():
                    init = _eval_at_init(models, variant, run, vdir, settings, ids)
                    _write_json(vdir / "eval_init.json", init)
            if not (vdir / "eval_init.json").exists():  # head map from an earlier run, init never evaluated
                _write_json(vdir / "eval_init.json", _eval_at_init(models, variant, run, vdir, settings, ids))
            final = _eval_final(models, variant, run, vdir, settings, ids)
            _write_json(vdir / "eval.json", {"config_hash": digest, **final})
            release_compiled()
            if not keep_checkpoints:
                freed = prune_checkpoints(vdir)
                print(f"[compare] {variant.name}: stage checkpoints deleted ({freed / 2**30:.1f} GiB)", flush=True)
            finished_times.append(time.perf_counter() - variant_start)
            elapsed = time.perf_counter() - started
            eta = (sum(finished_times) / len(finished_times)) * (len(variants) - k)
            print(
                f"[compare] {k}/{len(variants)} {variant.name}: done in {_fmt_seconds(finished_times[-1])}; "
                f"elapsed {_fmt_seconds(elapsed)}, ETA {_fmt_seconds(eta)}",
                flush=True,
            )


def prune_checkpoints(vdir: Path) -> int:
    """Delete a finished variant's stage checkpoints (Orbax step directories, unfinished saves and DONE markers);
    keep everything else (final/, metrics.jsonl, each stage's heldout.json and memory.json). Without its DONE
    marker a stage counts as unfinished, so a later change of the variant's config retrains it from the start
    instead of resuming from checkpoints that are gone. Returns the bytes freed."""
    import shutil

    from hydrahead_jax.training.checkpoint import DONE_MARKER

    freed = 0
    for stage in STAGES:
        stage_dir = vdir / stage.directory
        if not stage_dir.is_dir():
            continue
        marker = stage_dir / DONE_MARKER
        if marker.exists():
            marker.unlink()  # first: a stage without checkpoints must never look finished
        for entry in stage_dir.iterdir():
            if entry.is_dir() and (entry.name.isdigit() or entry.name.endswith(".orbax-checkpoint-tmp")):
                freed += sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
                shutil.rmtree(entry)
    return freed


def _variant_run(variant: Variant, head_maps: dict[str, str], workdir: Path, settings: EvalSettings):
    """The variant's run config (with its derived head map), its directory and its config hash."""
    run = _with_head_map(variant.run, head_maps[variant.name]) if variant.name in head_maps else variant.run
    return run, workdir / "variants" / variant.name, config_hash({"run": run.to_dict(), "eval": settings.to_dict()})


def _finished(vdir: Path, digest: str) -> bool:
    done = _read_json(vdir / "eval.json")
    return bool(done) and done.get("config_hash") == digest


def _write_results(workdir, base_run, settings, teacher_eval, records, *, unfinished: list[str]) -> dict:
    from hydrahead_jax.experiments.report import write_report

    results = {
        "workdir": str(workdir),
        "base": base_run.to_dict(),
        "eval": settings.to_dict(),
        "teacher": teacher_eval,
        "variants": records,
        "unfinished": unfinished,
    }
    write_report(results, workdir)
    print(f"[compare] wrote {workdir / 'results.json'}, {workdir / 'report.md'} and the plots", flush=True)
    return results


def report_finished(config, workdir: str | Path, *, merge: list[str | Path] = ()) -> dict[str, Any]:
    """results.json, report.md and the plots from the variants finished so far, without training or evaluating
    anything (``--report_only``): to look at a long comparison while it runs, or at one stopped part-way. The
    unfinished variants are listed in results.json and report.md.

    ``merge``: results.json files of other runs of this recipe (a comparison split across machines with
    ``--only``, or an earlier workdir); a variant not finished in ``workdir`` takes its record from them
    (``merged_records`` says what must match)."""
    workdir = Path(workdir).absolute()
    variants = load_variants(config)
    settings = eval_settings(config.get("eval"))
    base = comparison_base(config)
    teacher_eval = _read_json(workdir / "teacher" / "eval.json")
    if not teacher_eval:
        raise ConfigError(
            f"{workdir} holds no comparison results yet (no teacher/eval.json); run the comparison without "
            "--report_only first."
        )
    head_maps = {v.name: str(workdir / "head_maps" / f"{v.name}.json") for v in variants if v.probe_method}
    local = {}
    for variant in variants:
        run, vdir, digest = _variant_run(variant, head_maps, workdir, settings)
        if _finished(vdir, digest):
            local[variant.name] = variant_record(variant, run, vdir, digest)
    merged = merged_records(merge, variants, base, settings, teacher_eval, skip=set(local))
    records = [local.get(v.name) or merged[v.name] for v in variants if v.name in local or v.name in merged]
    unfinished = [v.name for v in variants if v.name not in local and v.name not in merged]
    if not records:
        raise ConfigError(f"no variant of this comparison has finished in {workdir}; nothing to report yet.")
    return _write_results(workdir, base, settings, teacher_eval, records, unfinished=unfinished)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def merged_records(
    paths, variants: list[Variant], base: RunConfig, settings: EvalSettings, teacher_eval: dict, *, skip: set[str]
) -> dict[str, dict[str, Any]]:
    """{variant name: record} from other comparisons' results.json files, for the variants of this recipe not in
    ``skip``. A file is accepted only when it ran the same comparison: the same base recipe (so the same data,
    seed, token budget and teacher), the same evaluation settings and the same teacher evaluation config; a record
    only when its overrides are this recipe's overrides for that name. Anything else is refused (ConfigError
    naming the file and the difference): a merged report must compare like with like. Each merged record keeps
    where it came from (``merged_from``)."""
    by_name = {v.name: v for v in variants}
    mine = base.to_dict()
    merged: dict[str, dict[str, Any]] = {}
    for path in paths:
        path = Path(path)
        results = _read_json(path)
        if not isinstance(results, dict) or "variants" not in results:
            raise ConfigError(f"--merge {path}: not a comparison's results.json (missing, unreadable or no variants).")
        theirs = results.get("base") or {}
        differ = sorted(k for k in set(mine) | set(theirs) if _canonical(mine.get(k)) != _canonical(theirs.get(k)))
        if differ:
            raise ConfigError(
                f"--merge {path}: its comparison ran a different base recipe (differs in {differ}); only runs of "
                "the same recipe (same data, seed, budget_scale and teacher) can be reported together."
            )
        if _canonical(results.get("eval")) != _canonical(settings.to_dict()):
            raise ConfigError(f"--merge {path}: its evaluation settings differ from this recipe's config.eval.")
        if (results.get("teacher") or {}).get("config_hash") != teacher_eval.get("config_hash"):
            raise ConfigError(f"--merge {path}: its teacher was evaluated on other settings (teacher config hash).")
        for record in results["variants"]:
            name = record.get("name")
            if name in skip:
                continue
            if name not in by_name:
                print(f"[compare] --merge {path}: {name!r} is not in this recipe's variants; left out", flush=True)
                continue
            if _canonical(record.get("overrides")) != _canonical(by_name[name].overrides):
                raise ConfigError(
                    f"--merge {path}: variant {name!r} ran with overrides {record.get('overrides')}, this recipe "
                    f"lists {by_name[name].overrides}; rename one of them."
                )
            if name in merged:
                raise ConfigError(
                    f"--merge: variant {name!r} is in both {merged[name]['merged_from']} and {path}; merge one."
                )
            merged[name] = {**record, "merged_from": str(path.absolute())}
    return merged


def _metrics_rows(vdir: Path) -> list[dict]:
    """The rows of the variant's metrics.jsonl ([] when it has none). A line that does not decode (the last one,
    when a run was killed while appending it) is left out, the others kept; a read error propagates."""
    path = vdir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def heldout_curves(vdir: Path) -> tuple[dict[str, list[list[float]]], str]:
    """{stage directory: [[tokens_seen, loss], ...]} from the variant's metrics.jsonl: its held-out rows
    ("split": "heldout"), or its training rows when it has none; and which of the two."""
    rows = _metrics_rows(vdir)
    heldout = [r for r in rows if r.get("split") == "heldout"]
    source, chosen = ("heldout", heldout) if heldout else ("training", [r for r in rows if "split" not in r])
    curves: dict[str, list[list[float]]] = {}
    for r in chosen:
        if "loss" in r and "tokens_seen" in r:
            curves.setdefault(str(r["stage"]), []).append([int(r["tokens_seen"]), float(r["loss"])])
    return {k: sorted(v) for k, v in curves.items()}, source


def heldout_ends(vdir: Path) -> dict[str, dict[str, dict[str, float]]]:
    """{stage directory: {"start": row, "end": row}}: each stage's held-out values (loss, KL, top-1 on its fixed
    validation batch) at its first and last evaluated step, from the stage's heldout.json."""
    ends = {}
    for stage in STAGES:
        summary = _read_json(vdir / stage.directory / "heldout.json")
        if summary and summary.get("first") and summary.get("last"):
            drop = ("stage", "split")
            ends[stage.directory] = {
                end: {k: v for k, v in summary[key].items() if k not in drop}
                for end, key in (("start", "first"), ("end", "last"))
            }
    return ends


def variant_record(variant: Variant, run: RunConfig, vdir: Path, digest: str) -> dict[str, Any]:
    """What results.json holds about one variant."""
    curves, curve_source = heldout_curves(vdir)
    final = _read_json(vdir / "eval.json") or {}
    final.pop("config_hash", None)
    head_map = _read_json(vdir / "head_map.json") or {}
    return {
        "name": variant.name,
        "group": variant.group,
        "overrides": variant.overrides,
        "config_hash": digest,
        "selection": {
            "method": head_map.get("method"),
            "ratio": head_map.get("target_ratio"),
            "allocation": head_map.get("allocation"),
        },
        "fusion": run.hybrid.fusion,
        "stage_seconds": _read_json(vdir / "timings.json") or {},
        "stage_tokens": {s.name: run.stage(s).total_steps * run.stage(s).tokens_per_step for s in STAGES},
        "at_init": _read_json(vdir / "eval_init.json") or {},
        "final": final,
        "curves": curves,
        "curve_source": curve_source,
        "heldout": heldout_ends(vdir),
    }


# ------------------------------------------------------------------------------------------------ command line


def main(argv=None) -> int:
    from absl import app, flags
    from ml_collections import config_flags

    config = config_flags.DEFINE_config_file(
        "config", None, "Comparison recipe (configs/compare_*.py).", lock_config=False, accept_new_attributes=True
    )
    workdir = flags.DEFINE_string("workdir", None, "Comparison directory (every variant's run, results, plots).")
    report_only = flags.DEFINE_bool(
        "report_only",
        False,
        "Write results.json, report.md and the plots from the variants finished so far; train nothing.",
    )
    only = flags.DEFINE_list(
        "only", [], "Run only these variants (comma-separated names), e.g. to split a comparison across machines."
    )
    merge = flags.DEFINE_list(
        "merge",
        [],
        "With --report_only: results.json files of other runs of the same recipe to report with this workdir's.",
    )
    flags.mark_flags_as_required(["config", "workdir"])

    def _main(args):
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments {args[1:]}; options are given as --flag=value.")
        from absl import logging

        from hydrahead_jax.compilation import use_persistent_cache
        from hydrahead_jax.training.errors import USER_ERRORS

        logging.set_verbosity(logging.WARNING)
        use_persistent_cache()
        from hydrahead_jax.training.trainer import Preempted

        try:
            if merge.value and not report_only.value:
                raise ConfigError("--merge reports finished results; use it with --report_only.")
            if report_only.value:
                report_finished(config.value, workdir.value, merge=merge.value)
            else:
                run_comparison(config.value, workdir.value, only=only.value)
        except USER_ERRORS as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        except Preempted as stop:  # SIGTERM: the running stage checkpointed; rerun the same command to continue
            print(f"preempted: {stop}", file=sys.stderr, flush=True)
            sys.exit(143)

    app.run(_main, argv=argv)
    return 0


if __name__ == "__main__":
    main()
