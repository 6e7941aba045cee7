"""Shared parts of the GPU check (bench/gpu_check.sh): run modes, the time budget, error metrics, timing, reports.

Each part (gpu_check_flash_attention.py, gpu_check_gated_delta.py, gpu_check_end_to_end.py) fills a ``Report``
with correctness rows and benchmark rows, rewriting ``<kernel>.json`` and ``<kernel>.md`` in the output folder after every row (a
script killed at its deadline keeps what it measured); then

    python bench/_gpu_check.py summarize --out DIR --status flash_attention=0 --status gated_delta=0 \
        --status end_to_end=0

prints the one-line verdict first, then every report, writes ``DIR/gpu_check.md`` (ready to paste into
bench/RESULTS.md) and ``DIR/gpu_check.json``, and exits 1 if any check failed or a script crashed, 2 if nothing
failed but some checks did not run (time budget), 0 otherwise.

Correctness protocol (both kernels): Frobenius-relative error ``‖got − want‖ / ‖want‖`` of the output and of
every gradient against an fp32 oracle (the pure-JAX reference at HIGHEST matmul precision).
- float32 inputs: error ≤ ``F32_TOLERANCE``. Triton runs fp32 dots as TF32 unless told otherwise (10-bit mantissa,
  unit roundoff 2⁻¹¹ ≈ 4.9e-4): outputs then carry errors of a few 1e-4 and gradients, where the backward subtracts
  nearly equal terms (dP − rowsum(dO·O) in attention, the WY correction in the delta rule), a few 1e-3. A wrong
  mask, scale, offset, decay or block edge gives errors of order 1e-1 and fails.
- bfloat16 inputs: error ≤ ``BF16_FACTOR`` × the error of the reference itself run on the same bf16 inputs, against
  the same oracle (the reference computes in fp32, so its error is what bf16 storage alone costs): the kernel may
  lose at most as much again. Each kernel script takes its oracle's inputs as its unit tests do (flash attention:
  the bf16-rounded inputs in fp32; gated delta: the fp32 inputs before rounding).

Timing protocol: every variant of a row is compiled and run once, then ``_common.time_interleaved`` runs bounded
interleaved rounds (at most ``repeats``, fewer when they would exceed the row's seconds) and reports the median.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import block, machine_line, markdown_table, time_interleaved  # noqa: E402

MODES = ("full", "quick", "dry-run")
F32_TOLERANCE = 1e-2
BF16_FACTOR = 2.0
KERNELS = ("flash_attention", "gated_delta", "end_to_end")  # the parts, in the order they run and are reported
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- arguments, budget
def parse_args(description: str, argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--mode", choices=MODES, default="full", help="full (GPU), quick (GPU, fewer rows), dry-run (CPU)")
    ap.add_argument("--deadline", type=float, default=None, help="Unix time by which to stop (skip what is left)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default $OUT or bench/results/gpu)")
    args = ap.parse_args(argv)
    if args.deadline is None:
        args.deadline = time.time() + {"full": 240, "quick": 90, "dry-run": 60}[args.mode]
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results" / "gpu")
    return args


@dataclass
class Budget:
    """Wall-clock budget of one script: work that would start after ``deadline`` is skipped with a note."""

    deadline: float

    def left(self) -> float:
        return self.deadline - time.time()

    def allows(self, needed_s: float) -> bool:
        return self.left() >= needed_s


def budgeted_rows(report: Report, budget: Budget, rows: Sequence, *, min_row_s: float) -> Iterator:
    """Yield ``rows`` in order while the budget allows a row as long as the longest so far (and ``min_row_s``);
    each row that does not fit is skipped with a note."""
    longest = 0.0
    for row in rows:
        need = max(min_row_s, 1.2 * longest)
        if not budget.allows(need):
            report.note(f"row {row} skipped: time budget ({budget.left():.0f} s left, ~{need:.0f} s needed)")
            continue
        started = time.time()
        yield row
        longest = max(longest, time.time() - started)


def check_platform(mode: str) -> str:
    """The JAX backend, refusing a GPU-mode run without a GPU (the message names the fix)."""
    import jax

    backend = jax.default_backend()
    if mode != "dry-run" and backend != "gpu":
        raise SystemExit(
            f"no GPU visible to JAX (backend {backend!r}, devices {jax.devices()}): run bench/gpu_check.sh on the "
            "GPU machine (it installs jax with CUDA), or use --dry-run for the CPU smoke run"
        )
    return backend


# ---------------------------------------------------------------------------------------------- errors
def rel_err(got, want) -> float:
    """‖got − want‖_F / ‖want‖_F in float64 (0 when both are zero)."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    den = float(np.linalg.norm(want))
    num = float(np.linalg.norm(got - want))
    return num / den if den > 0 else num


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


# ---------------------------------------------------------------------------------------------- the report
@dataclass
class Report:
    """Correctness rows, benchmark rows and notes of one part's check; ``write`` stores them as JSON + Markdown.
    ``table``: how its rows are shown (``TABLES``): "kernel" (a kernel against its peers) or "end_to_end"."""

    kernel: str
    mode: str
    out: Path
    table: str = "kernel"
    checks: list[dict] = field(default_factory=list)
    bench: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.notes.append(text)
        self.write()

    # -- correctness
    def check(
        self,
        case: str,
        dtype: str,
        names: Sequence[str],
        got: Sequence,
        oracle: Sequence,
        baseline: Sequence | None = None,
        f32_limit: float = F32_TOLERANCE,
    ) -> bool:
        """Record one row: ``got`` vs ``oracle`` per name; bf16 rows are limited by ``baseline``'s own error, the
        others by ``f32_limit``."""
        errors, limits = {}, {}
        for name, g, o, b in zip(names, got, oracle, baseline or [None] * len(names)):
            errors[name] = rel_err(g, o)
            limits[name] = f32_limit if b is None else BF16_FACTOR * rel_err(b, o)
        bad = [n for n in names if not (math.isfinite(errors[n]) and errors[n] <= limits[n])]
        row = dict(case=case, dtype=dtype, status="fail" if bad else "ok", errors=errors, limits=limits, bad=bad)
        self._add_check(row)
        return not bad

    def check_error(self, case: str, dtype: str, err: BaseException) -> None:
        """A check that raised (lowering/compile/runtime error): a failure, with the error's first line."""
        row = dict(case=case, dtype=dtype, status="fail", error=first_line(err), bad=["raised"])
        traceback.print_exception(err, limit=-3)
        self._add_check(row)

    def check_skipped(self, case: str, dtype: str, reason: str) -> None:
        self._add_check(dict(case=case, dtype=dtype, status="not run", error=reason, bad=[]))

    def _add_check(self, row: dict) -> None:
        """Print the row and rewrite the report files: a run killed at its deadline keeps every row so far."""
        self.checks.append(row)
        if "errors" in row:
            detail = "  ".join(f"{n} {e:.1e}/{row['limits'][n]:.1e}" for n, e in row["errors"].items())
        else:
            detail = row["error"]
        print(f"[{row['status']:>7}] {row['case']} {row['dtype']}: {detail}", flush=True)
        self.write()

    # -- speed
    def bench_row(self, **row) -> None:
        self.bench.append(row)
        print(f"[  bench] {TABLES[self.table].line(row)}", flush=True)
        self.write()

    def failures(self) -> list[str]:
        return [f"{c['case']} {c['dtype']} ({', '.join(c['bad'])})" for c in self.checks if c["status"] == "fail"]

    def not_run(self) -> list[str]:
        return [f"{c['case']} {c['dtype']}" for c in self.checks if c["status"] == "not run"]

    # -- files
    def markdown(self) -> str:
        return _report_markdown(asdict(self))

    def write(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        ignore = self.out / ".gitignore"  # results are pasted into bench/RESULTS.md by hand, never committed here
        # Only inside this checkout: a folder elsewhere (a device machine's $OUT, which sends back a few files)
        # gets the reports alone.
        if self.out.resolve().is_relative_to(REPO) and not ignore.exists():
            ignore.write_text("*\n")
        path = self.out / f"{self.kernel}.json"
        path.write_text(json.dumps(asdict(self), indent=1, default=str))
        (self.out / f"{self.kernel}.md").write_text(self.markdown())
        return path


def _report_markdown(rep: dict) -> str:
    table = TABLES[rep.get("table", "kernel")]
    lines = [f"### {rep['kernel']} ({rep['mode']})", ""]
    if rep["info"]:
        lines += ["- " + ", ".join(f"{k}: {v}" for k, v in rep["info"].items()), ""]
    if rep["checks"]:
        lines += [table.correctness, ""]
        rows = []
        for c in rep["checks"]:
            if "errors" in c:
                detail = ", ".join(
                    (f"**{n} {e:.1e}/{c['limits'][n]:.1e}**" if n in c["bad"] else f"{n} {e:.1e}/{c['limits'][n]:.1e}")
                    for n, e in c["errors"].items()
                )
            else:
                detail = c["error"]
            rows.append([c["case"], c["dtype"], c["status"], detail])
        lines += [markdown_table(["case", "dtype", "status", "error / limit"], rows), ""]
    if rep["bench"]:
        lines += [table.speed, "", table.markdown(rep["bench"]), ""]
    if rep["notes"]:
        lines += ["Notes:", ""] + [f"- {n}" for n in rep["notes"]] + [""]
    return "\n".join(lines)


def bench_line(row: dict) -> str:
    """One kernel benchmark row as printed while the check runs."""
    t = row.get("ms")
    shown = f"{t:.3f} ms, {row['tflops']:.1f} TFLOP/s" if t is not None else row.get("error", "skipped")
    return f"D={row['D']} T={row['T']} {row['direction']:<7} {row['impl']:<10} {shown}"


def bench_markdown(rows: list[dict]) -> str:
    """One line per (D, T, direction): each implementation's ms and TFLOP/s, then Pallas's speed-up over each peer.

    Speed-up = peer time / Pallas time, both measured in the same process, interleaved (> 1: Pallas is faster).
    """
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    peers = [i for i in impls if i != "pallas"]
    keys = list(dict.fromkeys((r["D"], r["T"], r["B"], r["H"], r["direction"]) for r in rows))
    by = {(r["D"], r["T"], r["B"], r["H"], r["direction"], r["impl"]): r for r in rows}
    header = ["D", "T", "B", "H", "pass"] + [f"{i} ms (TFLOP/s)" for i in impls] + [f"pallas vs {p}" for p in peers]
    table = []
    for key in sorted(keys, key=lambda k: (k[0], k[1], k[4] != "fwd")):
        cells = list(key)
        for impl in impls:
            r = by.get((*key, impl))
            cells.append("—" if r is None or r.get("ms") is None else f"{r['ms']:.2f} ({r['tflops']:.0f})")
        mine = by.get((*key, "pallas"))
        for p in peers:
            r = by.get((*key, p))
            ok = mine and r and mine.get("ms") and r.get("ms")
            cells.append(f"{r['ms'] / mine['ms']:.2f}x" if ok else "—")
        table.append(cells)
    return markdown_table(header, table)


def stage_line(row: dict) -> str:
    """One end-to-end stage row (bench/gpu_check_end_to_end.py) as printed while the check runs."""
    mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.2f} %"
    return (
        f"{row['model']} {row['stage']}: {row['ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, "
        f"{row['tflops']:.3f} TFLOP/s, MFU {mfu} (first step {row['first_step_s']:.1f} s)"
    )


def stage_markdown(rows: list[dict]) -> str:
    """One line per (model, stage) of the end-to-end device run."""
    table = []
    for r in rows:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.2f} %"
        table.append(
            [r["model"], r["stage"], f"{r['B']}x{r['T']}", r["dtype"], f"{r['ms']:.1f}", f"{r['tokens_per_s']:,.0f}"]
            + [f"{r['flops_per_token'] / 1e6:.2f}", f"{r['tflops']:.3f}", mfu, f"{r['first_step_s']:.1f}"]
        )
    header = ["model", "stage", "BxT", "dtype", "ms/step", "tokens/s", "MFLOP/token", "TFLOP/s", "MFU", "first step s"]
    return markdown_table(header, table)


@dataclass(frozen=True)
class Table:
    """How a part's report is shown: the sentences above its two tables, a printed line and the speed table."""

    correctness: str
    speed: str
    line: Callable[[dict], str]
    markdown: Callable[[list[dict]], str]


TABLES = {
    "kernel": Table(
        correctness=(
            "Correctness: Frobenius-relative error vs the fp32 reference (error / limit; fp32 limit "
            f"{F32_TOLERANCE:g}, bf16 limit {BF16_FACTOR:g}x the reference's own bf16 error)."
        ),
        speed=(
            "Speed: median ms per call (TFLOP/s, FLOPs as stated in the script's docstring); "
            "pallas vs X = X's time / Pallas's time, measured interleaved in this run (> 1: Pallas is faster)."
        ),
        line=bench_line,
        markdown=bench_markdown,
    ),
    "end_to_end": Table(
        correctness=(
            "Correctness: per stage, Frobenius-relative error of the per-step loss and gradient-norm curves vs the "
            f"CPU float32 XLA run of the same recipe (error / limit; bf16 limit {BF16_FACTOR:g}x the CPU bfloat16 XLA "
            "run's own error, fp32 limit as stated in bench/gpu_check_end_to_end.py)."
        ),
        speed=(
            "Speed of the device run: median ms per step from step 3 on, tokens/s, model FLOPs per token and MFU "
            "against the device's dense bf16 peak (formulas in bench/gpu_check_end_to_end.py); first step = "
            "compile + one step."
        ),
        line=stage_line,
        markdown=stage_markdown,
    ),
}


# ---------------------------------------------------------------------------------------------- timing
def time_variants(
    report: Report,
    variants: dict[str, Callable[[], object]],
    *,
    flops: float,
    row: dict,
    repeats: int,
    seconds: float,
) -> None:
    """Compile + warm each variant (a failure is recorded for that variant only), then time the rest interleaved.

    Each zero-argument callable must block until its work is done (JAX results are waited for by the caller).
    """
    ready = {}
    for name, fn in variants.items():
        try:
            block(fn())  # compile, autotune, first run
            ready[name] = fn
        except Exception as e:  # a peer or kernel that cannot run this shape: recorded, the others go on
            report.bench_row(**row, impl=name, ms=None, tflops=None, error=first_line(e))
    if not ready:
        return
    try:
        medians = time_interleaved(ready, repeats, warmup=True, budget_s=seconds)
    except Exception as e:  # e.g. out of memory once several variants hold buffers: the row is lost, not the run
        for name in ready:
            report.bench_row(**row, impl=name, ms=None, tflops=None, error=f"timing failed: {first_line(e)}")
        return
    for name, t in medians.items():
        report.bench_row(**row, impl=name, ms=t * 1e3, tflops=flops / t / 1e12)


# ---------------------------------------------------------------------------------------------- a kernel script
def run_script(
    kernel: str, description: str, argv, steps: Callable[[Report, Budget, str, bool], None], table: str = "kernel"
) -> int:
    """Parse the common arguments, run ``steps(report, budget, mode, on_gpu)``, write the report whatever happens.

    Returns 0 when every check passed, 1 when one failed, 3 when the steps raised (what was measured is kept).
    """
    import jax

    args = parse_args(description, argv)
    budget = Budget(args.deadline)
    on_gpu = check_platform(args.mode) == "gpu"
    dev = jax.devices()[0]
    info = dict(jax=jax.__version__, device=f"{dev.platform} ({dev.device_kind})")
    report = Report(kernel, args.mode, args.out, table=table, info=info)
    print(f"{kernel} GPU check, mode {args.mode}, {budget.left():.0f} s budget", flush=True)
    try:
        steps(report, budget, args.mode, on_gpu)
    except Exception as e:  # an error outside the guarded steps: keep what was measured, report the crash
        traceback.print_exc()
        report.note(f"script error: {first_line(e)}")
        report.write()
        return 3
    report.write()
    failures = report.failures()
    print(f"{kernel}: {len(failures)} failed checks" + (": " + "; ".join(failures) if failures else ""), flush=True)
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------- summary
def summarize(out: Path, status: dict[str, int]) -> int:
    """Print the verdict line first, then each kernel's report; write gpu_check.md/.json; return the exit code."""
    reports, problems, not_run = {}, [], []
    for kernel in KERNELS:
        path = out / f"{kernel}.json"
        rc = status.get(kernel)
        rep = json.loads(path.read_text()) if path.exists() else None
        if rep is not None and rc in (None, 0, 1):
            reports[kernel] = rep
        if rc is not None and rc not in (0, 1):
            problems.append(f"{kernel}: script exited {rc}" + (" (timed out)" if rc in (124, 137) else ""))
        if rep is None and rc is not None:
            problems.append(f"{kernel}: no report written")
        if rep is not None:
            problems += [f"{kernel} {c['case']} {c['dtype']}" for c in rep["checks"] if c["status"] == "fail"]
            not_run += [f"{kernel} {c['case']} {c['dtype']}" for c in rep["checks"] if c["status"] == "not run"]
    if problems:
        verdict = f"GPU CHECK FAILED ({len(problems)}): " + "; ".join(problems)
        code = 1
    elif not_run:
        verdict = f"GPU CHECK INCOMPLETE: {len(not_run)} checks not run (time budget): " + "; ".join(not_run)
        code = 2
    else:
        n = sum(len(r["checks"]) for r in reports.values())
        verdict = f"GPU CHECK PASSED: {n} checks of {', '.join(reports)}"
        code = 0
    body = "\n".join(_report_markdown(r) for r in reports.values())
    text = f"## GPU check\n\n{verdict}\n\n- machine: {machine_line()}\n\n{body}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text(text)
    (out / "gpu_check.json").write_text(json.dumps(dict(verdict=verdict, status=status, reports=reports), indent=1))
    print(verdict)
    print()
    print(body)
    print(f"written: {out / 'gpu_check.md'}, {out / 'gpu_check.json'}")
    print(verdict)
    return code


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Combine the kernel reports of bench/gpu_check.sh.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--status", action="append", default=[], help="KERNEL=EXIT_CODE of each script that ran")
    args = ap.parse_args(argv)
    status = {}
    for item in args.status:
        kernel, _, rc = item.partition("=")
        if kernel not in KERNELS or not rc.lstrip("-").isdigit():
            ap.error(f"--status takes KERNEL=EXIT_CODE with KERNEL in {KERNELS}; got {item!r}")
        status[kernel] = int(rc)
    return summarize(args.out, status)


if __name__ == "__main__":
    sys.exit(main())
