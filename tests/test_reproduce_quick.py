"""`reproduce --quick` end to end as a user runs it (every part of the study at tiny sizes), killed mid-arm and
resumed: the rerun skips the finished parts, resumes the killed one and reports every run and claim; a second
machine's workdir goes on from the first one's results.json without running its runs again."""

import json
import os
import signal
import subprocess
import sys

import pytest
from train_helpers import with_test_compilation_cache


def _command(workdir, *flags):
    return [sys.executable, "-m", "hydrahead_jax.experiments.reproduce", f"--workdir={workdir}", "--quick", *flags]


@pytest.mark.slow  # the suite's longest test (4-5 min): started first, so no worker runs it alone at the end
def test_quick_study_killed_mid_arm_resumes_to_a_full_report(tmp_path):
    workdir = tmp_path / "study"
    env = with_test_compilation_cache(dict(os.environ, PYTHONUNBUFFERED="1"))
    first = subprocess.Popen(_command(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    for line in first.stdout:
        seen.append(line)
        if "2/6 layer_3to1/seed0/x1: stage distil" in line:  # its align stage is checkpointed: kill it hard
            first.send_signal(signal.SIGKILL)
            break
    first.wait(timeout=600)
    assert first.returncode == -signal.SIGKILL, "".join(seen[-20:])
    assert any("1/6 head_7to1/seed0/x1: done" in line for line in seen)
    assert any("(recall 2)" in line for line in seen) and any("(mixture)" in line for line in seen)
    assert any("grown to 2 layers at step 1" in line for line in seen)

    second = subprocess.run(_command(workdir), capture_output=True, text=True, env=env, timeout=900)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "1/6 head_7to1/seed0/x1: finished earlier, skipped" in out
    assert "teacher: training" not in out  # the trained teacher is reused, not retrained
    assert "2/6 layer_3to1/seed0/x1: stage align" not in out  # the killed arm resumes after its finished stage
    assert "2/6 layer_3to1/seed0/x1: done" in out and "6/6" in out

    results = json.loads((workdir / "results" / "results.json").read_text())
    assert [c["id"] for c in results["claims"]] == ["H1"]  # the quick study runs the primary arms alone
    assert results["claims"][0]["n_seeds"] == 2 and not results["unfinished"]
    assert len(results["runs"]) == 6 and results["teacher"]["accepted"] is False
    assert all((workdir / "results" / png).exists() for png in ("recall_by_length.png", "primary_by_budget.png"))
    report = (workdir / "results" / "report.md").read_text()
    # H1 at both budgets: x1 on two paired seeds (tested), x2 on one
    assert [r["budget"] for r in results["primary_by_budget"]] == [1.0, 2.0]
    assert "## The primary claim (H1) at each budget" in report and "| x2 | 1 |" in report

    # another machine: a new workdir trains the same teacher (deterministic from its seed), and the runs the merged
    # results.json records are reported, not run again
    elsewhere = tmp_path / "elsewhere"
    merged = workdir / "results" / "results.json"
    third = subprocess.run(
        _command(elsewhere, "--only=head_7to1,layer_3to1", f"--merge={merged}"),
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    out = third.stdout + third.stderr
    assert third.returncode == 0, out[-3000:]
    assert "run(s) of these parts finished in a --merge file: skipped" in out and ": stage align" not in out
    again = json.loads((elsewhere / "results" / "results.json").read_text())
    assert len(again["runs"]) == 6 and all(r["merged_from"] == str(merged) for r in again["runs"])
    assert again["claims"] == results["claims"]
