"""One report from several finished eval.py runs: ``eval.py --combine A --combine B --out W``.

Long contexts are evaluated piece by piece (RULER at 8K costs minutes a prompt on a CPU, so each length is its own
run, with its own number of samples, on its own day); the report a reader wants has every length side by side,
with one accuracy-vs-length plot per task. The runs' ``results.json`` files are joined record by record: a model
is the same model in every run (its parameter digest in the runs' journals, else its kind, size and config), no
(model, task, length) cell is measured twice, and RULER's per-length scores and intervals are recomputed from the
joined samples, so every number keeps the n it was measured with.
"""

from __future__ import annotations

import json
from pathlib import Path

from hydrahead_jax.evaluation import ruler
from hydrahead_jax.evaluation.journal import model_digests
from hydrahead_jax.evaluation.suite import SuiteError

# Settings whose values are lengths: the combined run's are the union.
_LENGTH_SETTINGS = ("retrieval_lengths", "ppl_lengths", "efficiency_lengths", "ruler_lengths")
# What identifies a model when its runs' journals do not both carry its parameter digest.
_MODEL_IDENTITY = ("kind", "params", "config", "fa_groups_per_layer")


def _read(folder: Path) -> tuple[dict, dict[str, str]]:
    """(results.json, {model name: parameter digest} from the journal's header, empty without a journal)."""
    path = folder / "results.json"
    if not path.is_file():
        raise SuiteError(f"--combine {folder}: no results.json there; give the --out folder of a finished eval.py run.")
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SuiteError(f"--combine {folder}: results.json is not JSON ({err}); rerun that evaluation.") from None
    missing = {"settings", "models", "results", "environment"} - set(results)
    if missing:
        raise SuiteError(f"--combine {folder}: results.json lacks {sorted(missing)}; it is not an eval.py result.")
    return results, model_digests(folder)


def _join_models(runs: list[tuple[Path, dict, dict[str, str]]]) -> list[dict]:
    """The models of every run, each once (first appearance), refused when one name means two models."""
    seen: dict[str, tuple[Path, dict, str | None]] = {}
    for folder, results, digests in runs:
        for model in results["models"]:
            name = model["name"]
            if name not in seen:
                seen[name] = (folder, model, digests.get(name))
                continue
            first_folder, first, first_digest = seen[name]
            digest = digests.get(name)
            if first_digest is not None and digest is not None:
                differs = ["parameters"] if first_digest != digest else []
            else:
                differs = [k for k in _MODEL_IDENTITY if first.get(k) != model.get(k)]
            if differs:
                raise SuiteError(
                    f"--combine: model {name!r} of {first_folder} and of {folder} differ in {', '.join(differs)}; "
                    "combine runs of the same weights, or label the models apart (--model LABEL=SPEC) when "
                    "evaluating them."
                )
    return [model for _, model, _ in seen.values()]


def _check_disjoint(runs, records_of, key, what: str) -> None:
    """No cell (``key(record)``) of ``records_of(results)`` is in two runs."""
    owner: dict[tuple, Path] = {}
    for folder, results, _ in runs:
        for cell in {key(r) for r in records_of(results)}:
            if cell in owner:
                raise SuiteError(
                    f"--combine: {what} {cell} is measured in both {owner[cell]} and {folder}; combine runs of "
                    "different lengths, tasks or models (or keep one of the two)."
                )
            owner[cell] = folder


def _join_settings(settings: list[dict]) -> dict:
    """Each setting as the runs agree on it; lengths and suites as their union; any other setting the runs
    differ in as the list of the runs' values (in ``combined_from`` order)."""
    joined: dict = {}
    for key in dict.fromkeys(k for s in settings for k in s):
        values = [s.get(key) for s in settings]
        if key in _LENGTH_SETTINGS:
            joined[key] = sorted({n for v in values for n in (v or [])})
        elif key == "suites":
            joined[key] = list(dict.fromkeys(x for v in values for x in (v or [])))
        elif all(v == values[0] for v in values):
            joined[key] = values[0]
        else:
            joined[key] = values
    return joined


def combine_results(folders: list[str | Path]) -> dict:
    """The results dict of ``folders``' eval.py runs together (module doc); ``report.write_results`` writes it."""
    if len(folders) < 2:
        raise SuiteError("--combine needs at least two finished runs (give --combine once per --out folder).")
    runs = [(Path(f), *_read(Path(f))) for f in folders]
    models = _join_models(runs)
    teachers = {r["teacher"] for _, r, _ in runs if r.get("teacher")}
    if len(teachers) > 1:
        raise SuiteError(f"--combine: the runs compare against different teachers ({sorted(teachers)}).")
    _check_disjoint(
        runs,
        lambda r: r.get("ruler_samples", []),
        lambda s: (s["model"], s["task"], s["nominal_length"]),
        "RULER cell (model, task, length)",
    )
    _check_disjoint(
        runs,
        lambda r: r["results"],
        lambda x: (x["model"], x["task"], x.get("metric"), x.get("length"), x.get("depth"), x.get("source")),
        "cell (model, task, metric, length, depth, source)",
    )

    def joined(field: str) -> list:
        return [x for _, r, _ in runs for x in r.get(field, [])]

    ruler_samples = joined("ruler_samples")
    return {
        "settings": _join_settings([r["settings"] for _, r, _ in runs]),
        "models": models,
        "teacher": next(iter(teachers), None),
        "results": joined("results"),
        "samples": joined("samples"),
        "ruler": ruler.aggregate(ruler_samples, {m["name"]: m.get("train_length") for m in models}),
        "ruler_samples": ruler_samples,
        "skipped": joined("skipped"),
        "notes": joined("notes"),
        "seconds": joined("seconds"),
        "memory_source": runs[0][1].get("memory_source"),
        "environment": runs[0][1]["environment"],
        "combined_from": [
            {"folder": str(folder), "settings": r["settings"], "environment": r["environment"]} for folder, r, _ in runs
        ],
    }
