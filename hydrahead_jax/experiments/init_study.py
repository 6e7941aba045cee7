"""How far the HydraHead student starts from its teacher, under each of a list of initialisations.

    python -m hydrahead_jax.experiments.init_study --out runs/init_study
    python -m hydrahead_jax.experiments.init_study --head-map runs/demo/head_map.json \\
        --variant fit:fusion_init=fit,fusion_bias=True --variant wide:gdn_dt_min=1e-4 --stage1-steps 40

For every variant (a name and a set of ``HybridConfig`` fields; ``--variant`` adds one, the built-in list
``DEFAULT_VARIANTS`` is used unless ``--no-defaults``) the student is built from the recipe's teacher exactly as
the training pipeline builds it (``build_student`` with the pipeline's calibration batch: the recipe's
``hybrid_calibration_rows`` stage-1 rows) and evaluated by the evaluation suite's "ppl" and "agreement" tasks on
held-out news text (lee_background.cor, ``--rows`` windows of ``--length`` tokens): teacher and student
perplexity, KL(teacher ‖ student) in nats/token and top-1 agreement with the teacher.

``--stage1-steps N``: each variant then also runs stage 1 (align: new parameters only, layer-wise targets)
through the real pipeline, ``run_pipeline(..., until_stage="align")`` with N steps of the ``--stage1-batch`` ×
``--stage1-seq-len`` tokens, in OUT/runs/<variant>, and the same metrics are measured on the student it ends with.
Finished runs are reused (rerunning the study resumes).

The head map: ``--head-map FILE``, or the recipe's stage 0 run once into OUT/select (its head_map.json is reused
on a rerun). Writes OUT/init_study.json (every number, the settings, the machine's load) and OUT/init_study.md
(the table).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from hydrahead_jax.config import ConfigError
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_model, build_student

# name → HybridConfig changes to the recipe's hybrid section. Every built-in row starts from the paper's
# initialisation (γ = the teacher head's output RMS, no offset μ; ``PAPER_INIT``) whatever the recipe's own choice,
# so the rows mean the same for every recipe; the first row is that initialisation (every other row is read
# against it).
PAPER_INIT = {"fusion_init": "rms", "fusion_bias": False}
DEFAULT_VARIANTS: dict[str, dict] = {
    name: {**PAPER_INIT, **changes}
    for name, changes in {
        "default": {},
        "fusion_none": {"fusion": "none"},
        "la_only": {"fusion": "la_only"},
        "fit_gamma": {"fusion_init": "fit"},
        "fit": {"fusion_init": "fit", "fusion_bias": True},
        "fit_channel": {"fusion_init": "fit", "fusion_bias": True, "fusion_granularity": "channel"},
        "fit_la_only": {"fusion": "la_only", "fusion_init": "fit", "fusion_bias": True},
        "dt_long": {"gdn_dt_min": 1e-4, "gdn_dt_max": 1e-2},
        "dt_short": {"gdn_dt_min": 1e-2, "gdn_dt_max": 3e-1},
        "beta_low": {"gdn_beta": 0.1},
        "beta_high": {"gdn_beta": 0.9},
        "fit_dt_long": {"fusion_init": "fit", "fusion_bias": True, "gdn_dt_min": 1e-4, "gdn_dt_max": 1e-2},
        "fit_dt_short": {"fusion_init": "fit", "fusion_bias": True, "gdn_dt_min": 1e-2, "gdn_dt_max": 3e-1},
        "fit_beta_low": {"fusion_init": "fit", "fusion_bias": True, "gdn_beta": 0.1},
    }.items()
}
METRICS = ("ppl", "kl", "top1")


class StudyError(ValueError):
    """A bad command-line setting; the message names it and the fix."""


# ------------------------------------------------------------------------------------------ settings
def parse_variant(text: str) -> tuple[str, dict]:
    """'name:field=value,field=value' → (name, {field: value}); values are read as Python literals (numbers,
    True/False) or kept as strings, then checked by HybridConfig."""
    name, sep, body = text.partition(":")
    if not sep or not name.strip():
        raise StudyError(f"--variant {text!r}: write NAME:FIELD=VALUE[,FIELD=VALUE...], e.g. fit:fusion_init=fit.")
    fields = {f.name: f for f in dataclasses.fields(HybridConfig)}
    changes = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in fields:
            raise StudyError(
                f"--variant {text!r}: {part!r} is not FIELD=VALUE with a HybridConfig field; the fields are "
                f"{sorted(fields)}."
            )
        changes[key] = _literal(value)
    return name.strip(), changes


def _literal(value: str):
    if value in ("True", "true"):
        return True
    if value in ("False", "false"):
        return False
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def load_recipe(path: str):
    """The ConfigDict of a recipe file ('configs/x.py' or 'configs/x.py:arg'), as train.py's --config reads it."""
    file, _, arg = path.partition(":")
    if not Path(file).is_file():
        raise StudyError(
            f"--config {path!r}: {file} is not a file; give a recipe such as configs/smollm2_hydrahead.py."
        )
    root = str(Path(file).resolve().parent.parent)
    if root not in sys.path:  # recipes import configs.common
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(f"_recipe_{Path(file).stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg or None)


def run_config(recipe_path: str, hybrid: dict, *, head_map_path: str | None = None, stage1: dict | None = None):
    """RunConfig of the recipe with ``hybrid`` (HybridConfig fields) and the stage-1 settings changed."""
    from hydrahead_jax.run_config import RunConfig

    c = load_recipe(recipe_path)
    for key, value in hybrid.items():
        c.hybrid[key] = value
    if head_map_path is not None:
        c.selection.method = "given"
        c.selection.head_map_path = str(head_map_path)
    for key, value in (stage1 or {}).items():
        c.stage1[key] = value
    return RunConfig.from_recipe(c)


# ------------------------------------------------------------------------------------------ measuring
class Study:
    """Loads the teacher, the head map and the held-out windows once; measures students one at a time."""

    def __init__(self, recipe: str, out: Path, head_map_path: str | None, rows: int, length: int):
        from hydrahead_jax.data import load_heldout_text
        from hydrahead_jax.evaluation.models import EvalModel
        from hydrahead_jax.evaluation.suite import Settings
        from hydrahead_jax.training.pipeline import load_teacher

        self.recipe, self.out = recipe, out
        self.base_run = run_config(recipe, {})
        self.head_map_path = str(head_map_path) if head_map_path else str(self._select_heads())
        self.teacher, self.tokenizer, self.cfg = load_teacher(self.base_run.teacher)
        if self.tokenizer is None:
            raise StudyError("the recipe's teacher is random (no tokenizer): held-out text cannot be encoded for it.")
        self.head_map = HeadMap.load(self.head_map_path, self.cfg)
        news = out / "heldout_news.txt"
        news.write_text(load_heldout_text(), encoding="utf-8")
        self.settings = Settings(
            suites=("ppl", "agreement"),
            retrieval_lengths=(),
            ppl_lengths=(length,),
            efficiency_lengths=(),
            ppl_windows=rows,
            texts={"news": str(news)},
        )
        self.teacher_model = EvalModel("teacher", self.teacher, self.tokenizer, "teacher")
        self.calibration_ids = self._calibration_ids()
        self.teacher_ppl: float | None = None

    def _select_heads(self) -> Path:
        """Stage 0 of the recipe into OUT/select (reused when its head_map.json exists)."""
        from hydrahead_jax.training.pipeline import run_pipeline

        path = self.out / "select" / "head_map.json"
        if not path.is_file():
            print(f"[init_study] no --head-map: running the recipe's stage 0 into {path.parent}", flush=True)
            run_pipeline(self.base_run, self.out / "select", until_stage="select")
        return path

    def _calibration_ids(self) -> np.ndarray:
        """The pipeline's calibration batch (``training.pipeline.calibration_ids``)."""
        from hydrahead_jax.run_config import STAGES
        from hydrahead_jax.training.data import prepare_stores, stage_stores
        from hydrahead_jax.training.pipeline import calibration_ids

        run = self.base_run
        store = stage_stores(run, STAGES[0], prepare_stores(run, self.tokenizer))
        return np.asarray(calibration_ids(run, self.cfg.vocab_size, self.tokenizer, store))

    def student_at_init(self, hybrid: HybridConfig):
        return build_student(
            self.teacher,
            self.head_map,
            hybrid,
            rngs=nnx.Rngs(self.base_run.seed),
            calibration_ids=jax.numpy.asarray(self.calibration_ids),
        )

    def measure(self, name: str, student) -> dict:
        """{ppl, kl, top1, teacher_ppl} of ``student`` on the held-out windows (the evaluation suite's numbers)."""
        from hydrahead_jax.evaluation.models import EvalModel
        from hydrahead_jax.evaluation.report import aggregate
        from hydrahead_jax.evaluation.suite import Suite

        models = [EvalModel(name, student, self.tokenizer, "hydrahead")]
        if self.teacher_ppl is None:
            models.insert(0, self.teacher_model)
        suite = Suite(models, self.settings, teacher=self.teacher_model).run(progress=False)
        values = {(r["model"], r["metric"]): r["value"] for r in aggregate(suite)}
        if self.teacher_ppl is None:
            self.teacher_ppl = values[("teacher", "perplexity")]
        return {
            "ppl": values[(name, "perplexity")],
            "kl": values[(name, "kl")],
            "top1": values[(name, "top1")],
            "teacher_ppl": self.teacher_ppl,
        }

    def after_stage1(self, name: str, hybrid: dict, stage1: dict) -> tuple[dict, float]:
        """Stage 1 of the recipe with ``hybrid`` for ``stage1['steps']`` steps in OUT/runs/<name> (resumed or
        reused when already there); the metrics of the student it ends with, and the stage's wall time."""
        from hydrahead_jax.training import sharding as shd
        from hydrahead_jax.training.pipeline import final_state_before, run_pipeline
        from hydrahead_jax.training.steps import cast_like

        run = run_config(self.recipe, hybrid, head_map_path=self.head_map_path, stage1=stage1)
        workdir = self.out / "runs" / name
        start = time.perf_counter()
        run_pipeline(run, workdir, until_stage="align")
        seconds = time.perf_counter() - start
        abstract = nnx.eval_shape(lambda: build_model(self.cfg, self.head_map, run.hybrid, nnx.Rngs(run.seed)))
        graphdef, abstract_state = nnx.split(abstract)
        mesh = shd.make_mesh(run.mesh.data, run.mesh.fsdp, run.mesh.tensor, sequence=run.mesh.sequence)
        state = final_state_before(workdir, 1, abstract_state, mesh)  # the final state of stage 1 (the stage before 2)
        student = nnx.merge(graphdef, cast_like(state, nnx.as_pure(abstract_state)))
        return self.measure(name, student), seconds


# ------------------------------------------------------------------------------------------ report
def render_markdown(result: dict) -> str:
    s = result["settings"]
    stage1 = s.get("stage1")
    lines = [
        "# Initialisation study",
        "",
        f"Teacher {s['teacher']}, head map {s['head_map']} ({s['fa_groups']} of {s['kv_groups']} KV groups FA); "
        f"held-out news, {s['rows']} windows × {s['length']} tokens; calibration batch {s['calibration_shape']}.",
        f"Teacher perplexity {result['teacher_ppl'] or float('nan'):.1f}. Load average at start {s['load_start']}, "
        f"at end {s.get('load_end')}.",
        "",
    ]
    header = ["variant", "HybridConfig changes", "ppl at init", "KL at init", "top-1 at init"]
    if stage1:
        header += ["ppl after stage 1", "KL after stage 1", "top-1 after stage 1", "stage 1 s"]
        lines.insert(
            4,
            f"Stage 1: {stage1['steps']} steps × {stage1['batch_size']} × {stage1['seq_len']} tokens, "
            "the recipe's other stage-1 settings.",
        )
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in result["variants"].items():
        changes = ", ".join(f"{k}={v}" for k, v in row["hybrid"].items()) or "(the recipe's)"
        cells = [name, changes, *_metric_cells(row.get("at_init"))]
        if stage1:
            after = row.get("after_stage1")
            cells += _metric_cells(after) + [f"{row['stage1_seconds']:.0f}" if after else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "KL = KL(teacher ‖ student) in nats/token; top-1 = agreement of the argmax with the teacher's."]
    return "\n".join(lines) + "\n"


def _metric_cells(m: dict | None) -> list[str]:
    if not m:
        return ["–"] * 3
    ppl = m["ppl"]
    return [f"{ppl:,.1f}" if ppl < 1e4 else f"{ppl:,.0f}", f"{m['kl']:.3f}", f"{100 * m['top1']:.1f} %"]


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hydrahead_jax.experiments.init_study", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", default="configs/smollm2_hydrahead.py", help="training recipe (teacher, data, stage 1)")
    p.add_argument("--out", default="runs/init_study", help="output folder")
    p.add_argument("--head-map", default=None, help="head_map.json to use (default: the recipe's stage 0)")
    p.add_argument("--variant", action="append", default=[], help="NAME:FIELD=VALUE,... (HybridConfig fields)")
    p.add_argument("--no-defaults", action="store_true", help="measure only the --variant list")
    p.add_argument("--only", default=None, help="comma-separated names: measure only these variants")
    p.add_argument("--rows", type=int, default=4, help="held-out news windows")
    p.add_argument("--length", type=int, default=512, help="tokens per window")
    p.add_argument("--stage1-steps", type=int, default=0, help="also run stage 1 for this many steps per variant")
    p.add_argument("--stage1-batch", type=int, default=4)
    p.add_argument("--stage1-seq-len", type=int, default=256)
    args = p.parse_args(argv)
    try:
        return _main(args)
    except (StudyError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _main(args) -> int:
    variants = {} if args.no_defaults else dict(DEFAULT_VARIANTS)
    for text in args.variant:
        name, changes = parse_variant(text)
        variants[name] = changes
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in variants]
        if unknown:
            raise StudyError(f"--only {unknown}: no such variants; the variants are {sorted(variants)}.")
        variants = {n: variants[n] for n in wanted}
    if not variants:
        raise StudyError("no variants to measure: drop --no-defaults or add --variant NAME:FIELD=VALUE.")
    hybrids = {}  # the recipe's hybrid section with each variant's changes, checked before the teacher loads
    for name, changes in variants.items():
        try:
            hybrids[name] = run_config(args.config, changes).hybrid
        except (ConfigError, TypeError) as err:
            raise StudyError(f"variant {name!r}: {err}") from None
    if args.rows < 1 or args.length < 2:
        raise StudyError(f"--rows {args.rows} --length {args.length}: need at least 1 window of at least 2 tokens.")
    if args.stage1_steps < 0:
        raise StudyError(f"--stage1-steps {args.stage1_steps} must be >= 0 (0: at-init only).")
    stage1 = None
    if args.stage1_steps:
        stage1 = {
            "steps": args.stage1_steps,
            "batch_size": args.stage1_batch,
            "seq_len": args.stage1_seq_len,
            "checkpoint_every": args.stage1_steps,
            "warmup_steps": max(1, min(8, args.stage1_steps // 5)),
        }
        for changes in variants.values():  # the stage-1 settings too
            run_config(args.config, changes, stage1=stage1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_start = _load()
    study = Study(args.config, out, args.head_map, args.rows, args.length)
    fa = sum(len(g) for g in study.head_map.fa_groups)
    result = {
        "settings": {
            "config": args.config,
            "teacher": study.base_run.teacher.source,
            "head_map": study.head_map_path,
            "fa_groups": fa,
            "kv_groups": study.cfg.num_layers * study.cfg.num_kv_heads,
            "rows": args.rows,
            "length": args.length,
            "calibration_shape": list(study.calibration_ids.shape),
            "stage1": stage1,
            "load_start": load_start,
        },
        "variants": {},
    }
    json_path = out / "init_study.json"
    previous = _reusable(json_path, result["settings"])

    def write():
        result["teacher_ppl"] = study.teacher_ppl
        json_path.write_text(json.dumps(result, indent=2))
        (out / "init_study.md").write_text(render_markdown(result))

    steps = [(name, "init") for name in variants] + ([(name, "stage1") for name in variants] if stage1 else [])
    bar = tqdm(steps, desc="init study", unit="measurement", dynamic_ncols=True)
    for name, what in bar:
        bar.set_postfix_str(f"{name} {what}")
        changes = variants[name]
        row = result["variants"].setdefault(name, {"hybrid": changes})
        done = previous.get(name, {})
        if done.get("hybrid") == changes and done.get(_key(what)):  # measured by an earlier run of the same study
            row.update({k: v for k, v in done.items() if k.startswith(_key(what)) or k.startswith(what)})
            study.teacher_ppl = study.teacher_ppl or row[_key(what)]["teacher_ppl"]
            tqdm.write(f"[init_study] {name} {what}: reused from {json_path}")
            write()
            continue
        if what == "init":
            start = time.perf_counter()
            student = study.student_at_init(hybrids[name])
            row["at_init"] = study.measure(name, student)
            row["at_init_seconds"] = time.perf_counter() - start
            del student
        else:
            row["after_stage1"], row["stage1_seconds"] = study.after_stage1(name, changes, stage1)
        tqdm.write(f"[init_study] {name} {what}: " + ", ".join(f"{k} {row[_key(what)][k]:.4g}" for k in METRICS))
        write()
    result["settings"]["load_end"] = _load()
    write()
    print(render_markdown(result))
    print(f"wrote {json_path} and {out / 'init_study.md'}")
    return 0


def _reusable(path: Path, settings: dict) -> dict:
    """The variants of an earlier init_study.json in the same folder whose measurements still apply: at-init rows
    when the teacher, head map, held-out windows and calibration batch are the same, stage-1 rows when the stage-1
    settings are the same too (others are dropped)."""
    if not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return {}
    same = ("config", "teacher", "head_map", "rows", "length", "calibration_shape")
    if any(old.get("settings", {}).get(k) != settings[k] for k in same):
        return {}
    keep_stage1 = old["settings"].get("stage1") == settings["stage1"]
    return {
        name: {k: v for k, v in row.items() if keep_stage1 or not k.startswith(("after_stage1", "stage1"))}
        for name, row in old.get("variants", {}).items()
    }


def _key(what: str) -> str:
    return "at_init" if what == "init" else "after_stage1"


if __name__ == "__main__":
    raise SystemExit(main())
