"""The reproduction's statistics (experiments/claims.py) against exact enumeration and values worked out by hand."""

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from hydrahead_jax.experiments import claims


def exact_bootstrap_means(d):
    """Every one of the n^n equally likely resamples of d, enumerated: the bootstrap distribution exactly."""
    return np.asarray([np.mean(c) for c in itertools.product(d, repeat=len(d))])


def test_bootstrap_pvalue_and_interval_match_exact_enumeration():
    d = np.asarray([0.02, -0.01, 0.05, 0.04])
    exact = exact_bootstrap_means(d)  # 256 resamples
    means = claims.bootstrap_means(d, 200_000, seed=3)
    for threshold in (-0.03, 0.0, 0.02):
        p_exact = np.mean(exact <= threshold)
        p, q = claims.one_sided_pvalues(means, threshold)
        # Monte-Carlo error of a proportion over 200k resamples: sd <= 0.0011; 0.005 is > 4 sd.
        assert p == pytest.approx(p_exact, abs=0.005)
        assert q == pytest.approx(np.mean(exact >= threshold), abs=0.005)
    lo, hi = np.quantile(means, [0.025, 0.975])
    e_lo, e_hi = np.quantile(exact, [0.025, 0.975])
    # the resample means sit on a grid of 0.0025 (sums of 4 of the d values / 4): within one grid step
    assert lo == pytest.approx(e_lo, abs=0.0026) and hi == pytest.approx(e_hi, abs=0.0026)


def test_two_seed_bootstrap_by_hand():
    # d = (0, 1): resample means 0 (1/4), 0.5 (1/2), 1 (1/4). P(mean <= 0) = 1/4, P(mean >= 0.5) = 3/4.
    means = claims.bootstrap_means(np.asarray([0.0, 1.0]), 100_000, seed=0)
    p, _ = claims.one_sided_pvalues(means, 0.0)
    _, q = claims.one_sided_pvalues(means, 0.5)
    assert p == pytest.approx(0.25, abs=0.006) and q == pytest.approx(0.75, abs=0.006)


def test_holm_by_hand():
    # sorted p: 0.01 (x4 = 0.04), 0.02 (x3 = 0.06), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04 -> running max 0.06)
    assert claims.holm([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    assert claims.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert claims.holm([0.001]) == pytest.approx([0.001])


BOOTSTRAP = claims.Test("bootstrap", resamples=4000)


def _summaries(arms):
    return {arm: {s: {"mqar64_recall": r, "kl": k} for s, (r, k) in enumerate(vals)} for arm, vals in arms.items()}


@pytest.mark.parametrize("test", [claims.Test("t"), BOOTSTRAP], ids=["t", "bootstrap"])
def test_decisions_follow_the_fixed_tests(test):
    five = range(5)
    arms = {
        # H1: head 7:1 recall 1 point below layer 3:1 (margin 3) and KL 0.01 above (margin 0.05): non-inferior
        "head_7to1": [(0.90 + 0.001 * s, 0.20 + 0.001 * s) for s in five],
        "layer_3to1": [(0.91 + 0.001 * s + 0.002 * (s % 2), 0.19 + 0.001 * s) for s in five],
        # H2: head 3:1 clearly below layer 3:1 -> contradicted
        "head_3to1": [(0.70 + 0.01 * s, 0.2) for s in five],
        # H3: random 7:1 identical on average to head 7:1 (differences +-0.02) -> undecided
        "random_7to1": [(0.90 + 0.001 * s + (0.02 if s % 2 else -0.02), 0.2) for s in five],
        # H4: no fusion has clearly higher KL -> supported
        "head_7to1_nofusion": [(0.9, 0.40 + 0.01 * s) for s in five],
        # H5a and H5b: layer-wise placed by the probe 5 points below head 7:1 and 0.05 above its KL -> both supported
        "layer_3to1_probe": [(0.85 + 0.003 * (s % 2), 0.25 + 0.002 * s) for s in five],
    }
    rows = {r["id"]: r for r in claims.decide(_summaries(arms), test)}
    assert [r["id"] for r in claims.decide(_summaries(arms), test)][0] == "H1"  # the primary claim first
    assert rows["H1"]["decision"] == "supported"
    assert rows["H1"]["estimate"] == pytest.approx(-0.0108, abs=1e-9)  # mean of -(0.01 + 0.002 (s % 2))
    assert rows["H2"]["decision"] == "contradicted"
    assert rows["H3"]["decision"] == "undecided"
    assert rows["H4"]["decision"] == "supported"
    assert rows["H4"]["estimate"] == pytest.approx(0.202 - 0.42, abs=1e-9)  # KL with − without fusion (means)
    assert rows["H4"]["ci_high"] < 0  # lower KL with the fusion, the whole interval
    assert rows["H5a"]["decision"] == rows["H5b"]["decision"] == "supported"
    for r in rows.values():
        assert r["n_seeds"] == 5
        assert r["ci_low"] <= r["estimate"] <= r["ci_high"]


def test_non_inferiority_fails_on_either_metric_and_one_seed_is_undecided():
    five = range(5)
    arms = {
        # recall fine but KL 0.2 higher than the margin of 0.05 allows -> H1 contradicted (the KL component)
        "head_7to1": [(0.91, 0.40 + 0.001 * s) for s in five],
        "layer_3to1": [(0.91, 0.20 + 0.002 * s) for s in five],
    }
    rows = {r["id"]: r for r in claims.decide(_summaries(arms), BOOTSTRAP)}
    assert rows["H1"]["decision"] == "contradicted"
    assert rows["H2"]["decision"] == "undecided" and rows["H2"]["n_seeds"] == 0  # arm not run
    one = {"head_7to1": [(0.9, 0.2)], "layer_3to1": [(0.5, 0.9)]}
    assert claims.decide(_summaries(one), claims.Test("bootstrap", resamples=100))[0]["decision"] == "undecided"


def test_claims_spec_is_stable_data():
    spec = claims.claims_spec()
    assert [c["id"] for c in spec[:4]] == ["H1", "H2", "H3", "H4"]
    assert spec[0]["components"] == [{"metric": "mqar64", "margin": 0.03}, {"metric": "kl", "margin": 0.05}]
    amendment = spec[4]["amendment"]
    assert (amendment["date"], amendment["rule"]) == ("2026-12-07", "t")
    assert [c["id"] for c in amendment["claims"]] == ["H5a", "H5b"]
    assert claims.registered_specs()[-1] == spec and claims.registered_specs()[0] == spec[:4]


def test_spec_hash_is_the_committed_studys_and_moves_with_any_claim_setting(monkeypatch):
    """The hash the committed reproduction recorded is one of the registrations' (a merge of it would be refused
    otherwise), and every part of the spec (a margin, a statement, the rule, the test settings) changes it."""
    committed = Path(__file__).resolve().parents[1] / "bench" / "results" / "reproduction" / "results.json"
    registered = [claims.spec_hash(spec) for spec in claims.registered_specs()]
    assert json.loads(committed.read_text())["claims_hash"] in registered
    pinned = claims.spec_hash()
    first, amendment = claims.REGISTRATIONS
    h1, *rest = first.claims
    wider = dataclasses.replace(h1, components=(claims.Component("mqar64", 0.04), *h1.components[1:]))
    reworded = dataclasses.replace(h1, statement=h1.statement + " ")
    changed_first = [dataclasses.replace(first, claims=c) for c in ((wider, *rest), (reworded, *rest), (*rest, h1))]
    for registrations in (
        *[(c, amendment) for c in changed_first],
        (first, dataclasses.replace(amendment, rule="bootstrap")),
    ):
        with monkeypatch.context() as m:
            m.setattr(claims, "REGISTRATIONS", registrations)
            assert claims.spec_hash() != pinned
    for name, value in (("ALPHA", 0.1), ("BOOTSTRAP_RESAMPLES", 20_000), ("BOOTSTRAP_SEED", 1)):
        with monkeypatch.context() as m:
            m.setattr(claims, name, value)
            assert claims.spec_hash() != pinned
    assert claims.spec_hash() == pinned  # restored: the hash is a function of the spec alone


def test_t_test_pvalue_and_interval_by_hand():
    # d = (1, 2, 3): mean 2, s = 1, n = 3, t = 2 / (1 / sqrt 3) = 2 sqrt 3 against 0. With 2 degrees of freedom
    # the t distribution's CDF is F(t) = 1/2 + t / (2 sqrt(2 + t^2)) and its quantile
    # F^-1(p) = (2p - 1) / sqrt(2 p (1 - p)).
    d = np.asarray([1.0, 2.0, 3.0])
    t = 2 * np.sqrt(3)
    p_support = 0.5 - t / (2 * np.sqrt(2 + t * t))  # 0.03709
    p, q = claims.t_pvalues(d, 0.0)
    assert p == pytest.approx(p_support, rel=1e-9) and q == pytest.approx(1 - p_support, rel=1e-9)
    # against threshold 3: t = -1 / (1 / sqrt 3) = -sqrt 3, so p_contra = F(-sqrt 3) = 1/2 - sqrt(3) / (2 sqrt 5)
    _, q = claims.t_pvalues(d, 3.0)
    assert q == pytest.approx(0.5 - np.sqrt(3) / (2 * np.sqrt(5)), rel=1e-9)
    half = 0.95 / np.sqrt(2 * 0.975 * 0.025) / np.sqrt(3)  # F^-1(0.975) s / sqrt n = 4.3027 / sqrt 3
    assert claims.t_interval(d, 0.05) == pytest.approx((2 - half, 2 + half), rel=1e-9)
    # no spread: the mean alone decides
    assert claims.t_pvalues(np.asarray([0.1, 0.1]), 0.0) == (0.0, 1.0)


def test_the_t_rule_holds_its_level_and_the_bootstrap_rule_does_not():
    """Simulated studies with no effect (normal differences, a superiority claim): the t-test calls about 5 % of
    them supported at the study's seed counts; the bootstrap rule at least the 2^-n of studies whose every seed
    favours A (its p-value sits at its floor then)."""
    studies = 4000  # the sd of a rate near 0.05 over 4000 studies is 0.0034; 0.05 +- 0.0115 is 3.4 sd
    for seeds in (3, 5):
        rate = claims.type_one_error(claims.Test("t"), seeds, studies=studies, seed=seeds)["rate"]
        assert abs(rate - 0.05) < 0.0115
    bootstrap = claims.type_one_error(claims.Test("bootstrap", resamples=1000), 3, studies=studies, seed=1)
    assert bootstrap["rate"] > 0.125 - 0.018  # 2^-3 minus 3.4 sd of a rate near 0.125 (0.0052 x 3.4)
    lo, hi = bootstrap["interval"]
    assert lo < bootstrap["rate"] < hi


def test_wilson_interval_by_hand():
    # 0 of 10: centre z^2 / (2 n) / (1 + z^2 / n), half the same: [0, z^2 / (n + z^2)]
    z = 1.959964
    lo, hi = claims.wilson(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(z * z / (10 + z * z), rel=1e-9)


def test_exploratory_estimates_by_hand():
    # head 7:1 − probe-placed layer-wise: d = (+0.05, −0.05) → estimate 0, s = 0.05 sqrt 2; the t interval with one
    # degree of freedom (a Cauchy: F^-1(p) = tan(pi (p - 1/2))) is 0 +- tan(0.475 pi) s / sqrt 2 = +-12.706 x 0.05.
    # Under the bootstrap rule the resample means are −0.05 (1/4), 0 (1/2), +0.05 (1/4): the percentile interval
    # is [−0.05, 0.05]. One paired seed: no estimate.
    summaries = _summaries({"head_7to1": [(0.90, 0.2), (0.80, 0.3)], "layer_7to1_probe": [(0.85, 0.2), (0.85, 0.3)]})
    rows = {(r["arms"][1], r["metric"]): r for r in claims.exploratory(summaries)}
    mqar = rows[("layer_7to1_probe", "mqar64")]
    assert mqar["n_seeds"] == 2 and mqar["estimate"] == pytest.approx(0.0, abs=1e-12)
    half = np.tan(0.475 * np.pi) * 0.05
    assert (mqar["ci_low"], mqar["ci_high"]) == pytest.approx((-half, half), rel=1e-9)
    boot = {(r["arms"][1], r["metric"]): r for r in claims.exploratory(summaries, claims.Test("bootstrap"))}
    assert (boot[("layer_7to1_probe", "mqar64")]["ci_low"], boot[("layer_7to1_probe", "mqar64")]["ci_high"]) == (
        pytest.approx((-0.05, 0.05))
    )
    assert rows[("layer_7to1_probe", "kl")]["estimate"] == pytest.approx(0.0, abs=1e-12)
    assert "estimate" not in rows[("layer_7to1", "mqar64")] and rows[("layer_7to1", "mqar64")]["n_seeds"] == 0
