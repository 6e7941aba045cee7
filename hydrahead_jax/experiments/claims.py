"""The reproduction's claims and the tests that decide them, each fixed before its runs (docs/design.md states them).

Each claim compares two arms on one or two metrics, paired by seed: for the seeds both arms finished,
d_s = sign · (metric(A, s) − metric(B, s)), with sign = +1 where higher is better (recall) and −1 where lower is
better (KL), so d > 0 always means "A is better". A component of a claim is the one-sided test

    H0: E[d] ≤ −δ   against   H1: E[d] > −δ        (δ = the non-inferiority margin; δ = 0 for superiority)

Claims are registered in ``REGISTRATIONS``, each with its date, before the runs of its arms; the last
registration's rule decides every claim (earlier rules' decisions are reported beside it for comparison).

Rule "t" (from amendment 1, 2026-12-07): the paired t-test, with the n − 1 degree-of-freedom Student t
distribution F_{n−1}, the mean d̄ and the sample standard deviation s of the n differences:

    t = (d̄ + δ) / (s / √n),   p_support = 1 − F_{n−1}(t),   p_contra = F_{n−1}(t),

exact when the differences are normal; the interval is d̄ ± F⁻¹_{n−1}(1 − α/2) · s / √n (two-sided, 1 − α).

Rule "bootstrap" (the first registration's): B resamples of the n seeds with replacement, mean d*_b of each, and

    p_support = (1 + #{b : d*_b ≤ −δ}) / (B + 1),   p_contra = (1 + #{b : d*_b ≥ −δ}) / (B + 1),

with the two-sided percentile interval of the d*_b. At 3-5 seeds it does not hold its level: when every seed
favours A, p_support is the floor 1/(B + 1) whatever the spread, which happens with probability 2^−n under no
effect (``type_one_error`` measures it by simulation; the report states both rules' rates).

A claim with two components (H1: recall and KL) is supported only when both are (intersection-union test:
p_support = max of the two) and contradicted when either is (union: p_contra = min(1, 2 · min of the two),
Bonferroni within the claim). Across the claims the p-values are Holm-adjusted (one family for the support
tests, one for the contradiction tests):

    p̃_(i) = max_{j ≤ i} min(1, (m − j + 1) · p_(j))     (p_(1) ≤ … ≤ p_(m))

decision: "supported" if p̃_support < α, "contradicted" if p̃_contra < α, else "undecided". Each claim reports
the estimate (mean d, in the metric's own units and sign convention, A − B) and its two-sided (1 − α) interval,
per component. With fewer than two paired seeds a claim is "undecided" (no spread to test).
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


FIRST_CLAIMS = (
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

# H1 and H2 compare head-level selection with the periodic layer-wise rule, whose layers are fixed by position
# whatever the teacher: on a teacher whose retrieval layers the rule misses they measure placement as much as
# granularity. H5 compares granularity alone: both arms placed by the same probe, the layer-wise arm at twice
# the KV budget.
GRANULARITY_CLAIMS = (
    Claim(
        "H5a",
        "Head-level 7:1 is non-inferior to layer-wise 3:1 with its two layers placed by the same probe (the best "
        "whole layers): MQAR-64 recall at most 3 points lower and held-out text KL at most 0.05 nats/token higher.",
        "head_7to1",
        "layer_3to1_probe",
        (Component("mqar64", 0.03), Component("kl", 0.05)),
    ),
    Claim(
        "H5b",
        "Head-level 7:1 beats layer-wise 3:1 placed by the same probe: higher MQAR-64 recall and lower held-out "
        "text KL, at half its KV budget.",
        "head_7to1",
        "layer_3to1_probe",
        (Component("mqar64", 0.0), Component("kl", 0.0)),
    ),
)


@dataclasses.dataclass(frozen=True)
class Registration:
    """Claims fixed together before their arms' runs, the date they were fixed, and the decision rule ("t" or
    "bootstrap", module doc) that decides every claim from this registration on."""

    date: str
    rule: str
    claims: tuple[Claim, ...]
    note: str


REGISTRATIONS = (
    Registration("2026-12-01", "bootstrap", FIRST_CLAIMS, "the study's claims, fixed before its first run"),
    Registration(
        "2026-12-07",
        "t",
        GRANULARITY_CLAIMS,
        "Amendment 1: H5a/H5b added before the runs of their arm layer_3to1_probe; every claim decided by the paired "
        "t-test from now on, since the bootstrap rule says 'supported' in about 20 % of studies with no effect at 3 "
        "seeds and 11 % at 5 (nominal 5 %); the bootstrap decisions stay in the report for comparison.",
    ),
)
CLAIMS = tuple(c for r in REGISTRATIONS for c in r.claims)
RULES = ("t", "bootstrap")


# Comparisons added after the claims were fixed, reported with estimates and intervals only (never decided): the
# probe-placed layer-wise 7:1 arm against head-level 7:1 (granularity at one placement) and against the periodic
# layer-wise 7:1 (placement at one granularity).
EXPLORATORY = (
    ("head_7to1", "layer_7to1_probe", "mqar64"),
    ("head_7to1", "layer_7to1_probe", "kl"),
    ("layer_7to1_probe", "layer_7to1", "mqar64"),
)


def claims_spec(registrations: tuple[Registration, ...] | None = None) -> list[dict[str, Any]]:
    """The claims and the test settings of ``registrations`` (all by default) as JSON data, written to the
    workdir before the first run: the first registration's claims (each with the bootstrap's settings), then one
    entry per amendment."""
    first, *amendments = REGISTRATIONS if registrations is None else registrations
    spec: list[dict[str, Any]] = [
        {
            **dataclasses.asdict(c),
            "alpha": ALPHA,
            "resamples": BOOTSTRAP_RESAMPLES,
            "bootstrap_seed": BOOTSTRAP_SEED,
        }
        for c in first.claims
    ]
    spec += [{"amendment": dataclasses.asdict(r), "alpha": ALPHA} for r in amendments]
    return json.loads(json.dumps(spec))


def spec_hash(spec: list[dict[str, Any]] | None = None) -> str:
    spec = claims_spec() if spec is None else spec
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def registered_specs() -> list[list[dict[str, Any]]]:
    """The spec as it stood after each registration, oldest first (the last is ``claims_spec()``): a workdir or a
    results file fixed under an earlier one belongs to this study, amended since."""
    return [claims_spec(REGISTRATIONS[: k + 1]) for k in range(len(REGISTRATIONS))]


def bootstrap_means(d: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """Means of ``resamples`` resamples (with replacement) of the paired differences ``d`` [n]."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(d), size=(resamples, len(d)))
    return d[idx].mean(axis=1)


def one_sided_pvalues(means: np.ndarray, threshold: float) -> tuple[float, float]:
    """(p_support, p_contra) of E[d] > threshold, and of E[d] < threshold, from bootstrap means (module doc)."""
    b = len(means)
    return (1 + int(np.sum(means <= threshold))) / (b + 1), (1 + int(np.sum(means >= threshold))) / (b + 1)


def t_pvalues(d: np.ndarray, threshold: float) -> tuple[float, float]:
    """(p_support, p_contra) of E[d] > threshold, and of E[d] < threshold, by the paired t-test (module doc).
    Differences without spread decide by their mean alone (p 0 on the side it lies, 1 on the other)."""
    from scipy import stats

    n, mean, sd = len(d), float(np.mean(d)), float(np.std(d, ddof=1))
    if sd == 0.0:
        return float(mean <= threshold), float(mean >= threshold)
    t = (mean - threshold) / (sd / np.sqrt(n))
    return float(stats.t.sf(t, n - 1)), float(stats.t.cdf(t, n - 1))


def t_interval(d: np.ndarray, alpha: float) -> tuple[float, float]:
    """The two-sided (1 − α) t interval of E[d]: d̄ ± F⁻¹_{n−1}(1 − α/2) · s / √n."""
    from scipy import stats

    half = stats.t.ppf(1 - alpha / 2, len(d) - 1) * np.std(d, ddof=1) / np.sqrt(len(d))
    return float(np.mean(d) - half), float(np.mean(d) + half)


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


@dataclasses.dataclass(frozen=True)
class Test:
    """One decision rule's settings: ``rule`` "t" or "bootstrap" (module doc); the bootstrap's resamples and seed."""

    rule: str = REGISTRATIONS[-1].rule
    alpha: float = ALPHA
    resamples: int = BOOTSTRAP_RESAMPLES
    seed: int = BOOTSTRAP_SEED

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"rule {self.rule!r}: one of {RULES}.")

    def pvalues(self, d: np.ndarray, threshold: float) -> tuple[float, float]:
        """(p_support, p_contra) of E[d] > threshold from the sign-corrected differences ``d``."""
        if self.rule == "t":
            return t_pvalues(d, threshold)
        return one_sided_pvalues(bootstrap_means(d, self.resamples, self.seed), threshold)

    def interval(self, d: np.ndarray) -> tuple[float, float]:
        if self.rule == "t":
            return t_interval(d, self.alpha)
        lo, hi = np.quantile(bootstrap_means(d, self.resamples, self.seed), [self.alpha / 2, 1 - self.alpha / 2])
        return float(lo), float(hi)


def _estimate(summaries, arm_a: str, arm_b: str, metric: str, test: Test):
    """({metric, n_seeds, seeds, and with >= 2 paired seeds estimate = mean(A − B) and its two-sided (1 − α)
    interval}, the differences sign·(A − B) or None)."""
    key, sign = METRICS[metric]
    seeds, a, b = paired(_values(summaries, arm_a, key), _values(summaries, arm_b, key))
    comp: dict[str, Any] = {"metric": metric, "n_seeds": len(seeds), "seeds": seeds}
    if len(seeds) < 2:
        return comp, None
    raw = a - b  # A − B in the metric's own units
    lo, hi = (sign * x for x in test.interval(sign * raw))
    comp.update(estimate=float(raw.mean()), ci_low=float(min(lo, hi)), ci_high=float(max(lo, hi)))
    return comp, sign * raw


def exploratory(summaries: dict[str, dict[int, dict[str, float]]], test: Test = Test()) -> list[dict[str, Any]]:
    """The ``EXPLORATORY`` comparisons: estimate and interval only, no test and no decision."""
    rows = []
    for arm_a, arm_b, metric in EXPLORATORY:
        comp, _ = _estimate(summaries, arm_a, arm_b, metric, test)
        rows.append({"arms": [arm_a, arm_b], **comp})
    return rows


def decide(
    summaries: dict[str, dict[int, dict[str, float]]],
    test: Test = Test(),
    *,
    claims: tuple[Claim, ...] = CLAIMS,
) -> list[dict[str, Any]]:
    """Every claim's decision from ``summaries`` {arm: {seed: {metric key: value}}} under ``test`` (module
    doc), one Holm family over ``claims``; the primary claim (H1) first."""
    rows = []
    for claim in claims:
        comps, p_sup, p_con, n = [], [], [], None
        for c in claim.components:
            comp, d = _estimate(summaries, claim.arm_a, claim.arm_b, c.metric, test)
            comp["margin"] = c.margin
            n = comp["n_seeds"] if n is None else min(n, comp["n_seeds"])
            if d is not None:
                ps, pc = test.pvalues(d, -c.margin)
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
                "rule": test.rule,
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
        r["decision"] = "supported" if sup[k] < test.alpha else "contradicted" if con[k] < test.alpha else "undecided"
    for r in rows:  # the headline figures of the claim: its first component's
        first = r["components"][0]
        r.update(estimate=first.get("estimate"), ci_low=first.get("ci_low"), ci_high=first.get("ci_high"))
    return rows


# The differences' distributions of the type-I error simulation, each with mean 0 and standard deviation 1: the
# t-test is exact under the first; the others are skewed either way (a centred exponential and its mirror image),
# the shape of a metric near a bound.
NULL_DISTRIBUTIONS = {
    "normal": lambda rng, shape: rng.standard_normal(shape),
    "right-skewed": lambda rng, shape: rng.exponential(1.0, shape) - 1.0,
    "left-skewed": lambda rng, shape: 1.0 - rng.exponential(1.0, shape),
}


def type_one_error(test: Test, seeds: int, *, studies: int = 4000, distribution: str = "normal", seed: int = 0):
    """The fraction of ``studies`` simulated single-claim studies with no effect (n = ``seeds`` paired differences
    drawn from ``NULL_DISTRIBUTIONS[distribution]``, a superiority claim, δ = 0) that ``test`` calls supported:
    its type-I error, with the 95 % Wilson interval of that fraction."""
    rng = np.random.default_rng(seed)
    d = NULL_DISTRIBUTIONS[distribution](rng, (studies, seeds))
    supported = sum(test.pvalues(row, 0.0)[0] < test.alpha for row in d)
    return {"rate": supported / studies, "interval": list(wilson(supported, studies)), "studies": studies}


def wilson(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % at the default z)."""
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * np.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return float(centre - half), float(centre + half)
