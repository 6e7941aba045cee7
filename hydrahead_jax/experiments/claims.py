"""The reproduction's claims and the tests that decide them, fixed before any run (docs/design.md states them).

Each claim compares two arms on one or two metrics, paired by seed: for the seeds both arms finished,
d_s = sign · (metric(A, s) − metric(B, s)), with sign = +1 where higher is better (recall) and −1 where lower is
better (KL), so d > 0 always means "A is better". A component of a claim is the one-sided test

    H0: E[d] ≤ −δ   against   H1: E[d] > −δ        (δ = the non-inferiority margin; δ = 0 for superiority)

by the paired bootstrap: B resamples of the n seeds with replacement, mean d*_b of each, and the p-value

    p_support = (1 + #{b : d*_b ≤ −δ}) / (B + 1),

the percentile inversion of the one-sided interval (p_support < α ⟺ the lower (1 − α) percentile bound of the
mean lies above −δ, up to the resampling grain). The opposite test, "A is worse than the margin allows",
H0': E[d] ≥ −δ against E[d] < −δ, has p_contra = (1 + #{b : d*_b ≥ −δ}) / (B + 1).

A claim with two components (H1: recall and KL) is supported only when both are (intersection-union test:
p_support = max of the two) and contradicted when either is (union: p_contra = min(1, 2 · min of the two),
Bonferroni within the claim). Across the four claims the p-values are Holm-adjusted (one family for the support
tests, one for the contradiction tests):

    p̃_(i) = max_{j ≤ i} min(1, (m − j + 1) · p_(j))     (p_(1) ≤ … ≤ p_(m))

decision: "supported" if p̃_support < α, "contradicted" if p̃_contra < α, else "undecided". Each claim reports
the estimate (mean d, in the metric's own units and sign convention, A − B) and its two-sided (1 − α) percentile
bootstrap interval, per component. With fewer than two paired seeds a claim is "undecided" (no spread to test).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np

ALPHA = 0.05
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 20260601

# metric name -> (the key of a run's summary, +1 if higher is better else -1)
METRICS = {"mqar64": ("mqar64_recall", +1), "kl": ("kl", -1)}


@dataclasses.dataclass(frozen=True)
class Component:
    metric: str  # a key of METRICS
    margin: float  # δ >= 0 in the metric's units (0: superiority)


@dataclasses.dataclass(frozen=True)
class Claim:
    id: str
    statement: str
    arm_a: str
    arm_b: str
    components: tuple[Component, ...]


CLAIMS = (
    Claim(
        "H1",
        "Head-level 7:1 (probe-selected) is non-inferior to layer-wise 3:1: MQAR-64 recall at most 3 points lower "
        "and held-out text KL at most 0.05 nats/token higher.",
        "head_7to1",
        "layer_3to1",
        (Component("mqar64", 0.03), Component("kl", 0.05)),
    ),
    Claim(
        "H2",
        "At the equal KV budget of layer-wise 3:1, head-level selection beats layer-wise (higher MQAR-64 recall).",
        "head_3to1",
        "layer_3to1",
        (Component("mqar64", 0.0),),
    ),
    Claim(
        "H3",
        "At 7:1, probe-selected heads beat randomly chosen heads (higher MQAR-64 recall).",
        "head_7to1",
        "random_7to1",
        (Component("mqar64", 0.0),),
    ),
    Claim(
        "H4",
        "The fusion is needed: head-level 7:1 with fusion has lower held-out text KL than without it.",
        "head_7to1",
        "head_7to1_nofusion",
        (Component("kl", 0.0),),
    ),
)


# Comparisons added after the claims were fixed, reported with estimates and intervals only (never decided): the
# probe-placed layer-wise 7:1 arm against head-level 7:1 (granularity at one placement) and against the periodic
# layer-wise 7:1 (placement at one granularity).
EXPLORATORY = (
    ("head_7to1", "layer_7to1_probe", "mqar64"),
    ("head_7to1", "layer_7to1_probe", "kl"),
    ("layer_7to1_probe", "layer_7to1", "mqar64"),
)


def claims_spec() -> list[dict[str, Any]]:
    """The claims and the test settings as JSON data (written to the workdir before the first run)."""
    spec = [
        {
            **dataclasses.asdict(c),
            "alpha": ALPHA,
            "resamples": BOOTSTRAP_RESAMPLES,
            "bootstrap_seed": BOOTSTRAP_SEED,
        }
        for c in CLAIMS
    ]
    return json.loads(json.dumps(spec))


def spec_hash() -> str:
    return hashlib.sha256(json.dumps(claims_spec(), sort_keys=True).encode()).hexdigest()[:16]


def bootstrap_means(d: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """Means of ``resamples`` resamples (with replacement) of the paired differences ``d`` [n]."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(d), size=(resamples, len(d)))
    return d[idx].mean(axis=1)


def one_sided_pvalues(means: np.ndarray, threshold: float) -> tuple[float, float]:
    """(p_support, p_contra) of E[d] > threshold, and of E[d] < threshold, from bootstrap means (module doc)."""
    b = len(means)
    return (1 + int(np.sum(means <= threshold))) / (b + 1), (1 + int(np.sum(means >= threshold))) / (b + 1)


def holm(pvalues: list[float]) -> list[float]:
    """Holm step-down adjusted p-values, in the input order."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def paired(values_a: dict[int, float], values_b: dict[int, float]) -> tuple[list[int], np.ndarray, np.ndarray]:
    seeds = sorted(set(values_a) & set(values_b))
    return seeds, np.asarray([values_a[s] for s in seeds], float), np.asarray([values_b[s] for s in seeds], float)


def _values(summaries, arm: str, key: str) -> dict[int, float]:
    return {s: v[key] for s, v in summaries.get(arm, {}).items() if v.get(key) is not None}


def _estimate(summaries, arm_a: str, arm_b: str, metric: str, alpha: float, resamples: int, seed: int):
    """({metric, n_seeds, seeds, and with >= 2 paired seeds estimate = mean(A − B) and its two-sided (1 − α)
    percentile bootstrap interval}, the bootstrap means of sign·(A − B) or None)."""
    key, sign = METRICS[metric]
    seeds, a, b = paired(_values(summaries, arm_a, key), _values(summaries, arm_b, key))
    comp: dict[str, Any] = {"metric": metric, "n_seeds": len(seeds), "seeds": seeds}
    if len(seeds) < 2:
        return comp, None
    raw = a - b  # A − B in the metric's own units
    means = bootstrap_means(sign * raw, resamples, seed)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2]) * sign
    comp.update(estimate=float(raw.mean()), ci_low=float(min(lo, hi)), ci_high=float(max(lo, hi)))
    return comp, means


def exploratory(
    summaries: dict[str, dict[int, dict[str, float]]],
    *,
    alpha: float = ALPHA,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> list[dict[str, Any]]:
    """The ``EXPLORATORY`` comparisons: estimate and interval only, no test and no decision."""
    rows = []
    for arm_a, arm_b, metric in EXPLORATORY:
        comp, _ = _estimate(summaries, arm_a, arm_b, metric, alpha, resamples, seed)
        rows.append({"arms": [arm_a, arm_b], **comp})
    return rows


def decide(
    summaries: dict[str, dict[int, dict[str, float]]],
    *,
    alpha: float = ALPHA,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    claims: tuple[Claim, ...] = CLAIMS,
) -> list[dict[str, Any]]:
    """Every claim's decision from ``summaries`` {arm: {seed: {metric key: value}}} (module doc); the primary
    claim (H1) first."""
    rows = []
    for claim in claims:
        comps, p_sup, p_con, n = [], [], [], None
        for c in claim.components:
            comp, means = _estimate(summaries, claim.arm_a, claim.arm_b, c.metric, alpha, resamples, seed)
            comp["margin"] = c.margin
            n = comp["n_seeds"] if n is None else min(n, comp["n_seeds"])
            if means is not None:
                ps, pc = one_sided_pvalues(means, -c.margin)
                comp.update(p_support=ps, p_contra=pc)
                p_sup.append(ps)
                p_con.append(pc)
            comps.append(comp)
        complete = len(p_sup) == len(claim.components)
        rows.append(
            {
                "id": claim.id,
                "statement": claim.statement,
                "arms": [claim.arm_a, claim.arm_b],
                "components": comps,
                "n_seeds": int(n or 0),
                "p_support": max(p_sup) if complete else None,
                "p_contra": min(1.0, len(p_con) * min(p_con)) if complete else None,
            }
        )
    testable = [i for i, r in enumerate(rows) if r["p_support"] is not None]
    sup = holm([rows[i]["p_support"] for i in testable])
    con = holm([rows[i]["p_contra"] for i in testable])
    for r in rows:
        r.update(p_support_holm=None, p_contra_holm=None, decision="undecided")
    for k, i in enumerate(testable):
        r = rows[i]
        r["p_support_holm"], r["p_contra_holm"] = sup[k], con[k]
        r["decision"] = "supported" if sup[k] < alpha else "contradicted" if con[k] < alpha else "undecided"
    for r in rows:  # the headline figures of the claim: its first component's
        first = r["components"][0]
        r.update(estimate=first.get("estimate"), ci_low=first.get("ci_low"), ci_high=first.get("ci_high"))
    return rows
