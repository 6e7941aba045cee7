"""Smoke test of bench/: every script's --quick mode runs end to end and prints its markdown table.

No timing is asserted (benchmarks fail only on errors). What is checked: each script produces the table rows it
promises, with finite positive measurements, and the gated delta benchmark's own agreement check against
transformers' torch implementation passes (it raises otherwise). Nothing is appended to bench/RESULTS.md.
"""

import json
import math
import re
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


@pytest.mark.slow
def test_attention_quick(capsys):
    import bench_attention

    all_results = bench_attention.main(["--quick"])
    out = capsys.readouterr().out
    rows = _table_rows(out, "T")
    assert len(rows) == 2 and all(r[0] == "256" for r in rows)  # one time table, one memory table
    cfg, summary = all_results["smollm2"]
    time_v, mem_v = summary[("fwdbwd", 256)]
    assert set(time_v) == set(mem_v) == set(bench_attention.VARIANTS)
    # The stack average really mixes the measured blocks: 11 of 30 layers carry the 1-FA block, and the variant's
    # memory is that mixture of the blocks' compiled memory as printed per block (to the printed 0.1 MiB).
    assert bench_attention.stack_weights(cfg)["HydraHead 7:1"] == pytest.approx({"1-FA": 11 / 30, "all-LA": 19 / 30})
    line = next(x for x in out.splitlines() if x.strip().startswith("[smollm2 fwdbwd T=256]"))
    block_mib = {b: float(m) for b, m in re.findall(r"([\w-]+): [\d.]+ \w?s / ([\d.]+) MiB", line)}
    mixed = 11 / 30 * block_mib["1-FA"] + 19 / 30 * block_mib["all-LA"]
    assert mem_v["HydraHead 7:1"] / 2**20 == pytest.approx(mixed, abs=0.1), (line, mem_v)
    assert mem_v["teacher"] / 2**20 == pytest.approx(block_mib["teacher"], abs=0.05)


@pytest.mark.slow
def test_decode_quick(capsys):
    import bench_decode

    per_token = bench_decode.main(["--quick"])
    out = capsys.readouterr().out
    rows = _table_rows(out, "context")
    assert [r[0] for r in rows] == ["256", "512"]
    # cache_bytes (analytic) and the real pytree agree to the byte for the three models (columns 6/7, 8/9, 10/11).
    assert all(r[6] == r[7] and r[8] == r[9] and r[10] == r[11] for r in rows)
    # What the students' caches are for: smaller than the teacher's, and more so as the context grows (their GDN
    # states and windows are constant, only their few FA groups' keys and values grow); the streaming student's
    # window adds a constant, so its ratio stays below the pure GDN student's.
    gdn_ratio = [float(r[12].rstrip("x")) for r in rows]
    streaming_ratio = [float(r[13].rstrip("x")) for r in rows]
    assert 1 < gdn_ratio[0] < gdn_ratio[1], gdn_ratio
    assert 1 < streaming_ratio[0] < streaming_ratio[1], streaming_ratio
    assert all(s < g for s, g in zip(streaming_ratio, gdn_ratio)), (streaming_ratio, gdn_ratio)
    assert set(per_token) == {256, 512}


@pytest.mark.slow
def test_train_step_quick(capsys):
    import bench_train_step

    tps = bench_train_step.main(["--quick", "--remat", "both"])
    out = capsys.readouterr().out
    rows = _table_rows(out, "stage")
    assert [r[0] for r in rows] == [
        f"stage {s}{r}" for s in ("1 align", "2 distil", "3 long") for r in ("", " (remat)")
    ]
    assert set(tps) == {f"{k}{r}" for k in ("align", "distil", "long") for r in ("", ":remat")}
    # Rematerialisation recomputes the same forward pass: each stage's loss on its batch is the same with it.
    loss = {r[0]: r[7] for r in rows}
    for stage in ("1 align", "2 distil", "3 long"):
        assert loss[f"stage {stage}"] == loss[f"stage {stage} (remat)"], loss


@pytest.mark.slow
def test_segments_quick(capsys):
    import bench_segments

    ratios = bench_segments.main(["--quick"])
    assert set(ratios) == {("forward", 512), ("fwd+bwd", 512)}
    rows = _table_rows(capsys.readouterr().out, "T")
    assert len(rows) == 2
    for row in rows:
        # the packed row really holds several documents (~64-token ones in 512), and each ratio printed is the
        # one returned: unmasked time / the call's time
        assert int(row[1]) >= 2, row
        ratio = ratios[(row[2], 512)]
        assert float(row[5].rstrip("x")) == pytest.approx(ratio["one doc"], abs=0.006), row
        assert float(row[7].rstrip("x")) == pytest.approx(ratio["packed"], abs=0.006), row


@pytest.mark.slow
def test_context_parallel_quick(capsys):
    """sequence=8 against 1 on the 8 test devices: memory, time and collective bytes of every layer, and the
    collective count read from the HLO is really there (the split layer moves bytes; one device moves none)."""
    import bench_context_parallel

    results = bench_context_parallel.main(["--quick"])
    rows = _table_rows(capsys.readouterr().out, "T")
    assert [r[1] for r in rows] == ["teacher", "1-FA", "all-LA", "7:1"]
    one, split = results[512]
    for kind in ("teacher", "1-FA", "all-LA", "7:1"):
        # what the split exists for: each device holds less (compiled memory, measured 1.14-1.73x less at T=512)
        assert 0 < split[kind]["mem"] < one[kind]["mem"], kind
        assert one[kind]["bytes"] == 0 and split[kind]["bytes"] > 0, kind
    # By hand: the teacher layer gathers every device's keys and values, 2 · T · 3 KV heads · 64 dims · 4 bytes,
    # of which each device receives the 7/8 it does not hold (the backward's reduce-scatter sends as much back).
    gathered = 7 / 8 * 2 * 512 * 3 * 64 * 4
    assert split["teacher"]["by_op"]["all-gather"] == split["teacher"]["by_op"]["reduce-scatter"] == gathered


@pytest.mark.slow
@pytest.mark.usefixtures("libtpu")
def test_gated_delta_tpu_quick(tmp_path, capsys):
    """The TPU compile benchmark at T = 1K, 2 heads: every kernel's grid has B·H·N/P = 1·2·16/8 = 4 steps, and each
    kernel's scoped VMEM comes from the compiled program."""
    import bench_gated_delta_tpu

    bench_gated_delta_tpu.main(["--quick", "--json", str(tmp_path / "rows.json")])
    rows = json.loads((tmp_path / "rows.json").read_text())
    kernels = {f"gated_delta_{n}" for n in ("state", "output", "dv_local", "dstate", "grads")}
    assert len(rows) == 1 and rows[0]["grid_steps"] == {name: 4 for name in kernels}
    assert set(rows[0]["vmem_kib"]) == kernels and rows[0]["temp_mib"] < rows[0]["peak_mib"]
    assert len(_table_rows(capsys.readouterr().out, "chunks per step")) == 1


def test_collective_bytes_of_hand_written_hlo():
    """Bytes sent by op (all-gather: result − operand; all-reduce over a group of 2: 2·(1/2)·operand; permute:
    operand), an async start counted once, and a while body weighted by its trip count."""
    import bench_context_parallel

    hlo = """HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %cp = f32[4,8]{1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %cp)
}

ENTRY %main (a: f32[2,8], /*index=1*/b: bf16[16]) -> f32[4,8] {
  %a = f32[2,8]{1,0} parameter(0)
  %b = bf16[16]{0} parameter(1)
  %ag = f32[4,8]{1,0} all-gather(%a), channel_id=2, dimensions={0}
  %ars = bf16[16]{0} all-reduce-start(%b), channel_id=3, replica_groups={{0,1}}, to_apply=%add
  %ard = bf16[16]{0} all-reduce-done(%ars)
  %w = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[4,8]{1,0} get-tuple-element(%w), index=1
}
"""
    got = bench_context_parallel.collective_bytes(hlo)
    assert got == {"all-gather": (4 - 2) * 8 * 4, "all-reduce": 16 * 2, "collective-permute": 3 * 4 * 8 * 4}
    for groups, n in (("mesh['data'=2,'sequence'=4] {'sequence'}", 4), ("[2,4]<=[8]", 4), ("{{0,1,2,3,4,5,6,7}}", 8)):
        line = f"%x = f32[8]{{0}} all-reduce(%a), replica_groups={groups}, to_apply=%add"
        assert bench_context_parallel._group_size(line) == n, groups


@pytest.mark.slow
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


# ---------------------------------------------------------------------------------------------- bench/gpu_check.sh
GPU_CHECK = BENCH / "gpu_check.sh"


def _gpu_check(*args, timeout=600, **env):
    import os

    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(GPU_CHECK), *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )


# The dry run's rows (bench/gpu_check_*.py, mode "dry-run"): each check case in float32 then bfloat16, with the
# outputs and gradients compared; then the benchmark rows of its one shape, every CPU-capable implementation.
DRY_RUN_CHECKS = {
    "flash_attention": ["B=1 T=64 S=64 Hq=2 Hkv=2 D=16 causal", "B=1 T=33 S=70 Hq=4 Hkv=1 D=32 non-causal"],
    "gated_delta": ["B=1 T=50 H=2 K=16 V=16"],
}
DRY_RUN_COMPARED = {
    "flash_attention": {"out", "dq", "dk", "dv"},
    "gated_delta": {"o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"},
}
DRY_RUN_BENCH = {
    "flash_attention": [(d, i) for d in ("fwd packed", "fwd+bwd packed") for i in ("pallas", "pallas_unmasked")]
    + [(d, i) for d in ("fwd", "fwd+bwd") for i in ("pallas", "xla_dense", "xla_blockwise")],
    "gated_delta": [(d, i) for d in ("fwd", "fwd+bwd", "prologue") for i in ("pallas", "xla")],
}


def _printed_row(row: dict) -> str:
    """The start of the line ``Report`` prints for a check or benchmark row (bench/_gpu_check.py)."""
    if "case" in row:
        return f"[{row['status']:>7}] {row['case']} {row['dtype']}: "
    return f"[  bench] D={row['D']} T={row['T']} {row['direction']:<7} {row['impl']:<10} {row['ms']:.3f} ms"


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    """The whole GPU check on the CPU: every check row of both kernels' dry run present and within its limit against
    the reference, every benchmark row present and timed, GPU peers skipped with a reason, each row printed as it was
    recorded (the reports hold exactly the printed rows, in order), the tiny recipe's three stages run with the Pallas
    kernels (interpret mode) and checked step by step against the XLA run, the summary verdict first, and the
    Markdown + JSON written where asked."""
    import gpu_check_end_to_end as e2e

    out = tmp_path / "results"
    proc = _gpu_check("--dry-run", "--out", str(out))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summary = proc.stdout.split("== finished in", 1)[1].splitlines()[1:]
    assert summary[0] == "GPU CHECK PASSED: 9 checks of flash_attention, gated_delta, end_to_end", summary[:3]
    assert "cudnn skipped: cuDNN attention needs a CUDA GPU" in log
    assert "fla skipped: flash-linear-attention runs on a CUDA GPU only" in log

    data = json.loads((out / "gpu_check.json").read_text())
    assert data["status"] == {"flash_attention": 0, "gated_delta": 0, "end_to_end": 0}
    reports = data["reports"]
    assert list(reports) == ["flash_attention", "gated_delta", "end_to_end"]
    sections = re.split(r"^== (?:flash_attention|gated_delta|end_to_end|finished) ", proc.stdout, flags=re.M)[1:3]
    kernels = {k: reports[k] for k in ("flash_attention", "gated_delta")}
    for (kernel, rep), section in zip(kernels.items(), sections, strict=True):
        expected = [(case, dtype) for case in DRY_RUN_CHECKS[kernel] for dtype in ("float32", "bfloat16")]
        assert [(c["case"], c["dtype"]) for c in rep["checks"]] == expected
        # Every output and gradient compared with the fp32 reference and within its limit: fp32 at the fixed
        # tolerance, bf16 at twice the reference's own bf16 error (positive: the reference itself rounds).
        for c in rep["checks"]:
            assert c["status"] == "ok" and c["bad"] == [], c
            assert set(c["errors"]) == set(c["limits"]) == DRY_RUN_COMPARED[kernel], c
            for name, error in c["errors"].items():
                limit = c["limits"][name]
                assert (limit == 1e-2) if c["dtype"] == "float32" else (0 < limit < 1), c
                assert 0 <= error <= limit, c
        assert [(r["direction"], r["impl"]) for r in rep["bench"]] == DRY_RUN_BENCH[kernel]
        assert all(r["ms"] > 0 and math.isfinite(r["tflops"]) for r in rep["bench"]), rep["bench"]
        # The checks run before the benchmark: the rows as printed, in order, are the report's checks then its rows.
        printed = [line for line in section.splitlines() if line.startswith("[")]
        rows = rep["checks"] + rep["bench"]
        assert len(printed) == len(rows), printed
        for line, row in zip(printed, rows):
            assert line.startswith(_printed_row(row)), (line, row)
        assert json.loads((out / f"{kernel}.json").read_text()) == rep
    # The Markdown table's ratio column is peer time / Pallas time of the JSON rows.
    fa = {(r["direction"], r["impl"]): r["ms"] for r in reports["flash_attention"]["bench"]}
    md = (out / "gpu_check.md").read_text()
    ratio = fa[("fwd", "xla_blockwise")] / fa[("fwd", "pallas")]
    fwd_line = next(line for line in md.splitlines() if line.startswith("| 16 | 64 |") and "| fwd |" in line)
    assert fwd_line.rstrip(" |").endswith(f"{ratio:.2f}x"), fwd_line
    assert (out / "flash_attention.md").exists() and (out / "gated_delta.md").exists()
    # End to end: one row per stage of the tiny recipe, each comparing the per-step loss and gradient-norm curves of
    # the Pallas (interpret-mode) run with the XLA run's, in float32, within the stated limit.
    e2e_rep = reports["end_to_end"]
    assert [c["case"] for c in e2e_rep["checks"]] == [f"tiny {s}" for s in e2e.STAGE_DIRS]
    for c in e2e_rep["checks"]:
        assert c["status"] == "ok" and c["dtype"] == "float32" and set(c["errors"]) == {"loss", "grad_norm"}, c
        assert all(
            c["limits"][n] == e2e.F32_STEP_LIMIT and 0 <= c["errors"][n] <= e2e.F32_STEP_LIMIT for n in c["errors"]
        )
    # The switches reached the kernels: the device run ran both in interpret mode (the part checks its log too).
    assert "flash_attention: implementation='pallas_gpu' on cpu runs the Pallas kernel in interpret mode" in log
    # Speed rows of every stage: tokens/s is B·T over the median step; no MFU without a known peak (a CPU).
    rows = {r["stage"]: r for r in e2e_rep["bench"]}
    assert list(rows) == list(e2e.STAGE_DIRS)
    for r in rows.values():
        assert r["mfu"] is None and r["steps_timed"] == e2e.STEPS["dry-run"] - e2e.TIMED_FROM_STEP + 1, r
        assert r["tokens_per_s"] == pytest.approx(r["B"] * r["T"] / (r["ms"] / 1e3)), r
        assert r["tflops"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 1e12), r
    assert (rows["stage1_align"]["T"], rows["stage3_long"]["T"]) == (32, 64)  # configs/tiny.py's rows
    assert "MFU n/a: no bf16 peak is known for 'cpu'" in log
    assert "| tiny | stage2_distil | 4x32 | float32 |" in md


def test_gpu_check_report_is_rewritten_after_every_row(tmp_path):
    """A kernel script killed at its deadline keeps what it measured: ``Report`` rewrites <kernel>.json and .md
    after every check, failed check, benchmark row and note (the dry run only sees the final files)."""
    import _gpu_check as gpu_check_lib
    import numpy as np

    report = gpu_check_lib.Report("gated_delta", "dry-run", tmp_path)

    def on_disk():
        return json.loads((tmp_path / "gated_delta.json").read_text()), (tmp_path / "gated_delta.md").read_text()

    want = np.ones(4)
    assert report.check("case a", "float32", ["o"], [want], [want])
    saved, md = on_disk()
    assert [(c["case"], c["status"]) for c in saved["checks"]] == [("case a", "ok")] and "| case a |" in md
    assert not report.check("case b", "float32", ["o"], [2 * want], [want])  # relative error 1
    saved, md = on_disk()
    assert [(c["case"], c["status"], c["bad"]) for c in saved["checks"]][1] == ("case b", "fail", ["o"])
    assert "**o 1.0e+00/1.0e-02**" in md
    report.check_error("case c", "bfloat16", RuntimeError("no lowering\nsecond line"))
    assert on_disk()[0]["checks"][2]["error"] == "RuntimeError: no lowering"
    report.bench_row(D=16, T=64, B=1, H=2, direction="fwd", impl="pallas", ms=2.0, tflops=0.5)
    saved, md = on_disk()
    assert saved["bench"] == [dict(D=16, T=64, B=1, H=2, direction="fwd", impl="pallas", ms=2.0, tflops=0.5)]
    assert "2.00 (0)" in md
    report.note("row (32, 128) skipped: time budget")
    saved, md = on_disk()
    assert saved["notes"] == ["row (32, 128) skipped: time budget"] and "- row (32, 128) skipped" in md
    assert len(saved["checks"]) == 3 and len(saved["bench"]) == 1


def test_gpu_check_install_plan_and_usage_errors(tmp_path):
    import jax

    out = tmp_path / "never-created"
    plan = _gpu_check("--print-install-plan", "--cuda", "12", "--out", str(out), timeout=60)
    assert plan.returncode == 0, plan.stderr
    # The GPU venv gets the JAX this checkout runs (its kernels are tested against it), and exact pins of the peers.
    pins = rf"jax\[cuda{{}}\]=={re.escape(jax.__version__)} torch==\d+\.\d+\.\d+ fla-core==\d+\.\d+\.\d+"
    assert re.search(pins.format(12), plan.stdout), plan.stdout
    # torch 2.10 pins a cuFFT older than the one jax-cuda12 was built with; JAX would refuse to start with it.
    assert "then, --no-deps: nvidia-cufft-cu12==11.4.1.4" in plan.stdout
    plan13 = _gpu_check("--print-install-plan", "--cuda", "13", timeout=60)
    assert re.search(pins.format(13), plan13.stdout) and "--no-deps" not in plan13.stdout, plan13.stdout
    assert not out.exists()  # the plan changes nothing
    for bad, message in ((["--cuda", "11"], "--cuda takes 12 or 13"), (["--budget", "soon"], "whole seconds")):
        proc = _gpu_check(*bad, timeout=60)
        assert proc.returncode == 64 and message in proc.stderr, (bad, proc.stderr)
    proc = _gpu_check("--frobnicate", timeout=60)
    assert proc.returncode == 64 and "unknown argument '--frobnicate'" in proc.stderr


def test_gpu_check_limits_flas_autotuning(monkeypatch):
    """fla's kernels (here a stand-in module of autotuned Triton kernels, one under triton.heuristics as fla
    writes them) keep at most 4 configurations each, evenly spaced in their lists; other modules are untouched."""
    import types

    import triton
    import triton.language as tl

    sys.path.insert(0, str(BENCH))
    import gpu_check_gated_delta as gd

    def kernel(x, BK: tl.constexpr):
        pass

    configs = [triton.Config({"BK": bk}, num_warps=w) for bk in (16, 32, 64) for w in (1, 2, 4)]  # 9
    tuned = triton.autotune(configs=list(configs), key=[])(triton.jit(kernel))
    wrapped = triton.heuristics({"BK": lambda args: 16})(
        triton.autotune(configs=list(configs[:5]), key=[])(triton.jit(kernel))
    )
    small = triton.autotune(configs=list(configs[:3]), key=[])(triton.jit(kernel))
    other = triton.autotune(configs=list(configs), key=[])(triton.jit(kernel))
    monkeypatch.setitem(sys.modules, "fla.ops.stand_in", types.SimpleNamespace(a=tuned, b=wrapped, c=small, d=tuned))
    monkeypatch.setitem(sys.modules, "not_fla", types.SimpleNamespace(e=other))
    assert gd.limit_autotuning(4) == (4 + 4 + 3, 9 + 5 + 3)  # the same autotuner twice counts once
    assert tuned.configs == [configs[i] for i in (0, 3, 5, 8)]
    assert wrapped.fn.configs == [configs[i] for i in (0, 1, 3, 4)]
    assert small.configs == configs[:3] and other.configs == configs


def test_gpu_check_adds_the_kept_fla_wheel_on_an_offline_machine(tmp_path):
    """A lent GPU box reaches no registry: the fla peer (and the pipeline's grain and ml-collections, where the
    machine's Python lacks them) comes from wheels kept by --fetch-wheels (here a stand-in fla wheel, built on the
    spot), unpacked into a folder on PYTHONPATH for the machine's own Python."""
    import zipfile

    wheels = tmp_path / "gpu" / "wheels"
    wheels.mkdir(parents=True)
    dist = "fla_core-0.0.1.dist-info"
    with zipfile.ZipFile(wheels / "fla_core-0.0.1-py3-none-any.whl", "w") as whl:
        whl.writestr("fla/__init__.py", "__version__ = 'stand-in'\n")
        whl.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: fla-core\nVersion: 0.0.1\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")
    functions = BENCH / "gpu_check.sh"
    script = (
        f'source <(sed -n "/^WHEELS_PINNED=/,/^has_gpu_jax/p" {functions}); '
        f"GPU_DIR={tmp_path / 'gpu'}; WHEELS={wheels}; PYTHONPATH=; add_offline_wheels {sys.executable}; "
        f"{sys.executable} -c 'import fla; print(fla.__version__)'"
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fla added from" in proc.stdout and proc.stdout.strip().endswith("stand-in"), proc.stdout


def _report(kernel, checks):
    return {"kernel": kernel, "mode": "full", "out": "", "checks": checks, "bench": [], "notes": [], "info": {}}


def test_gpu_check_summary_names_failures_first_and_sets_the_exit_code(tmp_path, capsys):
    import json

    import _gpu_check

    ok = {"case": "c0", "dtype": "float32", "status": "ok", "errors": {"o": 1e-6}, "limits": {"o": 5e-3}, "bad": []}
    bad = {**ok, "case": "c1", "dtype": "bfloat16", "status": "fail", "errors": {"o": 0.3}, "bad": ["o"]}
    skipped = {"case": "c2", "dtype": "float32", "status": "not run", "error": "time budget", "bad": []}
    write = lambda kernel, checks: (tmp_path / f"{kernel}.json").write_text(json.dumps(_report(kernel, checks)))

    write("flash_attention", [ok, bad])
    write("gated_delta", [ok])
    assert _gpu_check.summarize(tmp_path, {"flash_attention": 1, "gated_delta": 0}) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "GPU CHECK FAILED (1): flash_attention c1 bfloat16"

    write("flash_attention", [ok, skipped])  # nothing failed, but not everything ran
    assert _gpu_check.summarize(tmp_path, {"flash_attention": 0, "gated_delta": 0}) == 2
    assert capsys.readouterr().out.startswith("GPU CHECK INCOMPLETE: 1 checks not run")

    (tmp_path / "gated_delta.json").unlink()  # a script killed by its timeout writes nothing
    write("flash_attention", [ok])
    assert _gpu_check.summarize(tmp_path, {"flash_attention": 0, "gated_delta": 124}) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert "gated_delta: script exited 124 (timed out)" in first and "gated_delta: no report written" in first
    assert json.loads((tmp_path / "gpu_check.json").read_text())["verdict"] == first


def test_gpu_check_error_limits(tmp_path):
    """fp32 rows are held to F32_TOLERANCE; bf16 rows to 2x the baseline's own error against the same oracle."""
    import _gpu_check
    import numpy as np

    want = np.linspace(1.0, 2.0, 100)
    rep = _gpu_check.Report("gated_delta", "full", tmp_path)
    tol = _gpu_check.F32_TOLERANCE
    assert rep.check("a", "float32", ["o"], [want * (1 + 0.9 * tol)], [want])  # relative error 0.9 tol
    assert not rep.check("b", "float32", ["o"], [want * (1 + 1.1 * tol)], [want])
    base = want * (1 + 1e-2)  # the reference's own bf16 error: 1e-2
    assert rep.check("c", "bfloat16", ["o"], [want * (1 - 1.9e-2)], [want], [base])
    assert not rep.check("d", "bfloat16", ["o"], [want * (1 + 2.1e-2)], [want], [base])
    assert not rep.check("e", "float32", ["o"], [want * np.nan], [want])  # NaN never passes
    assert rep.failures() == ["b float32 (o)", "d bfloat16 (o)", "e float32 (o)"]
    assert rep.checks[2]["limits"]["o"] == pytest.approx(2e-2)


def test_gated_delta_flop_count_by_hand():
    import gpu_check_gated_delta as gd

    # One chunk of 64 tokens, K = V = 64: 64³·(6 + 4 + 6) + 64³/3 (module docstring's per-chunk sum).
    assert gd.gdn_flops_fwd(1, 64, 1, 64, 64) == pytest.approx(64**3 * (16 + 1 / 3))
    # A ragged length pays for its last partial chunk; batch and heads multiply.
    assert gd.gdn_flops_fwd(2, 65, 3, 64, 64) == pytest.approx(2 * 3 * 2 * 64**3 * (16 + 1 / 3))
    # K = 128, V = 64: 6C²K + 4C²V + 6CKV + C³/3 with C = 64.
    c = 64
    assert gd.gdn_flops_fwd(1, 64, 1, 128, 64) == pytest.approx(
        6 * c * c * 128 + 4 * c * c * 64 + 6 * c * 128 * 64 + c**3 / 3
    )


def test_end_to_end_flop_count_by_hand():
    """F = 4·N_S + 2·N_train + 3·A_S + (2·N_T + A_T) per stage (bench/gpu_check_end_to_end.py), on a made-up model
    of 2 layers x 4 heads of D = 8 (layer 0 all LA, layer 1 all FA), with a tied output head."""
    from types import SimpleNamespace

    import gpu_check_end_to_end as e2e
    import gpu_check_gated_delta as gd

    cfg = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=8, num_layers=2, tie_word_embeddings=True)
    q, z = ("layers", "self_attn", "q_proj", "kernel"), ("layers", "self_attn", "gdn", "z_proj", "kernel")
    up, head = ("layers", "mlp", "up_proj", "kernel"), ("embed_tokens", "embedding")
    fm = e2e.FlopModel(cfg, (0, 4), 16, {q: 2 * 1024, z: 2 * 1000, up: 2 * 2048, head: 128 * 32})
    # Per token at T = 32: the FA layer's 4 heads 2·T·D each, the LA layer's 4 heads the chunked rule's FLOPs / T.
    a_s, a_t = 4 * 2 * 32 * 8 + 4 * gd.gdn_flops_fwd(1, 32, 1, 8, 8, 16) / 32, 8 * 2 * 32 * 8
    stacked_gdn = 1000  # the stacked GDN weight (2 x 1000) at the 1/2 of heads that are LA
    attention, every = 2 * (2048 + stacked_gdn), 2 * (2048 + stacked_gdn + 4096 + 128 * 32)
    teacher_layers = 2 * (2048 + 4096)  # no GDN weights
    stage = dict(seq_len=32, kl_weight=0.0)
    align = e2e.stage_flops(fm, "align", stage, {z})
    assert align == pytest.approx(2 * attention + 2 * stacked_gdn + 3 * a_s + teacher_layers + a_t)
    everything = set(fm.weights)
    assert e2e.stage_flops(fm, "distil", stage, everything) == pytest.approx(
        3 * every + 3 * a_s + teacher_layers + 2 * 4096 + a_t
    )
    assert e2e.stage_flops(fm, "long", stage, everything) == pytest.approx(3 * every + 3 * a_s)
    with_kl = e2e.stage_flops(fm, "long", dict(stage, kl_weight=0.5), everything)
    assert with_kl == pytest.approx(3 * every + 3 * a_s + teacher_layers + 2 * 4096 + a_t)
    assert e2e.peak_flops("NVIDIA H200") == e2e.peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert e2e.peak_flops("NVIDIA H100 PCIe") == 756e12 and e2e.peak_flops("cpu") is None


def _fake_run(folder, run, kind, curves, rc=0, log="done"):
    """A finished run of the end-to-end part: its metrics.jsonl (per-step loss, grad_norm of every stage) and log."""
    import gpu_check_end_to_end as e2e

    job = e2e.Job("m", run, kind, folder / run, "cpu", rc=rc)
    job.workdir.mkdir(parents=True)
    rows = [
        {"stage": stage, "step": i + 1, "loss": float(loss), "grad_norm": float(gn), "step_time_s": 0.1}
        for stage in e2e.STAGE_DIRS
        for i, (loss, gn) in enumerate(zip(*curves))
    ]
    rows.insert(0, {"stage": e2e.STAGE_DIRS[0], "step": 0, "split": "heldout", "loss": 9.0})  # not a step row
    (job.workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (job.folder / "log.txt").write_text(log + "\n")
    return job


def test_end_to_end_compares_the_curves_and_reports_failed_and_missing_runs(tmp_path):
    """bf16 device curves pass within 2x the CPU bf16 run's own error against the f32 run and fail past it; a run
    that crashed fails every stage with its last log line; a run not started for time is "not run", never a pass."""
    import _gpu_check
    import gpu_check_end_to_end as e2e
    import numpy as np

    kinds = e2e.RUNS["gpu"]
    want = (np.array([3.0, 2.5, 2.0]), np.array([1.0, 0.8, 0.7]))
    scaled = lambda f: tuple(c * f for c in want)  # noqa: E731

    def report_for(name, device, baseline_why=""):
        jobs = [
            _fake_run(tmp_path / name, "device", kinds["device"], *device),
            _fake_run(tmp_path / name, "oracle", kinds["oracle"], want),
            _fake_run(tmp_path / name, "baseline", kinds["baseline"], scaled(1 + 1e-3)),
        ]
        jobs[2].why_not = baseline_why
        rep = _gpu_check.Report("end_to_end", "full", tmp_path / name / "out", table="end_to_end")
        e2e.compare(rep, {j.name: j for j in jobs}, "m", 3)
        return rep

    ok = report_for("ok", (scaled(1 - 1.9e-3),))
    assert [c["status"] for c in ok.checks] == ["ok"] * 3 and ok.checks[0]["dtype"] == "bfloat16"
    assert ok.checks[0]["limits"]["loss"] == pytest.approx(2e-3)
    bad = report_for("bad", (scaled(1 + 2.1e-3),))
    assert [c["status"] for c in bad.checks] == ["fail"] * 3 and bad.checks[0]["bad"] == ["loss", "grad_norm"]
    crashed = report_for("crashed", (want, 1, "Traceback ...\nValueError: boom"))
    assert all(c["status"] == "fail" and "m/device exited 1: ValueError: boom" in c["error"] for c in crashed.checks)
    late = report_for("late", (want,), baseline_why="time budget (10 s left, ~60 s needed)")
    assert [c["status"] for c in late.checks] == ["not run"] * 3 and "m/baseline: time budget" in late.checks[0][
        "error"
    ]
    assert late.not_run() and not late.failures()
    # A dry-run device run (the CPU) whose log shows the kernels were not run as Pallas fails, whatever its curves.
    dry = _fake_run(tmp_path / "dry", "device", e2e.RUNS["dry-run"]["device"], want, log="no kernel warnings")
    oracle = _fake_run(tmp_path / "dry", "oracle", e2e.RUNS["dry-run"]["oracle"], want)
    rep = _gpu_check.Report("end_to_end", "dry-run", tmp_path / "dry" / "out", table="end_to_end")
    e2e.compare(rep, {dry.name: dry, oracle.name: oracle}, "m", 3)
    assert all(c["status"] == "fail" and "did not run the Pallas" in c["error"] for c in rep.checks)


def test_end_to_end_recipes_validate(tmp_path):
    """Every run the GPU day will start is a valid RunConfig, at the shapes the kernels take, with the switches on."""
    import gpu_check_end_to_end as e2e

    from hydrahead_jax.run_config import RunConfig

    for model in e2e.MODELS["full"]:
        recipe = e2e.RECIPES[model]("full", tmp_path / model)
        for kind in e2e.RUNS["gpu"].values():
            cfg = RunConfig.from_recipe(e2e.run_recipe(recipe, kind, e2e.STEPS["full"]))
            assert (cfg.hybrid.attention_implementation, cfg.hybrid.gdn_implementation) == (kind.attention, kind.gdn)
            assert not cfg.data.mask_documents and cfg.stage2.steps == e2e.STEPS["full"]
            head_dim = cfg.teacher.model.head_dim if cfg.teacher.model else 16  # the reproduction teacher's
            assert (
                head_dim % 8 == 0
                and (cfg.teacher.model.dtype if cfg.teacher.model else cfg.teacher.dtype) == kind.dtype
            )
            for stage in (cfg.stage1, cfg.stage2, cfg.stage3):
                assert stage.seq_len % cfg.hybrid.gdn_chunk_size == 0 and stage.heldout_rows == 0
    tiny = RunConfig.from_recipe(e2e.run_recipe(e2e.tiny_recipe("full", tmp_path), e2e.RUNS["gpu"]["device"], 8))
    assert (tiny.teacher.model.head_dim, tiny.hybrid.gdn_chunk_size, tiny.stage3.seq_len) == (64, 64, 1024)
    lines = (tmp_path / "reproduction" / "mqar.jsonl").read_text().splitlines()
    assert len(lines) == e2e.MQAR_DOCS and all(json.loads(line)["text"] for line in lines)


def test_gated_delta_peer_gets_the_same_bits():
    """The fla peer's inputs are the JAX arrays bit for bit (bf16 included), so both sides time the same problem."""
    import gpu_check_gated_delta as gd
    import jax.numpy as jnp
    import numpy as np
    import torch

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 5)), jnp.float32)
    for dtype, torch_dtype in ((jnp.bfloat16, torch.bfloat16), (jnp.float32, torch.float32)):
        t = gd.to_torch(x.astype(dtype)[:, 1:], device="cpu")  # a strided slice: copied contiguous
        assert t.dtype == torch_dtype and tuple(t.shape) == (2, 2, 5)
        np.testing.assert_array_equal(t.float().numpy(), np.asarray(x.astype(dtype)[:, 1:].astype(jnp.float32)))


@pytest.mark.slow
def test_gated_delta_peer_calls_on_cpu(tmp_path):
    """The fla-peer code path (argument names, initial/final state, backward, agreement check) on the CPU, with
    transformers' torch chunked rule standing in for fla: it takes fla's arguments and computes the same function."""
    import gpu_check_gated_delta as gd
    import jax
    import numpy as np
    from _gpu_check import Report
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as rule

    case = (1, 70, 2, 16, 16)
    report = Report("gated_delta", "dry-run", tmp_path)
    assert gd.check_fla_agreement(report, rule, case, device="cpu")
    assert report.notes[-1].startswith(f"fla agrees with the reference at (B,T,H,K,V)={case}")
    # Gradients: both cotangents (output and final state) reach the peer, and a second call does not accumulate.
    args, cot = gd.make_inputs(*case)
    peer = gd.torch_peer(rule, args, cot, device="cpu")
    peer.fwd()
    peer.fwd_bwd()
    peer.fwd_bwd()
    want = jax.jit(gd._fwd_and_grads, static_argnums=0)(gd.gdn("reference"), args, cot)[2:]
    # Measured (f32, 2026-12-03): each gradient within 7.4e-7 of its array's largest entry (q; 1.7e-7 for h0).
    for name, leaf, w in zip(("q", "k", "v", "g", "beta", "h0"), peer.leaves, want):
        w = np.asarray(w)
        np.testing.assert_allclose(leaf.grad.numpy(), w, rtol=0, atol=2.5e-6 * np.abs(w).max(), err_msg=name)
    # A peer computing something else is caught (here: no q/k L2 norm).
    unnormalised = lambda *a, **kw: rule(*a, **{**kw, "use_qk_l2norm_in_kernel": False})
    assert not gd.check_fla_agreement(report, unnormalised, case, device="cpu")
    assert "DISAGREES" in report.notes[-1]


@pytest.mark.slow
def test_long_context_quick(capsys):
    import bench_long_context
    from bench_decode import GDN, STREAMING

    results, longest = bench_long_context.main(["--quick"])
    rows = _table_rows(capsys.readouterr().out, "context")
    assert [(r[0], r[1]) for r in rows] == [(c, m) for c in ("512", "1024") for m in ("teacher", GDN, STREAMING)]
    teacher, gdn, streaming = results["teacher"], results[GDN], results[STREAMING]
    # The quick model: 2 layers x 3 KV groups of head_dim 64, f32; the 7:1 map keeps 1 group FA, so 5 LA groups,
    # whose streaming window holds keys and values for 4 sinks + 64 recent tokens: 2 * 68 * 5 * 64 * 4 bytes more
    # than the pure GDN student's cache, whatever the context.
    for ctx in (512, 1024):
        assert streaming[ctx]["cache_bytes"] - gdn[ctx]["cache_bytes"] == 2 * 68 * 5 * 64 * 4
        assert teacher[ctx]["cache_bytes"] == 2 * 2 * 3 * ctx * 64 * 4  # k and v, 2 layers, 3 groups
        assert gdn[ctx]["cache_bytes"] < streaming[ctx]["cache_bytes"] < teacher[ctx]["cache_bytes"]
        assert all(r[ctx]["decode_s_per_token"] > 0 and r[ctx]["prefill_s"] > 0 for r in results.values())
    # Only the FA groups' cache grows: the students' ratio to the teacher rises with the context.
    for student in (gdn, streaming):
        ratios = [teacher[c]["cache_bytes"] / student[c]["cache_bytes"] for c in (512, 1024)]
        assert 1 < ratios[0] < ratios[1], ratios
    # The longest context found fits the budget (256 MiB in --quick) by its own compile.
    for r in longest.values():
        assert r["tokens"] and r["need_bytes"] <= 256 * 2**20
