"""Command line of eval.py. Every setting is checked, and every model loaded, before the suite starts."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from hydrahead_jax.evaluation.combine import combine_results
from hydrahead_jax.evaluation.journal import JournalError
from hydrahead_jax.evaluation.models import ModelSpecError, load_model, load_models
from hydrahead_jax.evaluation.report import write_outputs, write_results
from hydrahead_jax.evaluation.suite import Settings, Suite, SuiteError, parse_lengths, parse_suite
from hydrahead_jax.storage import is_object_store, local_mirror

DEFAULT_SUITE = "niah,passkey,multikey,kv,ppl,agreement,efficiency"
# lm-evaluation-harness tasks (``--tasks``), run in-process by ``evaluation.harness``; beside our suites, not one of them.
LM_EVAL_SUITE = "lm-eval"


def parse_bytes(text: str) -> int:
    """'8GB' / '512MiB' / '1e9' → bytes (K/M/G/T powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kmgt]?)i?b?\s*", str(text).lower())
    if not m:
        raise SuiteError(f"cannot read memory size {text!r}; write e.g. 8GB, 512MB or a byte count.")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eval.py", description="Evaluate HydraHead models and their teacher on the same seeded inputs."
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="SPEC",
        help="a model to evaluate (repeatable): an exported folder (runs/x/final), teacher:<source> "
        "(smollm2-135m, a .gguf or an HF folder), an HF folder or .gguf; LABEL=SPEC names it",
    )
    p.add_argument(
        "--teacher",
        metavar="SOURCE",
        help="reference for agreement when no teacher:<source> model is given (loaded, not evaluated)",
    )
    p.add_argument(
        "--suite", default=None, help=f"comma list of suites or a preset (all, demo); default {DEFAULT_SUITE}"
    )
    p.add_argument(
        "--lengths",
        default=None,
        help="retrieval context lengths, e.g. 1k,2k,4k,8k,16k,32k (also the ppl/efficiency lengths unless given, "
        "and the RULER lengths, which are otherwise 1k … 128k)",
    )
    p.add_argument("--ppl-lengths", default=None, help="held-out text window lengths")
    p.add_argument("--efficiency-lengths", default=None, help="context lengths of the efficiency measurements")
    p.add_argument("--depths", default=None, help="NIAH needle depths in [0, 1], e.g. 0,0.25,0.5,0.75,1")
    p.add_argument("--samples", type=int, default=None, help="prompts per retrieval cell")
    p.add_argument("--ruler-samples", type=int, default=None, help="prompts per RULER task and length (default 50)")
    p.add_argument("--ppl-windows", type=int, default=None, help="windows per (source, length)")
    p.add_argument(
        "--window-split",
        type=int,
        default=None,
        help="also report perplexity and agreement over windows [0, N) and [N, ppl-windows) apart",
    )
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps per efficiency point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--needle-type", default="number", choices=("number", "word", "uuid"))
    p.add_argument(
        "--memory-limit",
        default=None,
        help="cap on what one computation may add to memory (e.g. 8GB); default: what is free now",
    )
    p.add_argument(
        "--mesh-sequence",
        type=int,
        default=1,
        help="context parallelism: split each prompt's prefill over this many devices (prompt rows over the rest); "
        "decoding continues from the filled cache. Default 1 (one device)",
    )
    p.add_argument("--haystack", default=None, help="text file used as NIAH filler (default: the Wikipedia extract)")
    p.add_argument(
        "--text",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="held-out text source (repeatable); default: corpus validation split and lee_background",
    )
    p.add_argument(
        "--combine",
        action="append",
        metavar="DIR",
        help="instead of --model: one report (tables, plots, results.json) from the --out folders of finished runs "
        "(repeatable; e.g. one run per length), each number with its own run's samples",
    )
    p.add_argument(
        "--tasks",
        default=None,
        help=f"with --suite {LM_EVAL_SUITE}: comma list of lm-evaluation-harness tasks (names or globs), e.g. "
        "hellaswag,wikitext",
    )
    p.add_argument("--include-path", default=None, help="a folder of local lm-eval task YAMLs (lm-eval's own option)")
    p.add_argument(
        "--limit", type=float, default=None, help="lm-eval: at most this many documents per task (< 1: a fraction)"
    )
    p.add_argument("--out", required=True, help="output folder for results.json, report.md and plots")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def split_lm_eval(suite: str | None) -> tuple[str | None, bool]:
    """(the --suite text without ``lm-eval``, None when nothing else is left; whether ``lm-eval`` was named)."""
    names = [n.strip() for n in (suite or DEFAULT_SUITE).split(",") if n.strip()]
    rest = [n for n in names if n != LM_EVAL_SUITE]
    return (",".join(rest) or None), len(rest) < len(names)


def lm_eval_tasks(args, wanted: bool) -> list[str] | None:
    """The --tasks of ``--suite lm-eval`` (None without it), after checking the flags that go with it."""
    if not wanted:
        if args.tasks or args.include_path or args.limit is not None:
            raise SuiteError(f"--tasks, --include-path and --limit are lm-eval's: add {LM_EVAL_SUITE} to --suite.")
        return None
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if not tasks:
        raise SuiteError(f"--suite {LM_EVAL_SUITE} needs --tasks, e.g. --tasks hellaswag,wikitext.")
    if args.include_path and not Path(args.include_path).is_dir():
        raise SuiteError(f"--include-path {args.include_path}: not a folder.")
    if args.limit is not None and args.limit <= 0:
        raise SuiteError(f"--limit must be > 0, got {args.limit}.")
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise SuiteError(
            f"--suite {LM_EVAL_SUITE} needs lm-evaluation-harness: pip install -e '.[eval]' (or lm-eval==0.4.13)."
        )
    return tasks


def settings_from_args(args) -> Settings | None:
    """Our suites' settings, None when --suite names lm-eval alone."""
    suite, _ = split_lm_eval(args.suite)
    if suite is None:
        return None
    suites = parse_suite(suite)
    demo = args.suite is not None and "demo" in [s.strip() for s in args.suite.split(",")]
    lengths = parse_lengths(args.lengths) if args.lengths else None
    depths = None
    if args.depths:
        try:
            depths = tuple(float(x) for x in args.depths.split(",") if x.strip())
        except ValueError:
            raise SuiteError(f"--depths {args.depths!r}: write fractions like 0,0.5,1.") from None
        if not depths or any(not 0 <= d <= 1 for d in depths):
            raise SuiteError(f"--depths {args.depths!r}: every depth must lie in [0, 1].")
    for flag in ("samples", "ruler_samples", "ppl_windows", "window_split", "decode_steps", "mesh_sequence"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SuiteError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    texts = None
    if args.text:
        texts = {}
        for item in args.text:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise SuiteError(f"--text {item!r}: write NAME=PATH.")
            if not Path(path).is_file():
                raise SuiteError(f"--text {item!r}: {path} is not a file.")
            texts[name] = path
    if args.haystack and not Path(args.haystack).is_file():
        raise SuiteError(f"--haystack {args.haystack}: not a file.")
    common = dict(
        suites=suites,
        depths=depths,
        samples=args.samples,
        ruler_samples=args.ruler_samples,
        ruler_lengths=lengths,
        ppl_windows=args.ppl_windows,
        window_split=args.window_split,
        decode_steps=args.decode_steps,
        seed=args.seed,
        needle_type=args.needle_type,
        memory_limit=parse_bytes(args.memory_limit) if args.memory_limit else None,
        mesh_sequence=args.mesh_sequence,
        haystack=args.haystack,
        texts=texts,
    )
    ppl_lengths = parse_lengths(args.ppl_lengths) if args.ppl_lengths else lengths
    eff_lengths = parse_lengths(args.efficiency_lengths) if args.efficiency_lengths else lengths
    if demo:
        settings = Settings.demo(
            retrieval_lengths=lengths, ppl_lengths=ppl_lengths, efficiency_lengths=eff_lengths, **common
        )
    else:
        lengths = lengths or parse_lengths("1k,2k,4k")
        settings = Settings(
            **{k: v for k, v in common.items() if v is not None},
            retrieval_lengths=lengths,
            ppl_lengths=ppl_lengths or lengths,
            efficiency_lengths=eff_lengths or lengths,
        )
    if settings.window_split >= settings.ppl_windows:
        raise SuiteError(
            f"--window-split {settings.window_split} leaves no window after it of --ppl-windows "
            f"{settings.ppl_windows}: give a split below the window count."
        )
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.model) == bool(args.combine):
        parser.error(
            "give --model (models to evaluate) or --combine (finished runs to report together), one of the two, not both"
        )
    if args.combine:
        return combine_runs(args.combine, Path(args.out))
    if is_object_store(args.out):  # the journal grows line by line: written locally, copied to the bucket
        with local_mirror(args.out) as out:
            return evaluate(args, out)
    return evaluate(args, Path(args.out))


def evaluate(args, out: Path) -> int:
    """The evaluation of ``--model`` (resumed from the journal in ``out``), its report written to ``out``."""
    try:
        settings = settings_from_args(args)
        tasks = lm_eval_tasks(args, split_lm_eval(args.suite)[1])
        if out.exists() and not out.is_dir():
            raise SuiteError(f"--out {out} exists and is not a folder.")
        manager = None
        if tasks is not None:  # the tasks are found before any model loads
            from hydrahead_jax.evaluation.harness import HarnessError, task_manager

            try:
                manager = task_manager(tasks, args.include_path)
            except HarnessError as err:
                raise SuiteError(str(err)) from None
        models = load_models(args.model)
        if settings is None:
            return run_lm_eval(models, tasks, out, manager=manager, limit=args.limit)
        teacher = None
        if args.teacher and not any(m.is_teacher for m in models):
            teacher = load_model(f"teacher:{args.teacher}")
        if settings.corpus is None:  # the validation split of the corpus the (first) exported model trained on
            settings.corpus = next((m.info["corpus"] for m in models if m.info.get("corpus")), None)
        suite = Suite(models, settings, teacher=teacher).prepare()
        suite.resume(suite.journal(out))
    except (SuiteError, ModelSpecError, JournalError) as err:
        print(f"eval.py: error: {err}", file=sys.stderr)
        return 2
    if tasks is not None and run_lm_eval(models, tasks, out, manager=manager, limit=args.limit):
        return 2
    suite.run(progress=not args.no_progress)
    write_outputs(suite, out)
    print(
        f"wrote {out / 'report.md'}, {out / 'results.json'} and plots"
        + (f"; {len(suite.skipped)} cell(s) skipped, see the report" if suite.skipped else "")
    )
    return 0


def run_lm_eval(models, tasks: list[str], out: Path, *, manager, limit: float | None) -> int:
    """``--suite lm-eval``: each model's lm-eval results JSON under out/lm_eval/, their tables in out/lm_eval.md."""
    from hydrahead_jax.evaluation.harness import HarnessError, run_suite

    try:
        written = run_suite(models, tasks, out, manager=manager, limit=limit)
    except HarnessError as err:
        print(f"eval.py: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote lm-eval results {', '.join(str(p) for p in written.values())} and {out / 'lm_eval.md'}")
    return 0


def combine_runs(folders: list[str], out: Path) -> int:
    """``--combine``: the finished runs' results joined (``combine.combine_results``) and written under ``out``."""
    try:
        if out.resolve() in {Path(f).resolve() for f in folders}:
            raise SuiteError(f"--out {out} is one of the --combine folders; write the combined report elsewhere.")
        if out.exists() and not out.is_dir():
            raise SuiteError(f"--out {out} exists and is not a folder.")
        results = combine_results(folders)
    except SuiteError as err:
        print(f"eval.py: error: {err}", file=sys.stderr)
        return 2
    write_results(results, out)
    print(f"wrote {out / 'report.md'}, {out / 'results.json'} and plots from {len(folders)} runs")
    return 0
