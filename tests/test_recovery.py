"""Recovery as users meet it (issue 18): train.py in subprocesses on configs/tiny.py, real kills and files.

The NaN stop keeps only states whose own loss was finite and the advised fix (a lower lr) resumes without
--force_new; a negative or non-finite lr is refused before any work."""

import json
import math

import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_helpers import run_train, tiny_config

from hydrahead_jax.config import ConfigError
from hydrahead_jax.run_config import RunConfig


def _logged(workdir, stage="stage1_align"):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["stage"] == stage]


def _saved_steps(stage_dir):
    return sorted(int(p.name) for p in stage_dir.iterdir() if p.name.isdigit())


def test_nan_stop_keeps_a_finite_state_and_a_lower_lr_resumes_without_force_new(tmp_path):
    explode = ["--until_stage=align", "--config.stage1.train=all", "--config.stage1.checkpoint_every=1"]
    proc = run_train(tmp_path, *explode, "--config.stage1.lr=1e30", "--config.stage1.steps=8")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    bad_step = int(proc.stderr.split(" at step ")[1].split(";")[0])
    stage_dir = tmp_path / "stage1_align"
    kept = _saved_steps(stage_dir)
    assert kept and kept[-1] == bad_step - 2
    losses = {r["step"]: r["loss"] for r in _logged(tmp_path)}
    # The kept state is the input of step kept[-1] + 1, whose loss and gradient norm were read and finite.
    assert math.isfinite(losses[kept[-1] + 1])
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(stage_dir / str(kept[-1]) / "model")
    leaves = [np.asarray(x) for x in __import__("jax").tree.leaves(params)]
    assert leaves and all(np.isfinite(x).all() for x in leaves)
    assert max(float(np.abs(x).max()) for x in leaves) < 1e3  # not the exploded state of the next update

    fixed = run_train(tmp_path, *explode, "--config.stage1.lr=1e-3", "--config.stage1.steps=8")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "stage1.lr: 1e+30 -> 0.001" in fixed.stdout
    assert f"resuming from step {kept[-1]}/8" in fixed.stdout
    assert (stage_dir / "DONE").exists()
    assert all(math.isfinite(r["loss"]) for r in _logged(tmp_path) if r["step"] > kept[-1])


@pytest.mark.parametrize("lr", [-1e-3, float("nan"), float("inf"), 0.0])
def test_a_negative_or_non_finite_lr_is_refused_with_the_key(lr):
    recipe = tiny_config()
    recipe.stage2.lr = lr
    with pytest.raises(ConfigError, match=r"config\.stage2\.lr=.*must be a finite number > 0"):
        RunConfig.from_recipe(recipe)
