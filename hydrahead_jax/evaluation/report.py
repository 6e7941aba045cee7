"""Turn a finished suite into results.json (every number with its settings), report.md (models side by side)
and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import math
import platform
import re
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from hydrahead_jax.evaluation import ruler
from hydrahead_jax.evaluation.inputs import DEPTH_GRID_TASKS, RETRIEVAL_TASKS
from hydrahead_jax.evaluation.intervals import bootstrap_interval, wilson_interval

MEMORY_NOTE = (
    "Peak memory is XLA's compiled memory_analysis of the prefill / decode-step executable "
    "(arguments + outputs + temporaries − aliased; parameters included), which holds on every backend. "
    "`device_peak_bytes` is the device allocator's running peak (Device.memory_stats), where the backend "
    "reports one (GPU/TPU, not CPU)."
)


# ------------------------------------------------------------------------------------------------ aggregation


def _text_records(model: str, source: str, length: int, parts: dict, teacher: str | None, beyond) -> list[dict]:
    """Perplexity and agreement records of one (model, held-out source, length) cell from its per-window parts."""
    records: list[dict] = []
    base = {
        "model": model,
        "source": source,
        "length": length,
        "n": len(parts["window"]),
        "windows": list(parts["window"]),
        "seed": None,
        "beyond_train_length": beyond(model, length),
    }
    if parts["nll"]:
        nll = np.concatenate(parts["nll"])
        tail = np.concatenate([x[-max(1, len(x) // 4) :] for x in parts["nll"]])
        records.append(
            {
                **base,
                "task": "ppl",
                "metric": "perplexity",
                "value": float(math.exp(nll.mean())),
                "ppl_tail": float(math.exp(tail.mean())),
                "tokens": int(nll.size),
            }
        )
    if parts["top1"]:
        top1, kl = np.concatenate(parts["top1"]), np.concatenate(parts["kl"])
        # bootstrap over windows (rows), each weighted by its token count
        sizes = [len(x) for x in parts["top1"]]
        row_ci, row_means = {}, {}
        for name in ("top1", "kl"):
            row_means[name] = [float(np.mean(x)) for x in parts[name]]
            ci = bootstrap_interval(row_means[name], sizes)
            row_ci[name] = None if ci is None else list(ci)
        records.append(
            {
                **base,
                "task": "agreement",
                "metric": "top1",
                "value": float(top1.mean()),
                "ci95": row_ci["top1"],
                "window_values": row_means["top1"],  # per window, in window order: for paired comparisons
                "teacher": teacher,
                "positions": int(top1.size),
                "windows": len(sizes),
            }
        )
        records.append(
            {
                **base,
                "task": "agreement",
                "metric": "kl",
                "value": float(kl.mean()),
                "ci95": row_ci["kl"],
                "window_values": row_means["kl"],
                "teacher": teacher,
                "positions": int(kl.size),
                "windows": len(sizes),
                "unit": "nats, KL(teacher || model)",
            }
        )

    return records


def _window_groups(source: str, parts: dict, split: int) -> list[tuple[str, dict]]:
    """With ``split`` > 0, the cell's windows before ``split`` and from it on, each as its own source label
    ("news, windows 0-7"): results of windows some choice was made on, apart from windows it never saw."""
    if split <= 0:
        return []
    groups = []
    for keep in (lambda w: w < split, lambda w: w >= split):
        index = [i for i, w in enumerate(parts["window"]) if keep(w)]
        if not index:
            continue
        sub = {k: [v[i] for i in index] if len(v) == len(parts["window"]) else [] for k, v in parts.items()}
        first, last = sub["window"][0], sub["window"][-1]
        groups.append((f"{source}, windows {first}-{last}", sub))
    return groups


def aggregate(suite) -> list[dict]:
    """One record per number: model, task, metric, value, and the settings that produced it."""
    models = {m.name: m for m in suite.models}
    records: list[dict] = []

    def beyond(name, length):
        tl = models[name].train_length if name in models else None
        return None if tl is None else bool(length > tl)

    cells = defaultdict(list)
    for r in suite.samples:
        depth = r["target_depth"] if r["task"] in DEPTH_GRID_TASKS else None
        cells[(r["model"], r["task"], r["nominal_length"], depth)].append(r)
    for (model, task, length, depth), rs in sorted(
        cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], -1 if kv[0][3] is None else kv[0][3])
    ):
        correct = int(sum(bool(r["correct"]) for r in rs))
        rec = {
            "model": model,
            "task": task,
            "synthetic_task": RETRIEVAL_TASKS[task],
            "metric": "accuracy",
            "value": correct / len(rs),
            "ci95": list(wilson_interval(correct, len(rs))),
            "length": length,
            "n": len(rs),
            "seeds": [r["seed"] for r in rs],
            "depths": [r["depth"] for r in rs],
            "beyond_train_length": beyond(model, length),
            "needle_type": suite.settings.needle_type,
            "decoding": "greedy, through the decode cache",
        }
        nll = [r["answer_nll"] for r in rs if r.get("answer_nll") is not None]
        if len(nll) == len(rs):  # the answer's teacher-forced NLL (tasks.retrieval), mean over the cell's prompts
            rec["answer_nll"] = float(np.mean(nll))
            ci = bootstrap_interval(nll)
            rec["answer_nll_ci95"] = None if ci is None else list(ci)
        if depth is not None:
            rec["depth"] = depth
        records.append(rec)

    teacher = None if suite.teacher is None else suite.teacher.name
    for (model, source, length), parts in sorted(suite.text_parts.items()):
        records += _text_records(model, source, length, parts, teacher, beyond)
        for label, sub in _window_groups(source, parts, suite.settings.window_split):
            records += _text_records(model, label, length, sub, teacher, beyond)

    for e in suite.efficiency:
        base = {
            "model": e["model"],
            "task": "efficiency",
            "length": e["length"],
            "n": 1,
            "seed": suite.settings.seed,
            "batch": 1,
            "cache_len": e["cache_len"],
            "beyond_train_length": beyond(e["model"], e["length"]),
        }
        for metric in (
            "kv_bytes_per_token",
            "state_bytes",
            "total_bytes",
            "prefill_s",
            "decode_s_per_token",
            "prefill_memory_bytes",
            "decode_memory_bytes",
        ):
            extra = {"decode_steps": e["decode_steps"]} if metric == "decode_s_per_token" else {}
            records.append({**base, "metric": metric, "value": e[metric], **extra})
        if e.get("device_peak_bytes") is not None:
            records.append({**base, "metric": "device_peak_bytes", "value": e["device_peak_bytes"]})
    return records


def _environment() -> dict:
    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(dev.device_kind),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def write_outputs(suite, out_dir: str | Path) -> dict:
    """Write results.json, report.md and the plots under ``out_dir``; returns the results dict."""
    out = Path(out_dir)
    records = aggregate(suite)
    results = {
        "settings": suite.settings.to_dict(),
        "models": [
            {"name": m.name, "spec": m.spec, "kind": m.kind, "train_length": m.train_length, **m.info}
            for m in suite.models
        ],
        "teacher": None if suite.teacher is None else suite.teacher.name,
        "results": records,
        "samples": suite.samples,
        "ruler": ruler.aggregate(suite.ruler_samples, {m.name: m.train_length for m in suite.models}),
        "ruler_samples": suite.ruler_samples,
        "skipped": suite.skipped,
        "notes": suite.notes,
        "seconds": [{"model": k[0], "task": k[1], "seconds": v} for k, v in suite.seconds.items()],
        "memory_source": MEMORY_NOTE,
        "environment": _environment(),
    }
    return write_results(results, out)


def write_results(results: dict, out: Path) -> dict:
    """results.json, the plots and report.md of a results dict (a suite's, or ``combine.combine_results``') under
    ``out``; returns ``results``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=_json_default))
    plots = make_plots(results, out)
    (out / "report.md").write_text(render_report(results, plots))
    return results


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")


# ------------------------------------------------------------------------------------------------ tables


def _lookup(records, **match) -> dict:
    return {r["model"]: r for r in records if all(r.get(k) == v for k, v in match.items())}


def _fmt(value, kind: str) -> str:
    if value is None:
        return "–"
    if kind == "pct":
        return f"{100 * value:.0f}%"
    if kind == "bytes":
        for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= div:
                return f"{value / div:.2f} {unit}"
        return f"{int(value)} B"
    if kind == "ms":
        return f"{1000 * value:.1f} ms"
    if kind == "s":
        return f"{value:.2f} s"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


def pooled_accuracy(records: list[dict]) -> dict | None:
    """One accuracy record of several cells' records (NIAH's depths of one length): k = Σ value·n right of
    n = Σ n prompts, with its Wilson interval; None for no records."""
    if not records:
        return None
    n = sum(r["n"] for r in records)
    k = int(round(sum(r["value"] * r["n"] for r in records)))
    return {"value": k / n, "n": n, "ci95": list(wilson_interval(k, n))}


def answer_nll_rows(samples: list[dict], task: str, names: list[str]) -> list[list[str]]:
    """Rows [length, one 'mean [lo–hi]' per model] of the answer NLL of ``task``'s samples, every depth of a
    length pooled (a 95 % percentile bootstrap over prompts); [] when no sample of the task carries one."""
    by_cell = defaultdict(list)
    for r in samples:
        if r["task"] == task and r.get("answer_nll") is not None:
            by_cell[(r["nominal_length"], r["model"])].append(r["answer_nll"])
    rows = []
    for length in sorted({length for length, _ in by_cell}):
        row = [str(length)]
        for name in names:
            values = by_cell.get((length, name))
            ci = bootstrap_interval(values) if values else None
            if ci is not None:
                row.append(f"{np.mean(values):.2f} [{ci[0]:.2f}–{ci[1]:.2f}]")
            elif values:
                row.append(f"{np.mean(values):.2f}")
            else:
                row.append("–")
        rows.append(row)
    return rows


def _fmt_record(record: dict, kind: str) -> str:
    """The value, with its 95 % interval in brackets when the record has one (``ci95``)."""
    text = _fmt(record["value"], kind)
    if record.get("ci95") is None:
        return text
    lo, hi = record["ci95"]
    if kind == "pct":
        return f"{text} [{100 * lo:.0f}–{100 * hi:.0f}]"
    return f"{text} [{_fmt(lo, kind)}–{_fmt(hi, kind)}]"


def _side_by_side(records, names, row_keys, match_fn, kind, label_fn) -> list[str]:
    rows = []
    for key in row_keys:
        found = _lookup(records, **match_fn(key))
        rows.append([label_fn(key)] + [_fmt_record(found[n], kind) if n in found else "–" for n in names])
    return rows


def render_report(results: dict, plots: dict[str, list[str]]) -> str:
    names = [m["name"] for m in results["models"]]
    recs = results["results"]
    s = results["settings"]
    lines = ["# Evaluation report", ""]
    lines += [
        f"Suites: {', '.join(s['suites'])}; seed {s['seed']}; backend {results['environment']['backend']} "
        f"({results['environment']['device']}).",
        "",
    ]
    if results.get("combined_from"):
        lines += ["Combined from finished runs (`eval.py --combine`), each number with the samples of its own run:", ""]
        lines += _table(
            ["run", "lengths", "seed", "RULER samples"],
            [
                [
                    f"`{c['folder']}`",
                    ", ".join(
                        str(n)
                        for n in sorted(
                            {*c["settings"].get("retrieval_lengths", []), *c["settings"].get("ruler_lengths", [])}
                        )
                    ),
                    str(c["settings"]["seed"]),
                    str(c["settings"].get("ruler_samples")),
                ]
                for c in results["combined_from"]
            ],
        )
    lines += ["## Models", ""]
    lines += _table(
        ["model", "kind", "parameters", "FA groups / KV groups", "train length"],
        [
            [
                m["name"],
                m["kind"],
                f"{m['params'] / 1e6:.1f} M",
                f"{m['fa_groups']} / {m['kv_groups']}",
                str(m["train_length"] or "–"),
            ]
            for m in results["models"]
        ],
    )
    beyond = [f"{m['name']} (> {m['train_length']})" for m in results["models"] if m["train_length"]]
    if beyond:
        lines += [
            f"Lengths beyond training, where extrapolation is tested: {', '.join(beyond)}; each record in "
            "results.json carries `beyond_train_length`.",
            "",
        ]

    retrieval = [t for t in RETRIEVAL_TASKS if t in s["suites"]]
    if retrieval:
        lines += [
            "## Long-context retrieval (exact match)",
            "",
            "Greedy decoding through each model's decode cache. Scoring: the generation is cut at EOS and at "
            "its first line, lowercased, whitespace collapsed, trailing punctuation stripped from each word; "
            "numeric answers compare digit strings (the first k numbers), others the first k words.",
            "",
        ]
        for task in retrieval:
            task_recs = [r for r in recs if r["task"] == task]
            if not task_recs:
                continue
            lines += [f"### {task} ({RETRIEVAL_TASKS[task]})", ""]
            if task in DEPTH_GRID_TASKS:
                keys = sorted({(r["length"], r["depth"]) for r in task_recs})
                rows = _side_by_side(
                    task_recs,
                    names,
                    keys,
                    lambda k: {"length": k[0], "depth": k[1]},
                    "pct",
                    lambda k: f"{k[0]} @ depth {k[1]:.2f}",
                )
                for length in sorted({r["length"] for r in task_recs}):  # every depth of a length pooled
                    pooled = {
                        n: pooled_accuracy([r for r in task_recs if r["model"] == n and r["length"] == length])
                        for n in names
                    }
                    rows.append(
                        [f"{length} @ all depths"]
                        + [_fmt_record(pooled[n], "pct") if pooled[n] else "–" for n in names]
                    )
                lines += _table(["length @ depth"] + names, rows)
            else:
                keys = sorted({r["length"] for r in task_recs})
                lines += _table(
                    ["length"] + names, _side_by_side(task_recs, names, keys, lambda k: {"length": k}, "pct", str)
                )
            n = sorted({r["n"] for r in task_recs})
            lines += [f"n = {', '.join(map(str, n))} prompt(s) per cell; Wilson 95 % intervals in brackets.", ""]
            nll_rows = answer_nll_rows(results.get("samples", []), task, names)
            if nll_rows:
                lines += [
                    "Answer NLL: −log p of the answer's tokens given the prompt, teacher-forced, nats per token, "
                    "mean over the length's prompts (every depth) with a 95 % bootstrap interval. Unlike exact "
                    "match it grades a partial read; for a random number needle, a model that sees digits follow "
                    "but not which ones scores about ln 10 = 2.3 per digit.",
                    "",
                ]
                lines += _table(["length"] + names, nll_rows)
        lines += [f"![{p}]({p})" for p in plots.get("retrieval", [])] + [""]

    ppl = [r for r in recs if r["task"] == "ppl"]
    if ppl:
        lines += ["## Perplexity on held-out text", ""]
        keys = sorted({(r["source"], r["length"]) for r in ppl})
        lines += _table(
            ["source @ length"] + names,
            _side_by_side(
                ppl, names, keys, lambda k: {"source": k[0], "length": k[1]}, "num", lambda k: f"{k[0]} @ {k[1]}"
            ),
        )
        lines += [
            "Perplexity = exp(mean next-token NLL over every position of the windows). Last quarter of each "
            "window only:",
            "",
        ]
        tail = [dict(r, value=r["ppl_tail"]) for r in ppl]
        lines += _table(
            ["source @ length"] + names,
            _side_by_side(
                tail, names, keys, lambda k: {"source": k[0], "length": k[1]}, "num", lambda k: f"{k[0]} @ {k[1]}"
            ),
        )
        lines += [f"![{p}]({p})" for p in plots.get("ppl", [])] + [""]

    agree = [r for r in recs if r["task"] == "agreement"]
    if agree:
        lines += [
            f"## Agreement with the teacher ({results['teacher']})",
            "",
            "Means over every position of the held-out windows; in brackets a 95 % bootstrap interval over windows "
            "(rows, weighted by their tokens), none where a source has a single window.",
            "",
        ]
        keys = sorted({(r["source"], r["length"]) for r in agree})
        for metric, kind, title in (("top1", "pct", "top-1 match"), ("kl", "num", "KL(teacher ‖ model), nats")):
            sub = [r for r in agree if r["metric"] == metric]
            lines += [f"{title}:", ""]
            lines += _table(
                ["source @ length"] + names,
                _side_by_side(
                    sub, names, keys, lambda k: {"source": k[0], "length": k[1]}, kind, lambda k: f"{k[0]} @ {k[1]}"
                ),
            )
    elif "agreement" in s["suites"]:
        lines += [
            "## Agreement with the teacher",
            "",
            "Not computed: no teacher among the models (pass "
            "--model teacher:<source> or --teacher <source>), or no model shares its tokenizer.",
            "",
        ]

    eff = [r for r in recs if r["task"] == "efficiency"]
    if eff:
        lines += ["## Efficiency (batch 1)", "", MEMORY_NOTE, ""]
        keys = sorted({r["length"] for r in eff})
        for metric, kind, title in (
            ("kv_bytes_per_token", "bytes", "KV cache bytes per token"),
            ("state_bytes", "bytes", "constant state bytes (GDN state + conv)"),
            ("total_bytes", "bytes", "decode cache at this context"),
            ("prefill_s", "s", "prefill time"),
            ("decode_s_per_token", "ms", "decode time per token (median)"),
            ("prefill_memory_bytes", "bytes", "peak memory, prefill (compiled)"),
            ("decode_memory_bytes", "bytes", "peak memory, decode step (compiled)"),
            ("device_peak_bytes", "bytes", "device allocator peak"),
        ):
            sub = [r for r in eff if r["metric"] == metric]
            if not sub:
                continue
            lines += [f"{title}:", ""]
            lines += _table(["context"] + names, _side_by_side(sub, names, keys, lambda k: {"length": k}, kind, str))
        lines += [f"![{p}]({p})" for p in plots.get("efficiency", [])] + [""]

    lines += ruler.render(results.get("ruler", []), names, plots.get("ruler", []))
    if results["skipped"] or results["notes"]:
        lines += ["## Skipped", ""]
        lines += _table(
            ["model", "task", "source", "length", "reason"],
            [[x["model"], x["task"], x.get("source") or "", str(x["length"]), x["reason"]] for x in results["skipped"]],
        )
        for n in results["notes"]:
            lines += [f"- {n['model']} {n['source']} @ {n['length']}: {n['note']}"]
        lines += [""]
    lines += ["## Time spent", ""]
    lines += _table(
        ["model", "task", "seconds"], [[x["model"], x["task"], f"{x['seconds']:.1f}"] for x in results["seconds"]]
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ plots


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "model"


def _style(results, name):
    kind = next(m["kind"] for m in results["models"] if m["name"] == name)
    return {"linestyle": "--", "color": "black"} if kind == "teacher" else {"linestyle": "-"}


def make_plots(results: dict, out: Path) -> dict[str, list[str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = results["results"]
    names = [m["name"] for m in results["models"]]
    made: dict[str, list[str]] = defaultdict(list)
    train_lengths = {m["name"]: m["train_length"] for m in results["models"] if m["train_length"]}

    def save(fig, file, group):
        fig.tight_layout()
        fig.savefig(out / file, dpi=110)
        plt.close(fig)
        made[group].append(file)

    def mark_train(ax):
        for tl in sorted(set(train_lengths.values())):
            ax.axvline(tl, color="gray", linestyle=":", linewidth=1)

    # NIAH heatmaps: one per model, depth × length
    for task in DEPTH_GRID_TASKS:
        task_recs = [r for r in recs if r["task"] == task]
        if not task_recs:
            continue
        lengths = sorted({r["length"] for r in task_recs})
        depths = sorted({r["depth"] for r in task_recs})
        for name in names:
            grid = np.full((len(depths), len(lengths)), np.nan)
            for r in task_recs:
                if r["model"] == name:
                    grid[depths.index(r["depth"]), lengths.index(r["length"])] = r["value"]
            fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
            cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgray")
            im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("needle depth")
            ax.set_title(f"{task} accuracy: {name}", fontsize=9)
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    ax.text(
                        j,
                        i,
                        "skip" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                    )
            fig.colorbar(im, ax=ax)
            save(fig, f"{task}_heatmap_{_safe(name)}.png", "retrieval")

    # retrieval accuracy against length (NIAH averaged over depth)
    tasks_present = [t for t in RETRIEVAL_TASKS if any(r["task"] == t for r in recs)]
    if tasks_present:
        fig, axes = plt.subplots(1, len(tasks_present), figsize=(4 * len(tasks_present), 3.2), squeeze=False)
        for ax, task in zip(axes[0], tasks_present):
            for name in names:
                by_len = defaultdict(list)
                for r in recs:
                    if r["task"] == task and r["model"] == name:
                        by_len[r["length"]].append((r["value"], r["n"]))
                if by_len:
                    xs = sorted(by_len)
                    ys = [sum(v * n for v, n in by_len[x]) / sum(n for _, n in by_len[x]) for x in xs]
                    ax.plot(xs, ys, marker="o", label=name, **_style(results, name))
            mark_train(ax)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.05, 1.05)
            ax.set_title(task)
            ax.set_xlabel("context length")
            ax.set_ylabel("accuracy")
        axes[0][0].legend(fontsize=7)
        save(fig, "retrieval_vs_length.png", "retrieval")

    ppl = [r for r in recs if r["task"] == "ppl"]
    if ppl:
        sources = sorted({r["source"] for r in ppl})
        fig, axes = plt.subplots(1, len(sources), figsize=(4 * len(sources), 3.2), squeeze=False)
        for ax, source in zip(axes[0], sources):
            for name in names:
                pts = sorted((r["length"], r["value"]) for r in ppl if r["model"] == name and r["source"] == source)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name, **_style(results, name))
            mark_train(ax)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"perplexity: {source}")
            ax.set_xlabel("window length")
        axes[0][0].legend(fontsize=7)
        save(fig, "perplexity_vs_length.png", "ppl")

    eff = [r for r in recs if r["task"] == "efficiency"]
    if eff:
        panels = [
            ("total_bytes", "decode cache (MiB)", 2**20),
            ("prefill_s", "prefill time (s)", 1),
            ("decode_s_per_token", "decode time per token (ms)", 1e-3),
            ("prefill_memory_bytes", "peak memory, prefill (MiB)", 2**20),
        ]
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
        for ax, (metric, title, div) in zip(axes[0], panels):
            for name in names:
                pts = sorted(
                    (r["length"], r["value"] / div)
                    for r in eff
                    if r["model"] == name and r["metric"] == metric and r["value"] is not None
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name, **_style(results, name))
            ax.set_xscale("log", base=2)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("context length")
        axes[0][0].legend(fontsize=7)
        save(fig, "efficiency_vs_length.png", "efficiency")
    made["ruler"] = ruler.plot(results.get("ruler", []), names, out, lambda name: _style(results, name), train_lengths)
    return dict(made)
