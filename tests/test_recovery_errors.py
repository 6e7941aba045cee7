"""Input errors as users meet them (issue 18, items 6-8): train.py and the selection CLI print ONE ``error:``
line naming the key or file and the fix, before any stage works, and a run refused by validation does not
claim its workdir."""

import os
import subprocess
import sys

import pytest
from oracle import save_tiny_hf_model
from train_helpers import ROOT, run_train


def _one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr  # no traceback, no Orbax noise after
    assert "[stage1_align]" not in proc.stdout  # no stage started
    return lines[0]


def test_a_batch_the_mesh_cannot_split_is_refused_before_any_stage(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path / "w")]
        + ["--config.mesh.data=8"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = _one_error_line(proc)
    assert "config.stage1.batch_size=4 is not divisible by the 8 devices of the data axis" in line
    assert "--config.stage1.batch_size=8" in line
    assert not (tmp_path / "w" / "run_config.json").exists()


@pytest.fixture(scope="module")
def truncated_teacher(tmp_path_factory):
    folder = save_tiny_hf_model(tmp_path_factory.mktemp("teacher") / "llama", "llama")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 1000])
    return folder


@pytest.mark.parametrize(
    "case",
    ["missing teacher", "truncated safetensors", "workdir is a file", "missing config", "head map is a directory"],
)
def test_bad_inputs_give_one_error_line_naming_them(tmp_path, truncated_teacher, case):
    workdir, args, config = tmp_path / "w", [], "tiny.py"
    pretrained = ["--config.mesh.fsdp=1", "--config.mesh.tensor=1", "--config.data.source=copy"]
    pretrained += [f"--config.stage{n}.synthetic_rate=0" for n in (1, 2, 3)]
    if case == "missing teacher":
        config, args = "smollm2_hydrahead.py", [f"--config.teacher.source={tmp_path / 'nope'}", *pretrained]
        want = f"config.teacher.source='{tmp_path / 'nope'}' does not load"
    elif case == "truncated safetensors":
        config, args = "smollm2_hydrahead.py", [f"--config.teacher.source={truncated_teacher}", *pretrained]
        args.append("--config.selection.method=layerwise")
        want = f"config.teacher.source='{truncated_teacher}' does not load"
    elif case == "workdir is a file":
        workdir.write_text("")
        want = f"--workdir {workdir} is not a directory"
    elif case == "missing config":
        config = "no_such_recipe.py"
        want = "no_such_recipe.py"
    else:
        (tmp_path / "maps").mkdir()
        args = ["--config.selection.method=given", f"--config.selection.head_map_path={tmp_path / 'maps'}"]
        want = f"config.selection.head_map_path='{tmp_path / 'maps'}' is a directory"
    line = _one_error_line(run_train(workdir, *args, config=config, timeout=300))
    assert want in line, line
    assert not (workdir / "run_config.json").exists() if workdir.is_dir() else True


def test_a_truncated_run_config_json_is_named(tmp_path):
    (tmp_path / "run_config.json").write_text('{"config_hash": "ab')
    line = _one_error_line(run_train(tmp_path, "--until_stage=select", timeout=300))
    assert f"{tmp_path / 'run_config.json'} is damaged" in line and "--force_new" in line


def test_a_stage_order_error_is_one_line_without_orbax_noise(tmp_path):
    line = _one_error_line(run_train(tmp_path, "--only_stage=distil", timeout=300))
    assert "has not finished" in line


def test_a_run_refused_by_validation_does_not_claim_its_workdir(tmp_path):
    line = _one_error_line(run_train(tmp_path, "--config.selection.ratio=abc", timeout=300))
    assert "config.selection" in line and "ratio 'abc'" in line
    assert not (tmp_path / "run_config.json").exists()  # the corrected command is not "another config"


def test_the_selection_cli_gives_one_error_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hydrahead_jax.selection", "--source", str(tmp_path / "nope"), "--out", str(tmp_path)],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert str(tmp_path / "nope") in lines[0]
