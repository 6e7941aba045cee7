"""Smoke test of bench/: every script's --quick mode runs end to end and prints its markdown table.

No timing is asserted (benchmarks fail only on errors). What is checked: each script produces the table rows it
promises, with finite positive measurements, and the gated delta benchmark's own agreement check against
transformers' torch implementation passes (it raises otherwise). Nothing is appended to bench/RESULTS.md.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))


def _table_rows(text: str, first_header: str) -> list[list[str]]:
    """Data rows of the markdown table(s) whose first header cell is ``first_header``."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith(f"| {first_header} |"):
            inside = True
            continue
        if inside and line.startswith("|---"):
            continue
        if inside and line.startswith("| "):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        else:
            inside = False
    return rows


def test_attention_quick(capsys):
    import bench_attention

    all_results = bench_attention.main(["--quick"])
    out = capsys.readouterr().out
    rows = _table_rows(out, "T")
    assert len(rows) == 2 and all(r[0] == "256" for r in rows)  # one time table, one memory table
    cfg, summary = all_results["smollm2"]
    time_v, mem_v = summary[("fwdbwd", 256)]
    for v in bench_attention.VARIANTS:
        assert time_v[v] > 0 and math.isfinite(time_v[v]), v
        assert mem_v[v] > 0, v
    # The stack average really mixes the measured blocks: 11 of 30 layers carry the 1-FA block.
    assert bench_attention.stack_weights(cfg)["HydraHead 7:1"] == pytest.approx({"1-FA": 11 / 30, "all-LA": 19 / 30})


def test_decode_quick(capsys):
    import bench_decode

    per_token = bench_decode.main(["--quick"])
    out = capsys.readouterr().out
    rows = _table_rows(out, "context")
    assert [r[0] for r in rows] == ["256", "512"]
    # cache_bytes (analytic) and the real pytree agree to the byte for both models (columns 4/5 and 6/7).
    assert all(r[4] == r[5] and r[6] == r[7] for r in rows)
    assert all(t > 0 for ctx in per_token.values() for t in ctx.values())


def test_train_step_quick(capsys):
    import bench_train_step

    tps = bench_train_step.main(["--quick", "--remat", "both"])
    out = capsys.readouterr().out
    rows = _table_rows(out, "stage")
    assert [r[0] for r in rows] == [
        f"stage {s}{r}" for s in ("1 align", "2 distil", "3 long") for r in ("", " (remat)")
    ]
    assert set(tps) == {f"{k}{r}" for k in ("align", "distil", "long") for r in ("", ":remat")}
    assert all(v > 0 for v in tps.values())


def test_gated_delta_quick_via_run_all():
    # Through run_all (a subprocess per script), so the runner itself is exercised too.
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), "--quick", "--only", "gated_delta"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "agreement (T=256)" in proc.stdout
    rows = _table_rows(proc.stdout, "T")
    assert [r[:2] for r in rows] == [["256", "forward"], ["256", "fwd+bwd"]]
