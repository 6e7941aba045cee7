"""The reproduction study (experiments/reproduce.py): the refusals that keep a workdir's study from changing under
it, and the run plan."""

import pytest

from hydrahead_jax.config import ConfigError
from hydrahead_jax.experiments import claims, reproduce


def test_a_workdir_refuses_another_study_or_changed_claims(tmp_path, monkeypatch):
    study = reproduce.quick_study()
    reproduce._claim_workdir(study, tmp_path)
    reproduce._claim_workdir(study, tmp_path)  # the same study continues
    import dataclasses

    with pytest.raises(ConfigError, match="other settings"):
        reproduce._claim_workdir(dataclasses.replace(study, seeds=3), tmp_path)
    from hydrahead_jax.experiments import claims

    changed = [dict(c, alpha=0.1) for c in claims.claims_spec()]
    monkeypatch.setattr(claims, "claims_spec", lambda: changed)
    with pytest.raises(ConfigError, match="claims were fixed before"):
        reproduce._claim_workdir(study, tmp_path)


def test_only_names_parts_and_runs_are_seed_major():
    with pytest.raises(ConfigError, match="parts are"):
        reproduce.parts_of(["head_7to1", "nope"])
    study = reproduce.Study()
    specs = reproduce.run_specs(study, reproduce.parts_of([]))
    base = [s for s in specs if s.scale == 1.0]
    assert len([s for s in base if s.arm == "head_7to1"]) == 5 and len([s for s in base if s.arm == "all_la"]) == 3
    assert len(base) == 2 * 5 + 6 * 3 and len(specs) == len(base) + 2 * 3
    assert [s.seed for s in base] == sorted(s.seed for s in base)  # every arm's first seeds come first
    assert {s.arm for s in reproduce.run_specs(study, ["convergence"])} == set(reproduce.PRIMARY)


def test_exploratory_comparisons_name_arms_of_the_study():
    for arm_a, arm_b, metric in claims.EXPLORATORY:
        assert {arm_a, arm_b} <= set(reproduce.ARMS) and metric in claims.METRICS


def test_fa_placement_by_hand():
    assert reproduce.fa_placement([[[2], [], [], [], [0, 1, 3]]] * 2) == "0:1 4:3"
    assert reproduce.fa_placement([[[0], []], [[], [1]]]) == "per seed"
    assert reproduce.fa_placement([None, [[], []]]) == "none"
    assert reproduce.fa_placement([None]) == "—"


def test_a_merge_file_of_another_study_is_refused_before_any_work(tmp_path):
    import json

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
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a reproduction's results.json"):
        reproduce.merged_records(study, None, [tmp_path / "bad.json"])


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


def test_convergence_by_hand():
    study = reproduce.Study()  # convergence at x2 on 3 seeds; H1's margins 0.03 (recall) and 0.05 (KL)
    head, layer = claims.CLAIMS[0].arm_a, claims.CLAIMS[0].arm_b
    records = {
        (head, 0, 1.0): _record(0.90, 0.10),
        (layer, 0, 1.0): _record(0.10, 0.20),
        (head, 1, 1.0): _record(0.80, 0.12),
        (layer, 1, 1.0): _record(0.20, 0.22),
        (head, 0, 2.0): _record(0.95, 0.10),
        (layer, 0, 2.0): _record(0.10, 0.20),
        (head, 1, 2.0): _record(0.85, 0.12),
        (layer, 1, 2.0): _record(0.20, 0.22),
        (head, 2, 1.0): _record(0.0, 9.0),  # seed 2 has no x2 runs: left out of both means
        (layer, 2, 1.0): _record(0.0, 9.0),
    }
    conv = reproduce.convergence(study, records, 64)
    assert conv["seeds"] == [0, 1] and conv["converged"] is False
    recall, kl = conv["metrics"]["mqar64"], conv["metrics"]["kl"]
    # recall differences: seed 0 0.80 -> 0.85, seed 1 0.60 -> 0.65; means 0.70 -> 0.75, moved 0.05 > 0.015
    assert recall["per_seed"]["0"] == pytest.approx({"x1": 0.80, "x2": 0.85})
    assert recall["per_seed"]["1"] == pytest.approx({"x1": 0.60, "x2": 0.65})
    assert recall["differences"] == pytest.approx({"x1": 0.70, "x2": 0.75})
    assert recall["moved"] == pytest.approx(0.05) and recall["limit"] == pytest.approx(0.015)
    # KL differences -0.10 at both budgets: moved 0 < 0.025
    assert kl["differences"] == pytest.approx({"x1": -0.10, "x2": -0.10}) and kl["moved"] == pytest.approx(0.0)
    # recall moving by 0.01 on each seed is within half the margin: converged
    records[(head, 0, 2.0)] = _record(0.91, 0.10)
    records[(head, 1, 2.0)] = _record(0.81, 0.12)
    assert reproduce.convergence(study, records, 64)["converged"] is True
    assert reproduce.convergence(study, {}, 64)["converged"] is None
