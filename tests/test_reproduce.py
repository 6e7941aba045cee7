"""The reproduction study (experiments/reproduce.py): the refusals that keep a workdir's study from changing under
it, and the run plan."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from hydrahead_jax.config import ConfigError
from hydrahead_jax.experiments import claims, reproduce


def test_a_workdir_refuses_another_study_or_changed_claims(tmp_path, monkeypatch):
    study = reproduce.quick_study()
    reproduce._claim_workdir(study, tmp_path)
    reproduce._claim_workdir(study, tmp_path)  # the same study continues
    with pytest.raises(ConfigError, match="other settings"):
        reproduce._claim_workdir(dataclasses.replace(study, seeds=3), tmp_path)
    claims_file = tmp_path / "claims.json"
    # a workdir fixed under the first registration continues, amended
    claims_file.write_text(json.dumps(claims.registered_specs()[0]))
    reproduce._claim_workdir(study, tmp_path)
    assert json.loads(claims_file.read_text()) == claims.claims_spec()
    # a workdir whose claims are no registration of claims.py's is refused, its file kept
    changed = [dict(c, alpha=0.1) for c in claims.claims_spec()]
    claims_file.write_text(json.dumps(changed))
    with pytest.raises(ConfigError, match="claims were fixed before"):
        reproduce._claim_workdir(study, tmp_path)
    assert json.loads(claims_file.read_text()) == changed


def test_only_names_parts_and_runs_are_seed_major():
    with pytest.raises(ConfigError, match="parts are"):
        reproduce.parts_of(["head_7to1", "nope"])
    study = reproduce.Study()
    specs = reproduce.run_specs(study, reproduce.parts_of([]))
    base = [s for s in specs if s.scale == 1.0]
    assert len([s for s in base if s.arm == "head_7to1"]) == 5 and len([s for s in base if s.arm == "all_la"]) == 3
    assert len([s for s in base if s.arm == reproduce.GRANULARITY]) == 5  # claim H5's arm, as many as the primary
    assert len(base) == 3 * 5 + 6 * 3 and len(specs) == len(base) + 2 * 3
    assert [s.seed for s in base] == sorted(s.seed for s in base)  # every arm's first seeds come first
    assert {s.arm for s in reproduce.run_specs(study, ["convergence"])} == set(reproduce.PRIMARY)
    # one primary arm's convergence runs, for two machines or cores sharing a budget's runs
    one = reproduce.run_specs(study, reproduce.parts_of(["convergence:layer_3to1"]))
    assert [(s.arm, s.seed, s.scale) for s in one] == [("layer_3to1", seed, 2.0) for seed in range(3)]
    with pytest.raises(ConfigError, match="parts are"):
        reproduce.parts_of(["convergence:all_la"])  # not a primary arm: it has no convergence runs
    # a 4x check: the primary arms' 3 seeds again at 4x, after every 2x run
    longer = dataclasses.replace(study, convergence_scales=(2.0, 4.0))
    scales = [s.scale for s in reproduce.run_specs(longer, ["convergence"])]
    assert scales == [2.0] * 6 + [4.0] * 6


def test_convergence_budgets_double_and_stay_outside_the_recipe(tmp_path):
    study = reproduce.Study()
    for scales in [(4.0,), (2.0, 3.0), (2.0, 8.0)]:
        with pytest.raises(ConfigError, match="each budget must double the one before"):
            reproduce.check_study(dataclasses.replace(study, convergence_scales=scales))
    longer = dataclasses.replace(study, convergence_scales=(2.0, 4.0), convergence_seeds=2)
    # which convergence runs exist is no part of the recipe: results merged from either study stay valid
    assert longer.digest() == study.digest()
    assert dataclasses.replace(study, seeds=4).digest() != study.digest()
    # a workdir started with the single-budget form of the setting (older study.json) goes on with a 4x check
    older = {k: v for k, v in study.to_dict().items() if k != "convergence_scales"} | {"convergence_scale": 2.0}
    (tmp_path / "study.json").write_text(json.dumps(older))
    reproduce._claim_workdir(longer, tmp_path)
    with pytest.raises(ConfigError, match="started with other settings"):
        reproduce._claim_workdir(dataclasses.replace(study, seeds=4), tmp_path)


def test_exploratory_comparisons_name_arms_of_the_study():
    for arm_a, arm_b, metric in claims.EXPLORATORY:
        assert {arm_a, arm_b} <= set(reproduce.ARMS) and metric in claims.METRICS


def test_fa_placement_by_hand():
    assert reproduce.fa_placement([[[2], [], [], [], [0, 1, 3]]] * 2) == "0:1 4:3"
    assert reproduce.fa_placement([[[0], []], [[], [1]]]) == "per seed"
    assert reproduce.fa_placement([None, [[], []]]) == "none"
    assert reproduce.fa_placement([None]) == "—"


def test_a_merge_file_of_another_study_is_refused_before_any_work(tmp_path):
    study = reproduce.quick_study()
    theirs = {"runs": [], "study_digest": study.digest(), "claims_hash": claims.spec_hash(), "teacher": {"digest": "a"}}
    good, other_study, other_teacher = tmp_path / "good.json", tmp_path / "study.json", tmp_path / "teacher.json"
    good.write_text(json.dumps(theirs))
    other_study.write_text(json.dumps(theirs | {"study_digest": "another"}))
    other_teacher.write_text(json.dumps(theirs))
    assert reproduce.merged_records(study, None, [good]) == {}  # a workdir without a teacher checks the rest
    with pytest.raises(ConfigError, match="another study recipe or another teacher"):
        reproduce.merged_records(study, "b", [other_teacher])
    workdir = tmp_path / "study"
    with pytest.raises(ConfigError, match="another study recipe"):
        reproduce.run_study(study, workdir, only=["head_7to1"], merge=[other_study])
    assert not workdir.exists()  # refused before the workdir, the data or the teacher
    (tmp_path / "claims.json").write_text(json.dumps(theirs | {"claims_hash": "not registered"}))
    with pytest.raises(ConfigError, match="its claims are neither"):
        reproduce.merged_records(study, None, [tmp_path / "claims.json"])
    first = claims.spec_hash(claims.registered_specs()[0])  # a file of the first registration: this study, amended
    (tmp_path / "first.json").write_text(json.dumps(theirs | {"claims_hash": first}))
    assert reproduce.merged_records(study, None, [tmp_path / "first.json"]) == {}
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a reproduction's results.json"):
        reproduce.merged_records(study, None, [tmp_path / "bad.json"])
    # a file that records its settings is judged by them, without the convergence runs' fields: one written with
    # the single-budget form ("convergence_scale", whose digest covered it) merges into a study with a 4x check
    older = {k: v for k, v in study.to_dict().items() if k != "convergence_scales"} | {"convergence_scale": 2.0}
    (tmp_path / "older.json").write_text(json.dumps(theirs | {"study": older, "study_digest": "older form"}))
    longer = dataclasses.replace(study, convergence_scales=(2.0, 4.0))
    assert reproduce.merged_records(longer, None, [tmp_path / "older.json"]) == {}
    (tmp_path / "seeds.json").write_text(json.dumps(theirs | {"study": older | {"seeds": 9}}))
    with pytest.raises(ConfigError, match="another study recipe"):
        reproduce.merged_records(longer, None, [tmp_path / "seeds.json"])


def test_the_committed_study_merges_and_the_plan_leaves_exactly_the_unrecorded_runs(tmp_path):
    """The committed reproduction is this study's (it merges, every planned run recorded but those of arms
    registered after it); a results set made from it with known runs taken out leaves exactly those runs, in the
    plan's order."""
    committed = Path(__file__).resolve().parents[1] / "bench" / "results" / "reproduction" / "results.json"
    results = json.loads(committed.read_text())
    # the committed study's budgets (its convergence checks reach 8x): the runs it planned
    study = dataclasses.replace(reproduce.Study(), convergence_scales=tuple(results["study"]["convergence_scales"]))
    digest = results["teacher"]["digest"]
    planned = reproduce.run_specs(study, reproduce.parts_of([]))
    records = reproduce.merged_records(study, digest, [committed])
    # what the committed report lists as unfinished is what the plan leaves (the arms registered after it: H5's)
    assert [s.name for s in reproduce.unrecorded(planned, records)] == results["unfinished"]
    assert {name.split("/")[0] for name in results["unfinished"]} <= {reproduce.GRANULARITY}
    planned = [s for s in planned if s.arm != reproduce.GRANULARITY]
    assert len(planned) == 46 and {(r.arm, r.seed, r.scale) for r in planned} <= set(records)
    taken_out = {("layer_3to1", 1, 2.0), ("head_7to1", 2, 4.0), ("all_la", 0, 1.0), ("head_7to1", 4, 1.0)}
    partial = tmp_path / "partial.json"
    kept = [r for r in results["runs"] if (r["run"]["arm"], r["run"]["seed"], r["run"]["scale"]) not in taken_out]
    assert len(kept) == len(results["runs"]) - len(taken_out)
    partial.write_text(json.dumps(results | {"runs": kept}))
    records = reproduce.merged_records(study, digest, [partial])
    # seed-major over the base budget (all_la seed 0 before head_7to1 seed 4), then each convergence budget
    assert [s.name for s in reproduce.unrecorded(planned, records)] == [
        "all_la/seed0/x1",
        "head_7to1/seed4/x1",
        "layer_3to1/seed1/x2",
        "head_7to1/seed2/x4",
    ]
    convergence = reproduce.run_specs(study, ["convergence"])
    assert [s.name for s in reproduce.unrecorded(convergence, records)] == ["layer_3to1/seed1/x2", "head_7to1/seed2/x4"]
    # a 16x check on top: the two runs taken out, then every 16x run (none recorded anywhere)
    longer = dataclasses.replace(study, convergence_scales=(2.0, 4.0, 8.0, 16.0))
    left = reproduce.unrecorded(reproduce.run_specs(longer, ["convergence"]), records)
    assert [s.name for s in left[:2]] == ["layer_3to1/seed1/x2", "head_7to1/seed2/x4"]
    assert [(s.arm, s.seed, s.scale) for s in left[2:]] == [
        (arm, seed, 16.0) for seed in range(3) for arm in reproduce.PRIMARY
    ]


def test_machine_time_by_hand():
    def run(scale, stages, evaluation):
        return {"run": {"scale": scale}, "stage_seconds": stages, "eval_seconds": evaluation}

    results = {
        "runs": [run(1.0, {"align": 100, "distil": 200}, 60), run(1.0, {"align": 300}, 0), run(2.0, {"long": 900}, 0)],
        "teacher": {"training": {"wall_seconds_total": 1800}},
    }
    # finished: 360 + 300 + 900 s; base median 330 s, x2 median 900 s, x4 none yet: 4 x 330
    mt = reproduce.machine_time(results, [1.0, 2.0, 4.0])
    assert mt == {
        "teacher_seconds": 1800.0,
        "runs_seconds": 1560.0,
        "total_hours": round(3360 / 3600, 2),
        "unfinished_estimate_hours": round((330 + 900 + 1320) / 3600, 2),
    }


def _record(recall: float, kl: float) -> dict:
    return {"mqar_by_pairs": {"64": {"recall": recall}}, "kl": kl}


def _base_pairs(head: str, layer: str) -> dict:
    """Two seeds of both primary arms at the base budget: recall differences 0.80 and 0.60, KL −0.10 on both."""
    return {
        (head, 0, 1.0): _record(0.90, 0.10),
        (layer, 0, 1.0): _record(0.10, 0.20),
        (head, 1, 1.0): _record(0.80, 0.12),
        (layer, 1, 1.0): _record(0.20, 0.22),
    }


def test_convergence_by_hand():
    study = reproduce.Study()  # convergence at x2 on 3 seeds; H1's margins 0.03 (recall) and 0.05 (KL)
    head, layer = claims.CLAIMS[0].arm_a, claims.CLAIMS[0].arm_b
    records = _base_pairs(head, layer) | {
        (head, 0, 2.0): _record(0.95, 0.10),
        (layer, 0, 2.0): _record(0.10, 0.20),
        (head, 1, 2.0): _record(0.85, 0.12),
        (layer, 1, 2.0): _record(0.20, 0.22),
        (head, 2, 1.0): _record(0.0, 9.0),  # seed 2 has no x2 runs: left out of both means
        (layer, 2, 1.0): _record(0.0, 9.0),
    }
    conv = reproduce.convergence(study, records, 64)
    assert conv["converged"] is False and conv["converged_budget"] is None and len(conv["checks"]) == 1
    check = conv["checks"][0]
    assert check["from"] == 1.0 and check["scale"] == 2.0 and check["seeds"] == [0, 1]
    recall, kl = check["metrics"]["mqar64"], check["metrics"]["kl"]
    # recall differences: seed 0 0.80 -> 0.85, seed 1 0.60 -> 0.65; means 0.70 -> 0.75, moved 0.05 > 0.015
    assert recall["per_seed"]["0"] == pytest.approx({"x1": 0.80, "x2": 0.85})
    assert recall["per_seed"]["1"] == pytest.approx({"x1": 0.60, "x2": 0.65})
    assert recall["differences"] == pytest.approx({"x1": 0.70, "x2": 0.75})
    assert recall["moved"] == pytest.approx(0.05) and recall["limit"] == pytest.approx(0.015)
    # KL differences -0.10 at both budgets: moved 0 < 0.025
    assert kl["differences"] == pytest.approx({"x1": -0.10, "x2": -0.10}) and kl["moved"] == pytest.approx(0.0)
    # 4x runs of seed 0 only (merged from elsewhere: the study itself plans none): recall difference 0.85 -> 0.86
    # moves 0.01 < 0.015, KL -0.10 -> -0.11 moves 0.01 < 0.025: 2x is the budget shown converged
    records[(head, 0, 4.0)] = _record(0.96, 0.09)
    records[(layer, 0, 4.0)] = _record(0.10, 0.20)
    conv = reproduce.convergence(study, records, 64)
    assert [(c["from"], c["scale"], c["seeds"]) for c in conv["checks"]] == [(1.0, 2.0, [0, 1]), (2.0, 4.0, [0])]
    second = conv["checks"][1]["metrics"]
    assert second["mqar64"]["differences"] == pytest.approx({"x2": 0.85, "x4": 0.86})
    assert second["kl"]["differences"] == pytest.approx({"x2": -0.10, "x4": -0.11})
    assert conv["checks"][1]["converged"] is True and conv["converged"] is False and conv["converged_budget"] == 2.0
    # recall moving by 0.01 on each seed from 1x to 2x is within half the margin: the base budget converged
    records[(head, 0, 2.0)] = _record(0.91, 0.10)
    records[(head, 1, 2.0)] = _record(0.81, 0.12)
    conv = reproduce.convergence(study, records, 64)
    assert conv["converged"] is True and conv["converged_budget"] == 1.0
    assert reproduce.convergence(study, {}, 64)["converged"] is None


def test_primary_claim_by_budget_by_hand():
    head, layer = claims.CLAIMS[0].arm_a, claims.CLAIMS[0].arm_b
    records = _base_pairs(head, layer) | {
        ("head_3to1", 0, 1.0): _record(0.99, 0.01),  # not a primary arm: not read
        (layer, 0, 2.0): _record(0.10, 0.20),  # x2 holds no head-level run: no row
        (head, 0, 4.0): _record(0.96, 0.09),
        (layer, 0, 4.0): _record(0.10, 0.20),
        (head, 0, 8.0): _record(0.985, 0.04),
        (layer, 0, 8.0): _record(0.30, 0.30),
    }
    rows = reproduce.primary_by_budget(records, 64)
    assert [(r["budget"], r["n_seeds"]) for r in rows] == [(1.0, 2), (4.0, 1), (8.0, 1)]
    base, longer, longest = ({c["metric"]: c for c in r["components"]} for r in rows)
    # x1: recall differences 0.80 and 0.60: mean 0.7, s = 0.1 sqrt 2, so the t interval with one degree of
    # freedom is 0.7 +- tan(0.475 pi) x 0.1, and t = (0.7 + 0.03) / 0.1 = 7.3 gives p = 1/2 − arctan(7.3) / pi
    # = 0.043 < 0.05; KL −0.10 on both seeds (no spread: p = 0). Supported.
    assert base["mqar64"]["per_seed"] == pytest.approx({"0": 0.80, "1": 0.60})
    assert base["mqar64"]["mean_difference"] == pytest.approx(0.70)
    half = np.tan(0.475 * np.pi) * 0.1
    assert (base["mqar64"]["ci_low"], base["mqar64"]["ci_high"]) == pytest.approx((0.7 - half, 0.7 + half))
    assert base["kl"]["mean_difference"] == pytest.approx(-0.10)
    assert rows[0]["decision"] == "supported"
    # x4: one seed, 0.96 − 0.10 and 0.09 − 0.20: its difference without an interval, undecided
    assert longer["mqar64"]["mean_difference"] == pytest.approx(0.86) and "ci_low" not in longer["mqar64"]
    assert longer["kl"]["mean_difference"] == pytest.approx(-0.11)
    assert rows[1]["decision"] == "undecided"
    # With layer-wise at perfect recall and KL 0, head-level's least favourable seed: at x1 recall min(0.90, 0.80)
    # − 1 = −0.20 and KL max(0.10, 0.12) − 0 = +0.12, both outside the margins (0.03, 0.05); at x4 0.96 − 1 = −0.04
    # (outside) and +0.09; at x8 0.985 − 1 = −0.015 > −0.03 and +0.04 < 0.05, both inside.
    assert base["mqar64"]["worst_case"] == pytest.approx(-0.20) and base["kl"]["worst_case"] == pytest.approx(0.12)
    assert not base["mqar64"]["holds_at_worst"] and not base["kl"]["holds_at_worst"]
    assert longer["mqar64"]["worst_case"] == pytest.approx(-0.04) and not longer["mqar64"]["holds_at_worst"]
    assert longest["mqar64"]["worst_case"] == pytest.approx(-0.015) and longest["mqar64"]["holds_at_worst"]
    assert longest["kl"]["worst_case"] == pytest.approx(0.04) and longest["kl"]["holds_at_worst"]


def test_arm_table_at_a_budget_by_hand():
    def run(arm, seed, scale, recall, kl):
        return {
            "run": {"arm": arm, "seed": seed, "scale": scale},
            "mqar_by_pairs": {"64": {"recall": recall}},
            "kl": kl,
            "niah": {"accuracy": 0.0},
            "kv_bytes_per_token": 512,
            "fa_groups": [[0], [], [1, 2]],
        }

    head, layer = claims.CLAIMS[0].arm_a, claims.CLAIMS[0].arm_b
    results = {
        "headline_pairs": 64,
        "runs": [
            run(head, 0, 1.0, 0.5, 0.5),  # another budget: not read at x4
            run(head, 0, 4.0, 0.9, 0.20),
            run(head, 1, 4.0, 0.8, 0.10),
            run(layer, 2, 4.0, 0.3, 0.40),  # one seed: no spread
            run("all_la", 0, 4.0, 0.0, 1.0),  # not asked for
        ],
    }
    table = reproduce.arm_table(results, 4.0, (head, layer))
    assert list(table) == [head, layer]
    # recall 0.9 and 0.8: mean 0.85, sample std sqrt(2 x 0.05^2 / 1) = 0.0707; KL 0.20 and 0.10: 0.15 ± 0.0707
    assert table[head]["seeds"] == 2 and table[head]["mqar"] == pytest.approx((0.85, 0.05 * 2**0.5))
    assert table[head]["kl"] == pytest.approx((0.15, 0.05 * 2**0.5))
    assert table[head]["fa_placement"] == "0:1 2:2"
    assert table[layer]["seeds"] == 1 and table[layer]["mqar"] == pytest.approx((0.3, None))


def test_the_report_renders_the_committed_study_and_a_check_without_seeds():
    """report.md from the committed results.json: every budget's H1 row, and a doubling that no seed has finished
    at both budgets yet said in words (no empty table)."""
    committed = Path(__file__).resolve().parents[1] / "bench" / "results" / "reproduction" / "results.json"
    results = json.loads(committed.read_text())
    results["convergence"]["checks"].append({"from": 8.0, "scale": 16.0, "seeds": [], "metrics": {}, "converged": None})
    text = reproduce.render(results, ["primary_by_budget.png"], reproduce.Study())
    assert "x8 → x16: no seed has finished both primary arms at both budgets yet." in text
    assert "x8 → x16: within" not in text
    for row in results["primary_by_budget"]:
        assert f"| x{row['budget']:g} | {row['n_seeds']} | " in text
    assert "| x1 | 5 | " in text and "![primary_by_budget.png](primary_by_budget.png)" in text
    assert "| mqar64 with B at its best | kl with B at its best |" in text
    head, layer = claims.CLAIMS[0].arm_a, claims.CLAIMS[0].arm_b
    for scale in {r["run"]["scale"] for r in results["runs"]}:
        assert f"| x{scale:g} | {head} | " in text and f"| x{scale:g} | {layer} | " in text
    finished = reproduce.render(results | {"unfinished": []}, [], reproduce.Study())
    assert "every planned run has finished." in finished and "Unfinished" not in finished
    results["unfinished"] = ["head_7to1/seed5/x16"]
    results["machine_time"]["unfinished_estimate_hours"] = 7.5
    text = reproduce.render(results, [], reproduce.Study())
    assert "so far; the 1 unfinished runs need about 7.5 h more" in text
    assert "Unfinished runs (1): head_7to1/seed5/x16" in text and "every planned run has finished" not in text
