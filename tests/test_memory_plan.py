"""Compiled memory per device: the trainer's report, the compile-only plan, and the fit check's suggestion."""

import dataclasses
import json
import sys

import pytest
from train_helpers import ROOT, tiny_config

from hydrahead_jax.run_config import RunConfig
from hydrahead_jax.training import memory

GiB = memory.GiB


def test_check_fits_suggests_the_smallest_micro_batches_that_fit():
    # peak = 2 + 1 − 1 + 12 = 14 GiB; fixed part 2 GiB; temporaries 12 GiB at M=1.
    usage = memory.StepMemory(arguments=2 * GiB, outputs=GiB, aliased=GiB, temporaries=12 * GiB)
    assert usage.peak == 14 * GiB
    memory.check_fits(usage, 14 * GiB, where="config.stage2", micro_batches=1, batch_size=32, data_parallel=4)
    memory.check_fits(usage, None, where="config.stage2", micro_batches=1, batch_size=32, data_parallel=4)
    # 6 GiB: need 2 + 12/M ≤ 6 → M ≥ 3; valid M (32/M rows divisible by 4 devices): 1, 2, 4, 8 → 4.
    with pytest.raises(memory.MemoryBudgetError, match=r"14.00 GiB per device.*6.00 GiB.*micro_batches=4"):
        memory.check_fits(usage, 6 * GiB, where="config.stage2", micro_batches=1, batch_size=32, data_parallel=4)
    # 2.5 GiB: M = 8 (one row per device) gives 3.5 GiB: nothing fits.
    with pytest.raises(memory.MemoryBudgetError, match="one row per device"):
        memory.check_fits(usage, int(2.5 * GiB), where="config.stage2", micro_batches=1, batch_size=32, data_parallel=4)
    assert memory.valid_micro_batches(32, 4) == [1, 2, 4, 8]


@pytest.mark.slow
def test_plan_reports_what_the_trainer_compiles(tiny_train_py_run):
    """train.py (one device) writes each stage's compiled memory; the compile-only plan of the same recipe on a
    one-device mesh gives the same bytes, without weights or data."""
    sys.path.insert(0, str(ROOT / "bench"))
    import jax
    from memory_plan import model_config, plan_head_map

    from hydrahead_jax.hybrid import HeadMap
    from hydrahead_jax.training import sharding as shd

    run = RunConfig.from_recipe(tiny_config())
    cfg = model_config(run, type("A", (), {"shapes": "", "model_config": "", "layers": 0})())
    head_map = HeadMap.load(tiny_train_py_run / "head_map.json", cfg)
    assert head_map.fa_groups == plan_head_map(run, cfg).fa_groups  # layerwise: the plan picks the same map
    mesh = shd.make_mesh(**dataclasses.asdict(run.mesh), devices=jax.devices()[:1])
    for kind, directory in (("align", "stage1_align"), ("distil", "stage2_distil"), ("long", "stage3_long")):
        reported = json.loads((tiny_train_py_run / directory / "memory.json").read_text())
        planned = memory.plan_stage(run, kind, cfg, head_map, mesh).to_dict()
        assert reported["device_limit"] is None  # CPU reports no device memory
        for key in ("arguments", "outputs", "aliased", "temporaries"):
            assert planned[key] == reported[key], (kind, key, planned, reported)


def test_micro_batches_and_row_tiles_shrink_the_planned_step():
    """On 4 devices (data 2 × fsdp 2) with a 4096-token vocabulary, stage 3's temporaries fall with more
    micro-batches and with fewer rows per logits tile (activations and the tile scale with the rows)."""
    import jax

    from hydrahead_jax.training import sharding as shd

    config = tiny_config()
    config.teacher.model.vocab_size = 4096
    config.stage3.batch_size = 16
    config.stage3.loss_chunk = 64
    sys.path.insert(0, str(ROOT / "bench"))
    from memory_plan import model_config, plan_head_map

    run = RunConfig.from_recipe(config)
    cfg = model_config(run, type("A", (), {"shapes": "", "model_config": "", "layers": 0})())
    head_map = plan_head_map(run, cfg)
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=1, devices=jax.devices()[:4])
    base = memory.plan_stage(run, "long", cfg, head_map, mesh)
    micro = memory.plan_stage(run, "long", cfg, head_map, mesh, micro_batches=4)
    config.stage3.loss_chunk_rows = 1
    tiled = memory.plan_stage(RunConfig.from_recipe(config), "long", cfg, head_map, mesh)
    tile = 4 * 64 * 4096 * 4  # the f32 logits of one tile at 4 rows per device
    assert micro.temporaries < base.temporaries - tile, (base, micro)
    assert tiled.temporaries < base.temporaries - tile, (base, tiled)
    assert micro.arguments == base.arguments


@pytest.mark.slow  # bench/memory_plan.py end to end
def test_memory_plan_command_prints_every_stage(tmp_path):
    import subprocess

    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "memory_plan.py"),
            "--config",
            str(ROOT / "configs" / "tiny.py"),
            "--devices",
            "4",
            "--mesh",
            "fsdp=2",
            "--device_memory_gb",
            "1",
            "--stages",
            "align,long",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| stage")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["stage1 align", "stage3 long"], r.stdout
    assert "mesh {'data': 2, 'fsdp': 2, 'sequence': 1, 'tensor': 1}" in r.stdout and rows[1].count("| yes |") == 1
