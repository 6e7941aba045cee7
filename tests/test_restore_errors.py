"""What a failed restore does, on real Orbax checkpoints of the tiny recipe's stage 2 through the real trainer
(issue 34): only damage shown by a step's own files sets that step aside (and the previous one is used); a
checkpoint of another model, or a read that keeps failing, stops the stage with one line and nothing moved; a
passing read error is retried and the run resumes where it stopped."""

import json
import shutil

import orbax.checkpoint as ocp
import pytest
from train_helpers import run_tiny_distil

from hydrahead_jax.training import checkpoint
from hydrahead_jax.training.checkpoint import CheckpointMismatchError, CheckpointReadError
from hydrahead_jax.training.sharding import make_mesh

STAGE = "stage2_distil"


def _mesh():
    import jax

    return make_mesh(1, devices=jax.devices()[:1])


def _tree(directory):
    """Every path under ``directory`` with its size: what "nothing moved" compares."""
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def _losses(workdir):
    return {r["step"]: r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step stage 2 checkpointed at steps 1 (Orbax saves the first), 2 and 4, and its losses."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    run_tiny_distil(workdir, _mesh(), steps=4, checkpoint_every=2)
    stage = workdir / STAGE
    assert sorted(int(p.name) for p in stage.iterdir() if p.name.isdigit()) == [1, 2, 4] and (stage / "DONE").exists()
    return workdir, _losses(workdir)


@pytest.fixture
def copy(finished, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "RESTORE_BACKOFF_S", 0.0)
    workdir = tmp_path / "run"
    shutil.copytree(finished[0], workdir)
    return workdir


@pytest.mark.slow  # the trainer run on a damaged checkpoint: fault injection, the end-to-end tier
def test_a_truncated_array_file_sets_that_step_aside_and_the_previous_one_is_used(finished, copy, capsys):
    data = [p for p in (copy / STAGE / "4" / "model").rglob("*") if p.is_file() and p.parent.name == "d"]
    victim = max(data, key=lambda p: p.stat().st_size)  # the largest array data file of step 4's model
    with open(victim, "r+b") as handle:
        handle.truncate(victim.stat().st_size // 2)
    run_tiny_distil(copy, _mesh(), steps=4, checkpoint_every=2)
    out = capsys.readouterr().out
    assert f"checkpoint step 4 in {copy / STAGE} is damaged" in out and victim.name in out, out
    assert "resuming from step 2/4" in out, out
    assert [p.name.split("-")[0] for p in (copy / STAGE / "corrupt").iterdir()] == ["4"]
    assert (copy / STAGE / "2").is_dir() and (copy / STAGE / "DONE").exists()
    # Steps 3 and 4 retrained from step 2's state: the losses of the uninterrupted run, bit for bit.
    got = _losses(copy)
    assert got[3] == finished[1][3] and got[4] == finished[1][4]


@pytest.mark.slow  # the trainer run on a damaged checkpoint: fault injection, the end-to-end tier
def test_a_checkpoint_of_another_model_width_stops_with_one_line_and_nothing_moved(copy):
    before = _tree(copy)
    with pytest.raises(CheckpointMismatchError) as caught:
        run_tiny_distil(copy, _mesh(), steps=4, checkpoint_every=2, model_changes={"intermediate_size": 48})
    message = str(caught.value)
    assert "\n" not in message
    assert f"checkpoint step 4 in {copy / STAGE} holds another model" in message
    # the stacked MLP kernel of the 2 layers, named by its path
    assert "stored float32[2, 32, 64], this run float32[2, 32, 48]" in message
    assert "--restart_stage=distil" in message
    assert _tree(copy) == before


@pytest.mark.slow  # the trainer run on a damaged checkpoint: fault injection, the end-to-end tier
def test_an_os_error_on_the_first_read_is_retried_and_the_run_resumes_where_it_stopped(finished, copy, monkeypatch):
    original, calls = ocp.CheckpointManager.restore, []

    def flaky(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise OSError(5, "Input/output error (injected)", str(copy / STAGE / "4" / "model"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", flaky)
    # One step more than the finished run: the stage continues from its newest step (restore_latest).
    run_tiny_distil(copy, _mesh(), steps=5, checkpoint_every=2)
    assert len(calls) == 2  # the failed read and its retry
    assert not (copy / STAGE / "corrupt").exists()
    assert sorted(_losses(copy)) == [1, 2, 3, 4, 5] and _losses(copy)[4] == finished[1][4]  # resumed from step 4


@pytest.mark.slow  # the trainer run on a damaged checkpoint: fault injection, the end-to-end tier
def test_a_permanent_os_error_stops_with_the_message_and_nothing_moved(copy, monkeypatch):
    def broken(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied (injected)", str(copy / STAGE / "4" / "model"))

    monkeypatch.setattr(ocp.CheckpointManager, "restore", broken)
    before = _tree(copy)
    with pytest.raises(CheckpointReadError) as caught:  # the finished stage's final checkpoint (restore_model)
        run_tiny_distil(copy, _mesh(), steps=4, checkpoint_every=2)
    message = str(caught.value)
    assert "\n" not in message
    assert f"{copy / STAGE / '4'} could not be read after {checkpoint.RESTORE_ATTEMPTS} attempts" in message
    assert "Permission denied (injected)" in message and "nothing was moved" in message
    assert _tree(copy) == before


@pytest.mark.slow  # the trainer run on a damaged checkpoint: fault injection, the end-to-end tier
def test_a_bug_in_the_restore_code_propagates_unchanged_and_moves_nothing(copy, monkeypatch):
    def buggy(self, *args, **kwargs):
        raise TypeError("restore() got an unexpected keyword argument 'x'")

    monkeypatch.setattr(ocp.CheckpointManager, "restore", buggy)
    before = _tree(copy)
    with pytest.raises(TypeError, match="unexpected keyword"):
        run_tiny_distil(copy, _mesh(), steps=4, checkpoint_every=2)
    assert _tree(copy) == before


@pytest.mark.parametrize(
    "restart, stages, words",
    [
        ("select", ["select", "align"], "choose one of the training stages"),
        ("distil", ["select", "align"], "is not among the stages this run runs"),
    ],
)
def test_a_restart_stage_outside_the_run_is_refused_with_the_fix(restart, stages, words):
    from hydrahead_jax.config import ConfigError
    from hydrahead_jax.training.pipeline import check_restart_stage

    with pytest.raises(ConfigError, match=words):
        check_restart_stage(restart, stages)
    check_restart_stage(None, stages)
    check_restart_stage("align", stages)


@pytest.mark.slow  # a whole stage through the trainer: the end-to-end tier
def test_restart_stage_moves_the_stage_aside_and_trains_it_from_step_0(tmp_path):
    from train_helpers import run_train

    args = ["--until_stage=align", "--config.stage1.steps=2"]
    first = run_train(tmp_path, *args)
    assert first.returncode == 0, first.stdout + first.stderr
    want = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "split" not in r]
    (tmp_path / "metrics.jsonl").unlink()
    again = run_train(tmp_path, *args, "--restart_stage=align")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "[stage1_align] --restart_stage: training it from step 0" in again.stdout
    [aside] = tmp_path.glob("stage1_align.restarted-*")
    assert (aside / "DONE").exists() and (tmp_path / "stage1_align" / "DONE").exists()
    got = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "split" not in r]
    assert [(r["step"], r["loss"]) for r in got] == [(r["step"], r["loss"]) for r in want]  # trained again, the same


# ------------------------------------------------------------------------------------------------ each kind of failure
def _step(tmp_path, state=None):
    """A one-step Orbax checkpoint (a pytree item ``state`` and a JSON item) written here; returns (manager dir,
    target)."""
    import jax
    import jax.numpy as jnp

    state = {"a": jnp.arange(1000.0), "b": {"c": jnp.ones((30, 40))}} if state is None else state
    with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("model", "meta")) as manager:
        manager.save(1, args=ocp.args.Composite(model=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"x": 1})))
        manager.wait_until_finished()
    return tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


def _truncate(path, size):
    with open(path, "r+b") as handle:
        handle.truncate(size)


def _largest_array_file(step):
    return max((p for p in (step / "model").rglob("*") if p.parent.name == "d"), key=lambda p: p.stat().st_size)


DAMAGE = {  # what is done to step 1, and the file the error must name (relative to the step)
    "array file truncated": (lambda s: _truncate(_largest_array_file(s), 100), None),
    "array files garbage": (lambda s: [p.write_bytes(b"\0garbage" * 40) for p in (s / "model").rglob("d/*")], None),
    "OCDBT manifest truncated": (lambda s: _truncate(s / "model" / "manifest.ocdbt", 5), "model/manifest.ocdbt"),
    "OCDBT manifest deleted": (lambda s: (s / "model" / "manifest.ocdbt").unlink(), "model/manifest.ocdbt"),
    "_METADATA truncated": (lambda s: _truncate(s / "model" / "_METADATA", 20), "model/_METADATA"),
    "_METADATA deleted": (lambda s: (s / "model" / "_METADATA").unlink(), "model/_METADATA"),
    "meta JSON truncated": (lambda s: _truncate(s / "meta" / "metadata", 3), "meta/metadata"),
    "meta JSON deleted": (lambda s: (s / "meta" / "metadata").unlink(), "meta/metadata"),
    "model item deleted": (lambda s: shutil.rmtree(s / "model"), "model"),
}


def _restore_one(directory, target):
    step = directory / "1"
    manager = ocp.CheckpointManager(directory, item_names=("model", "meta"))

    def check():
        checkpoint.check_step_files(step, ["model", "meta"], pytree_items=("model",))
        checkpoint.check_matches({"model": checkpoint.stored_metadata(step / "model")}, {"model": target}, where="x")

    args = ocp.args.Composite(model=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
    try:
        return checkpoint.restore_step(step, lambda: manager.restore(1, args=args), check=check)
    finally:
        manager.close()


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_of_a_steps_own_files_is_named_as_such(tmp_path, case):
    directory, target = _step(tmp_path)
    damage, named = DAMAGE[case]
    step = directory / "1"
    victims = sorted(p.name for p in (step / "model").rglob("d/*"))  # the array data files, for the first two
    damage(step)
    with pytest.raises(checkpoint.DamagedCheckpointError) as caught:
        _restore_one(directory, target)
    message = str(caught.value)
    assert str(step / named) in message if named else any(v in message for v in victims), message


def test_a_target_of_other_shapes_or_paths_is_a_mismatch_naming_the_arrays(tmp_path):
    import jax
    import jax.numpy as jnp

    directory, _ = _step(tmp_path)
    other = {"a": jax.ShapeDtypeStruct((1000,), jnp.int32), "b": {"d": jax.ShapeDtypeStruct((30, 40), jnp.float32)}}
    with pytest.raises(CheckpointMismatchError) as caught:
        _restore_one(directory, other)
    assert "model/a: stored float32[1000], this run int32[1000]" in str(caught.value)
    assert "model/b.c: stored, not in this run" in str(caught.value)
    assert "model/b.d: in this run, not stored" in str(caught.value)
    # a float dtype of another width is no mismatch: Orbax casts it (bf16 -> f32 exactly)
    wider = {"a": jax.ShapeDtypeStruct((1000,), jnp.bfloat16), "b": {"c": jax.ShapeDtypeStruct((30, 40), jnp.float32)}}
    assert _restore_one(directory, wider)["model"]["a"].dtype == jnp.bfloat16


def test_a_checkpoint_of_layers_one_by_one_is_named_as_written_before_the_stack(tmp_path):
    import jax
    import jax.numpy as jnp

    per_layer = {"layers": {str(i): {"w": jnp.full((3,), float(i))} for i in range(2)}, "norm": jnp.ones(3)}
    directory, _ = _step(tmp_path, per_layer)
    stacked = {
        "layers": {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)},
        "norm": jax.ShapeDtypeStruct((3,), jnp.float32),
    }
    with pytest.raises(CheckpointMismatchError, match="stored one by one .*cannot resume it"):
        _restore_one(directory, stacked)
    assert not checkpoint.per_layer_names(["layers.w", "0.mu.layers.self_attn.q_proj.kernel"])
    assert checkpoint.per_layer_names(["0.mu.layers.12.self_attn.q_proj.kernel"])
