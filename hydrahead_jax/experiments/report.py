"""The comparison's outputs from its results: results.json, report.md, pareto.png and loss_curves.png.

Grouped variants (the same ``group``, e.g. random selection under three seeds) are reported as mean ± s, with s
the sample standard deviation over the group's members (n − 1 in the denominator; 0 for a single member).

Pareto front over (KV bytes per token x, quality y): a point is on it when no other point is at least as good on
both axes and strictly better on one (x lower is better; y lower for KL, higher for top-1 and retrieval accuracy).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hydrahead_jax.evaluation.intervals import wilson_interval

RETRIEVAL_PREFIXES = ("niah@", "passkey@", "multikey@", "multivalue@", "kv@", "vt@")
# Key prefix of a retrieval cell's mean answer NLL in a variant's flattened suite ("answer_nll:niah@512" beside the
# cell's accuracy "niah@512"): the answer's teacher-forced NLL in nats per token (evaluation.tasks.retrieval).
ANSWER_NLL = "answer_nll:"
# Key prefix of a held-out text metric's per-window values ("windows:kl/news" beside "kl/news"), in window order:
# the same windows for every variant, so two variants' difference is paired window by window.
WINDOWS = "windows:"


def headline(evaluation: dict) -> dict[str, Any]:
    """The quality numbers a variant is ranked by: KL and top-1 on held-out news when the evaluation suite ran,
    else on the held-out data rows; perplexity likewise; retrieval = mean accuracy over the retrieval cells."""
    suite, data = evaluation.get("suite") or {}, evaluation.get("data") or {}
    text = "news" if any(k.endswith("/news") for k in suite) else None
    retrieval = [v for k, v in suite.items() if k.startswith(RETRIEVAL_PREFIXES)]
    return {
        "kl": suite.get("kl/news") if text else data.get("kl"),  # None for the teacher itself
        "top1": suite.get("top1/news") if text else data.get("top1"),
        "ppl": suite.get("ppl/news") if text else data.get("ppl"),
        "retrieval": sum(retrieval) / len(retrieval) if retrieval else None,
        "source": "held-out news (eval suite)" if text else "held-out data rows",
    }


def pareto_front(xs: list[float], ys: list[float], *, maximize: bool) -> list[int]:
    """Indices of the points on the Pareto front (module doc), sorted by x; None values are never on it."""
    sign = -1.0 if maximize else 1.0
    pts = [(i, x, sign * y) for i, (x, y) in enumerate(zip(xs, ys)) if x is not None and y is not None]
    front = []
    for i, x, y in pts:
        dominated = any((x2 <= x and y2 <= y) and (x2 < x or y2 < y) for j, x2, y2 in pts if j != i)
        if not dominated:
            front.append((x, i))
    return [i for _, i in sorted(front)]


def _mean_spread(values: list[float | None]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def summary_rows(results: dict) -> list[dict[str, Any]]:
    """One row per group (a single variant is its own group): every reported number as (mean, spread), n."""
    groups: dict[str, list[dict]] = {}
    for v in results["variants"]:
        groups.setdefault(v["group"], []).append(v)
    rows = []
    for group, members in groups.items():
        per = []
        for v in members:
            final, init = v.get("final") or {}, v.get("at_init") or {}
            h, h0 = headline(final), headline(init)
            per.append(
                {
                    "fa_groups": final.get("fa_groups"),
                    "kv_groups": final.get("kv_groups"),
                    "kv_bytes_per_token": final.get("kv_bytes_per_token"),
                    "init_kl": h0["kl"],
                    "kl": h["kl"],
                    "top1": h["top1"],
                    "ppl": h["ppl"],
                    "retrieval": h["retrieval"],
                    "seconds": sum((v.get("stage_seconds") or {}).values()),
                    "tokens": sum((v.get("stage_tokens") or {}).values()),
                    **{
                        k: val
                        for k, val in (final.get("suite") or {}).items()
                        if k.startswith(RETRIEVAL_PREFIXES + (ANSWER_NLL,))
                    },
                }
            )
        keys = list(dict.fromkeys(k for p in per for k in p))
        row = {"group": group, "members": [v["name"] for v in members], "n": len(members)}
        row.update({k: _mean_spread([p.get(k) for p in per]) for k in keys})
        row["source"] = headline(members[0].get("final") or {})["source"]
        rows.append(row)
    return rows


def prompts_per_cell(key: str, eval_settings: dict) -> int | None:
    """How many prompts a retrieval cell ("niah@512", "passkey@1024", ...) of the comparison averages: NIAH runs
    ``samples`` prompts at each of its ``depths``, the other tasks ``samples`` prompts; None when unknown."""
    samples = eval_settings.get("samples")
    if not samples:
        return None
    return int(samples) * (len(eval_settings.get("depths") or ()) if key.startswith("niah@") else 1) or None


def _fmt_accuracy(value, n: int | None) -> str:
    """A single run's accuracy with its Wilson 95 % interval over its n prompts: "12 % [7, 20]"."""
    if value is None or isinstance(value, tuple) or not n:
        return _fmt(value, percent=True)
    lo, hi = wilson_interval(round(value * n), n)
    return f"{value * 100:.0f} % [{lo * 100:.0f}, {hi * 100:.0f}]"


def _fmt(pair, digits: int = 3, *, percent: bool = False, integer: bool = False) -> str:
    mean, spread = pair if isinstance(pair, tuple) else (pair, None)
    if mean is None:
        return "–"
    scale, unit = (100.0, " %") if percent else (1.0, "")
    text = f"{mean:.0f}" if integer else f"{mean * scale:.{digits}g}"
    if spread:
        text += f" ± {spread * scale:.{digits}g}" if not integer else f" ± {spread:.0f}"
    return text + unit


def render_markdown(results: dict, rows: list[dict], plots: list[str]) -> str:
    teacher = results.get("teacher") or {}
    eval_settings = results.get("eval") or {}
    retrieval_keys = sorted({k for r in rows for k in r if k.startswith(RETRIEVAL_PREFIXES)})
    header = [
        "variant",
        "n",
        "FA groups",
        "KV bytes/token",
        "KL at init",
        "KL final",
        "top-1",
        "ppl",
        *retrieval_keys,
        "time (s)",
        "tokens",
    ]
    lines = [
        "# Equal-budget comparison",
        "",
        f"Workdir `{results['workdir']}`; {len(results['variants'])} variants, {len(rows)} rows "
        "(grouped variants as mean ± sample standard deviation over their n members).",
        "",
        f"KL = KL(teacher ‖ student) in nats/token and top-1 = agreement with the teacher's argmax, on "
        f"{rows[0]['source'] if rows else 'held-out data'}; ppl on the same text (teacher: "
        f"{_fmt(headline(teacher)['ppl'])}). KV bytes/token = FA groups × 2 (K and V) × head_dim × bytes × "
        "layers, from the model's decode cache. time = wall seconds of all stages (teacher loading, compilation and checkpoints "
        "included; the shared probe is not); tokens = training tokens of all stages. Retrieval accuracies of a "
        "single run carry their Wilson 95 % interval over the cell's prompts in brackets.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in rows:
        cells = [
            r["group"],
            str(r["n"]),
            f"{_fmt(r['fa_groups'], integer=True)} of {_fmt(r['kv_groups'], integer=True)}",
            _fmt(r["kv_bytes_per_token"], integer=True),
            _fmt(r["init_kl"]),
            _fmt(r["kl"]),
            _fmt(r["top1"], percent=True),
            _fmt(r["ppl"], 4),
            *[
                _fmt_accuracy(r[k][0], prompts_per_cell(k, eval_settings))
                if r["n"] == 1 and k in r
                else _fmt(r.get(k), percent=True)
                for k in retrieval_keys
            ],
            _fmt(r["seconds"], integer=True),
            _fmt(r["tokens"], integer=True),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    teacher_retrieval = {k: v for k, v in (teacher.get("suite") or {}).items() if k.startswith(RETRIEVAL_PREFIXES)}
    if teacher_retrieval:
        cells = (f"{k} {_fmt_accuracy(v, prompts_per_cell(k, eval_settings))}" for k, v in teacher_retrieval.items())
        lines += ["", "Teacher retrieval: " + ", ".join(cells)]
    lines += answer_nll_table(results, rows)
    lines += text_interval_table(results)
    lines += heldout_table(results)
    lines += ["", "## Variants", ""]
    for v in results["variants"]:
        sel = v.get("selection") or {}
        lines.append(
            f"- `{v['name']}` (group {v['group']}): {sel.get('method')} {sel.get('ratio')} {sel.get('allocation')}, "
            f"fusion {v.get('fusion')}; overrides `{json.dumps(v['overrides'], sort_keys=True)}`; "
            f"stage seconds {v.get('stage_seconds')}; loss curves from its {v['curve_source']} rows"
            + (f"; merged from `{v['merged_from']}`" if v.get("merged_from") else "")
        )
    notes = sorted(
        {n for v in results["variants"] for e in (v.get("final"), v.get("at_init")) for n in (e or {}).get("notes", [])}
    )
    if any(v["curve_source"] != "heldout" for v in results["variants"]):
        notes.append(
            'loss_curves.png: a variant without held-out rows ("split": "heldout") in its metrics.jsonl is '
            "drawn from its training rows (one batch per step, noisy), marked 'training' in the legend."
        )
    if results.get("unfinished"):
        notes.insert(0, f"not finished yet, so not in this report: {', '.join(results['unfinished'])}.")
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += [""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def answer_nll_table(results: dict, rows: list[dict]) -> list[str]:
    """report.md's table of the retrieval cells' answer NLL (mean ± s over a group's runs), the teacher's first;
    [] when no run has one (evaluated before the suite scored answers)."""
    keys = sorted({k for r in rows for k in r if k.startswith(ANSWER_NLL)})
    if not keys:
        return []
    teacher = (results.get("teacher") or {}).get("suite") or {}
    lines = [
        "",
        "Answer NLL (−log p of the needle's tokens given the prompt, teacher-forced, nats per token, mean over the "
        "cell's prompts; exact match is all or nothing, this grades a partial read: for a random number needle a "
        "model that knows digits follow but not which scores about ln 10 = 2.3 per digit):",
        "",
        "| variant | " + " | ".join(k[len(ANSWER_NLL) :] for k in keys) + " |",
        "|" + "---|" * (len(keys) + 1),
    ]
    if any(k in teacher for k in keys):
        lines.append("| teacher | " + " | ".join(_fmt(teacher.get(k)) for k in keys) + " |")
    lines += [f"| {r['group']} | " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return lines


def text_interval_table(results: dict) -> list[str]:
    """report.md's table of KL and top-1 on each held-out text source with their bootstrap 95 % intervals over the
    windows, and each variant's difference from the recipe's first variant, paired window by window:
    Δ = mean_w (x_w − base_w) with a percentile-bootstrap interval over windows (``bootstrap_interval``);
    [] when no variant was evaluated on more than one window."""
    from hydrahead_jax.evaluation.intervals import bootstrap_interval

    finals = [(v["name"], (v.get("final") or {}).get("suite") or {}) for v in results["variants"]]
    keys = sorted({k[len(WINDOWS) :] for _, suite in finals for k in suite if k.startswith(WINDOWS)})
    if not keys:
        return []
    base_name, base = finals[0]
    lines = [
        "",
        "## Held-out text with intervals",
        "",
        "KL(teacher ‖ student) in nats/token and top-1 agreement on the evaluation's held-out text windows (the same "
        "windows for every variant), each with a bootstrap 95 % interval over windows; Δ = the variant minus "
        f"`{base_name}`, paired window by window, with its bootstrap 95 % interval (an interval that excludes 0 "
        "separates the two on these windows; it does not cover another data order's spread).",
        "",
        "| variant | " + " | ".join(f"{k} | Δ {k}" for k in keys) + " |",
        "|" + "---|" * (2 * len(keys) + 1),
    ]
    for name, suite in finals:
        cells = [name]
        for k in keys:
            x = suite.get(WINDOWS + k)
            if not x:
                cells += ["—", "—"]
                continue
            pct = k.startswith("top1")
            scale, digits = (100.0, 1) if pct else (1.0, 3)
            ci = bootstrap_interval(x)
            cells.append(
                f"{scale * sum(x) / len(x):.{digits}f} [{scale * ci[0]:.{digits}f}, {scale * ci[1]:.{digits}f}]"
            )
            b = base.get(WINDOWS + k)
            if name == base_name or not b or len(b) != len(x):
                cells.append("—")
                continue
            d = [xi - bi for xi, bi in zip(x, b)]
            dci = bootstrap_interval(d)
            cells.append(
                f"{scale * sum(d) / len(d):+.{digits}f} [{scale * dci[0]:+.{digits}f}, {scale * dci[1]:+.{digits}f}]"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def heldout_table(results: dict) -> list[str]:
    """report.md's section on each stage's fixed held-out batch: KL and top-1 at the stage's start → end, per
    group (mean ± s); the end of stage 1 is the student after alignment alone."""
    stages = sorted({s for v in results["variants"] for s in v.get("heldout") or {}})
    if not stages:
        return []
    groups: dict[str, list[dict]] = {}
    for v in results["variants"]:
        groups.setdefault(v["group"], []).append(v)
    header = ["variant", *[f"{s}: {m}" for s in stages for m in ("KL start → end", "top-1 start → end")]]
    lines = [
        "",
        "## Held-out batch of each stage",
        "",
        "Each stage's own fixed batch of validation rows (never trained on), evaluated at the stage's first and "
        "last step: KL(teacher ‖ student) in nats/token and top-1 agreement. A stage's start is the previous "
        "stage's end on this stage's batch (longer rows from stage 2 on).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for group, members in groups.items():
        cells = [group]
        for stage in stages:
            for metric, percent in (("kl", False), ("top1", True)):
                pair = []
                for end in ("start", "end"):
                    vals = [((m.get("heldout") or {}).get(stage) or {}).get(end, {}).get(metric) for m in members]
                    pair.append(_fmt(_mean_spread(vals), percent=percent))
                cells.append(" → ".join(pair))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


_LEGEND_COLUMNS, _LEGEND_ROW = 5, 0.045  # the shared legend's columns, and the figure height each of its rows takes


def _styles(n: int) -> list[dict[str, str]]:
    """n distinct (colour, marker) pairs: 20 colours × 12 markers, so up to 60 variants never share both."""
    import matplotlib.pyplot as plt

    colours, markers = plt.get_cmap("tab20").colors, "osD^vPX*hp<>"
    return [{"color": colours[i % len(colours)], "marker": markers[i % len(markers)]} for i in range(n)]


def _legend_below(fig, handles: dict) -> None:
    """One legend for all panels under them, then the layout with room for it (call after the last title)."""
    if handles:
        fig.legend(
            handles.values(), handles.keys(), loc="lower center", ncol=min(_LEGEND_COLUMNS, len(handles)), fontsize=8
        )
    fig.tight_layout(rect=(0, _LEGEND_ROW * math.ceil(len(handles) / _LEGEND_COLUMNS), 1, 1))


def plot_pareto(results: dict, rows: list[dict], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("kl", "KL(teacher ‖ student), nats/token (lower better)", False),
        ("top1", "top-1 agreement with the teacher (higher better)", True),
        ("retrieval", "NIAH/passkey accuracy (higher better)", True),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.6))
    xs = [r["kv_bytes_per_token"][0] for r in rows]
    # Variants at one KV budget sit on top of each other, so instead of text beside each point every row gets its
    # own colour and marker, named once in a shared legend under the panels.
    styles = _styles(len(rows))
    handles = {}
    for ax, (key, label, maximize) in zip(axes, panels):
        ys = [r[key][0] for r in rows]
        if all(y is None for y in ys):
            ax.text(0.5, 0.5, f"no {key} measurement\n(see report.md notes)", ha="center", va="center")
            ax.set_axis_off()
            continue
        for r, x, y, style in zip(rows, xs, ys, styles):
            if x is None or y is None:
                continue
            err = r[key][1] if r["n"] > 1 else None
            drawn = ax.errorbar([x], [y], yerr=None if err is None else [err], ls="none", capsize=4, ms=7, **style)
            handles.setdefault(r["group"] + (f" (n={r['n']})" if r["n"] > 1 else ""), drawn)
        front = pareto_front(xs, ys, maximize=maximize)
        fx, fy = [xs[i] for i in front], [ys[i] for i in front]
        ax.step(fx, fy, "k--", where="post", lw=1)  # the staircase the front's points span
        ax.scatter(fx, fy, s=180, facecolors="none", edgecolors="k", label="Pareto front")
        ax.set_xlabel("KV-cache bytes per token")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"Equal-budget comparison ({rows[0]['source'] if rows else ''})")
    _legend_below(fig, handles)
    fig.savefig(out / "pareto.png", dpi=110)
    plt.close(fig)
    return "pareto.png"


def plot_loss_curves(results: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({s for v in results["variants"] for s in v["curves"]})
    fig, axes = plt.subplots(1, max(len(stages), 1), figsize=(6 * max(len(stages), 1), 5.2), squeeze=False)
    styles, handles = _styles(len(results["variants"])), {}
    for ax, stage in zip(axes[0], stages):
        for v, style in zip(results["variants"], styles):
            pts = v["curves"].get(stage)
            if pts:
                label = v["name"] + ("" if v["curve_source"] == "heldout" else " (training)")
                (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], ms=5, lw=1.2, **style)
                handles.setdefault(label, line)
        ax.set_title(stage)
        ax.set_xlabel("tokens seen")
        ax.set_ylabel("held-out loss (the stage's objective; '(training)': training rows)")
        # log scale: a variant that does not recover (e.g. no fusion) sits orders of magnitude above the rest
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    if not stages:
        axes[0][0].text(0.5, 0.5, "no metrics rows", ha="center")
    _legend_below(fig, handles)
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)
    return "loss_curves.png"


def write_report(results: dict, workdir: str | Path) -> dict:
    """results.json, report.md, pareto.png and loss_curves.png in ``workdir``; returns the summary rows."""
    out = Path(workdir)
    rows = summary_rows(results)
    results = dict(results, summary=rows)
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True, default=str) + "\n")
    plots = [plot_pareto(results, rows, out), plot_loss_curves(results, out)]
    (out / "report.md").write_text(render_markdown(results, rows, plots))
    return rows
