"""Shared helpers of the benchmark scripts: interleaved timing, compiled memory, markdown tables, RESULTS.md rows.

Timing protocol (every script): each variant is compiled and run once (warm-up), then ``repeats`` rounds run
every variant once in turn (interleaved: v1, v2, v3, v1, v2, v3, ...) and the median per variant is reported.
Interleaving makes background load hit all variants alike, so the *ratios* measured in one run stay meaningful
on a shared machine even when absolute times drift.

Memory protocol: ``compiled_bytes`` = argument + output + temp bytes of XLA's ``memory_analysis()`` of the
compiled executable. It is deterministic (no sampling, no allocator noise) and needs only compilation, so it is
reported even where running the variant would take too long or not fit.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
MiB = 1024**2
GiB = 1024**3


# ---------------------------------------------------------------------------------------------- machine info
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def versions() -> str:
    import jax
    import jaxlib

    parts = [f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}"]
    if "torch" in sys.modules:
        parts.append(f"torch {sys.modules['torch'].__version__}")
    return ", ".join(parts)


def machine_line() -> str:
    """One line: CPU model and cores, JAX backend/devices, versions, date, load average (1/5/15 min)."""
    import jax

    dev = jax.devices()[0]
    return (
        f"{cpu_model()}, {os.cpu_count()} cores; backend {dev.platform} ({dev.device_kind}); {versions()}; "
        f"{datetime.datetime.now().isoformat(timespec='minutes')}; load avg {load_average()}"
    )


# ---------------------------------------------------------------------------------------------- measuring
def block(x):
    import jax

    return jax.block_until_ready(x)


def time_interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, *, warmup: bool = True, budget_s: float | None = None
) -> dict[str, float]:
    """Median wall seconds per call of each zero-argument function, rounds interleaved (see module doc).

    Each function must return something ``jax.block_until_ready`` accepts (its result is waited for).
    budget_s: with a warm-up, fewer rounds (at least 1) when ``repeats`` rounds would take longer than this.
    """
    if warmup:
        first = 0.0
        for fn in fns.values():
            t0 = time.perf_counter()
            block(fn())
            first += time.perf_counter() - t0
        if budget_s is not None and first > 0:
            repeats = min(repeats, max(1, int(budget_s / first)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            block(fn())
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def compiled_bytes(jitted, *args) -> int:
    """argument + output + temp bytes of the compiled executable of ``jitted(*args)`` (XLA memory_analysis).

    Aliased (donated) outputs are not counted twice.
    """
    ma = jitted.lower(*args).compile().memory_analysis()
    return int(
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        + ma.temp_size_in_bytes
        - getattr(ma, "alias_size_in_bytes", 0)
    )


def tree_bytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}".lower()
    return any(
        s in text
        for s in ("resource_exhausted", "out of memory", "oom", "memoryerror", "failed to allocate", "bad_alloc")
    )


# ---------------------------------------------------------------------------------------------- reporting
def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "—"
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def goal_line(
    name: str, value: float | None, aim: float, *, unit: str = "x", at_most: bool = False, why_missed: str = ""
) -> str:
    """'NAME = 1.43x (aim <= 1.5x): met' — the measured ratio as it is, beside the aim it is held to, worded the
    same way round (``name`` says which quantity is divided by which; ``at_most``: the aim is an upper bound).
    Never an exception: benchmarks fail only on errors."""
    op = "<=" if at_most else ">="
    if value is None:
        return f"{name}: not measured (aim {op} {aim:g}{unit}){': ' + why_missed if why_missed else ''}"
    met = value <= aim if at_most else value >= aim
    extra = f" — {why_missed}" if not met and why_missed else ""
    return f"{name} = {value:.2f}{unit} (aim {op} {aim:g}{unit}): {'met' if met else 'missed'}{extra}"


def append_results(title: str, body: str, *, settings: str, record: bool = True) -> None:
    """Print the section and, with ``record``, make it bench/RESULTS.md's one section titled ``title`` (with
    machine, versions, date, load and settings): a section of that title is replaced where it stands, else the
    section is added at the end. Earlier figures of the benchmark stay in git history."""
    command = " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    section = (
        f"## {title}\n\n- command: `{command}`\n- machine: {machine_line()}\n- settings: {settings}\n\n"
        f"{body.rstrip()}\n"
    )
    print("\n" + section)
    if not record:
        return
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    RESULTS.write_text(replace_section(text, title, section))


def replace_section(text: str, title: str, section: str) -> str:
    """``text`` (markdown) with its ``## title`` sections replaced by ``section`` (once, where the first stood),
    or with ``section`` added at the end when it has none."""
    parts, kept, placed = text.split("\n## "), [], False
    head, sections = parts[0], parts[1:]
    for part in sections:
        if part.split("\n", 1)[0].strip() == title:
            if not placed:
                kept.append(section[len("## ") :].rstrip("\n") + "\n")
                placed = True
            continue
        kept.append(part)
    if not placed:
        kept.append(section[len("## ") :].rstrip("\n") + "\n")
    return "\n## ".join([head.rstrip("\n") + "\n"] + [k.rstrip("\n") + "\n" for k in kept])
