"""The whole tiny pipeline in-process: stage chaining, rerun skips finished stages, export round trip, refusals."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_helpers import finished_run_config, run_train

from hydrahead_jax import load_hydrahead
from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid import HeadMap, HeadMapError, HybridConfig, build_model
from hydrahead_jax.models import Transformer
from hydrahead_jax.run_config import RunConfig
from hydrahead_jax.training import sharding as shd
from hydrahead_jax.training.checkpoint import ConfigMismatchError, StageCheckpointer, check_workdir_config
from hydrahead_jax.training.data import make_stage_iterator
from hydrahead_jax.training.pipeline import run_pipeline
from hydrahead_jax.training.steps import LossSettings, compute_loss
from hydrahead_jax.training.trainer import abstract_with_shardings


def _run(c):
    return RunConfig.from_recipe(c)


@pytest.fixture(scope="module")
def finished_run(tiny_finished_run):
    """The shared finished tiny run (conftest): (recipe, workdir, export)."""
    return tiny_finished_run.config, tiny_finished_run.workdir, tiny_finished_run.final


def _records(workdir):
    """The training rows of metrics.jsonl (held-out rows carry a "split" key)."""
    return [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if "split" not in r]


def _student(c, workdir):
    cfg = ModelConfig.from_dict(dict(c.teacher.model))
    head_map = HeadMap.load(workdir / "head_map.json", cfg)
    model = nnx.eval_shape(lambda: build_model(cfg, head_map, HybridConfig.from_dict(dict(c.hybrid)), nnx.Rngs(0)))
    return cfg, nnx.split(model)


def _final_state(workdir, stage_dir, abstract):
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    ckpt = StageCheckpointer(workdir / stage_dir, save_every=1)
    try:
        return ckpt.restore_model(abstract_with_shardings(nnx.as_pure(abstract), shd.state_shardings(abstract, mesh)))
    finally:
        ckpt.close()


@pytest.mark.slow  # reads the whole pipeline run (conftest's tiny_finished_run): the end-to-end tier
def test_stages_chain_and_log(finished_run):
    c, workdir, final = finished_run
    records = _records(workdir)
    assert [(r["stage"], r["step"]) for r in records] == [
        (s, i) for s in ("stage1_align", "stage2_distil", "stage3_long") for i in (1, 2, 3)
    ]
    for r in records:
        assert {"loss", "grad_norm", "lr", "tokens_seen", "step_time_s", "tokens_per_s"} <= set(r)
        assert r["tokens_seen"] == r["step"] * 8 * (64 if r["stage"] == "stage3_long" else 32)
    assert list((workdir / "tensorboard").glob("stage1_align/events.out.tfevents.*"))
    for stage in ("stage1_align", "stage2_distil", "stage3_long"):
        assert (workdir / stage / "DONE").exists()

    # Stage 2 starts from stage 1's final weights: its first logged loss is the KL of the stage-1 student on
    # stage 2's first batch, recomputed here independently of the training loop.
    cfg, (graphdef, abstract) = _student(c, workdir)
    student = nnx.merge(graphdef, _final_state(workdir, "stage1_align", abstract))
    teacher = Transformer(cfg, rngs=nnx.Rngs(int(c.teacher.seed)))
    batch = next(
        make_stage_iterator(
            _run(c).data,
            seq_len=32,
            batch_size=8,
            seed=int(c.seed) + 2000,
            vocab_size=cfg.vocab_size,
            synthetic_rate=0.0,
        )
    )
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    kl, _ = compute_loss(student, teacher, batch, LossSettings(kind="distil", ce_weight=0.0, chunk=16))
    stage2_first = next(r for r in records if r["stage"] == "stage2_distil" and r["step"] == 1)
    np.testing.assert_allclose(stage2_first["loss"], float(kl), rtol=1e-4)


@pytest.mark.slow  # reads the whole pipeline run (conftest's tiny_finished_run): the end-to-end tier
def test_export_round_trip(finished_run):
    c, workdir, final = finished_run
    assert final == workdir / "final"
    assert (
        json.loads((final / "head_map.json").read_text())["fa_groups"]
        == json.loads((workdir / "head_map.json").read_text())["fa_groups"]
    )
    model, tokenizer = load_hydrahead(final)
    assert tokenizer is None  # the random teacher has none
    _, (graphdef, abstract) = _student(c, workdir)
    reference = nnx.merge(graphdef, _final_state(workdir, "stage3_long", abstract))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 24)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(reference(ids)))


@pytest.mark.slow  # reads the whole pipeline run (conftest's tiny_finished_run): the end-to-end tier
def test_rerun_skips_finished_stages(finished_run, capsys, tmp_path):
    c, shared, _ = finished_run
    workdir = tmp_path / "rerun"  # a copy: the run is shared
    shutil.copytree(shared, workdir)
    before = (workdir / "metrics.jsonl").read_text()
    run_pipeline(_run(c), workdir)
    out = capsys.readouterr().out
    assert out.count("finished earlier") == 3
    assert (workdir / "metrics.jsonl").read_text() == before  # no step ran


def test_workdir_of_another_config_is_refused(tmp_path):
    c = finished_run_config()
    model = ModelConfig.from_dict(dict(c.teacher.model))
    check_workdir_config(tmp_path, _run(c), model, force_new=False)
    c2 = finished_run_config()
    c2.logging.progress = True  # resume-safe fields may change
    c2.stage2.checkpoint_every = 7
    check_workdir_config(tmp_path, _run(c2), model, force_new=False)
    c2.stage2.weight_decay = 0.5
    with pytest.raises(ConfigMismatchError, match=r"stage2\.weight_decay: 0\.0 -> 0\.5.*--force_new"):
        run_pipeline(_run(c2), tmp_path)
    check_workdir_config(tmp_path, _run(c2), model, force_new=True)
    assert list(tmp_path.parent.glob(f"{tmp_path.name}.replaced-*"))
    assert json.loads((tmp_path / "run_config.json").read_text())["config"]["stage2"]["weight_decay"] == 0.5


def test_head_map_of_another_model_is_refused_before_training(tmp_path):
    other = ModelConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8
    )
    HeadMap.layerwise(other, "1:1").save(tmp_path / "other.json")
    c = finished_run_config()
    c.selection.method = "given"
    c.selection.head_map_path = str(tmp_path / "other.json")
    with pytest.raises(HeadMapError, match="num_layers=3 but the model has num_layers=2"):
        run_pipeline(_run(c), tmp_path / "run")
    assert not list((tmp_path / "run").glob("stage*"))


def test_train_py_reports_bad_inputs_clearly(tmp_path):
    proc = run_train(tmp_path / "w", "--config.stage2.learning_rate=1")
    assert proc.returncode == 2
    assert "unknown config key 'stage2.learning_rate'" in proc.stderr and "'lr'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tensorboard_scalars_are_written_without_importing_torch(tmp_path):
    """A run's TensorBoard events hold the logged scalars, and starting the writer does not import torch (the dev
    extras install torch, so under `make test` this checks that the import is blocked): a fresh interpreter logs two
    steps, then reports whether torch was imported; the event file is read back record by record."""
    import struct
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from hydrahead_jax.training.metrics import StageLogger\n"
        f"log = StageLogger({str(tmp_path)!r}, 'stage1_align', total_steps=2, start_step=0, tokens_per_step=8,"
        " progress=False)\n"
        "log.log(1, {'loss': 2.5}); log.log(2, {'loss': 1.25}); log.close()\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch imported: False" in done.stdout
    from tensorboardX.proto.event_pb2 import Event

    # The event file is TFRecord: per record a uint64 length, its uint32 CRC, the serialised Event, the data's CRC.
    (events_file,) = (tmp_path / "tensorboard" / "stage1_align").glob("events.out.tfevents.*")
    data, scalars, at = events_file.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        event = Event.FromString(data[at + 12 : at + 12 + length])
        scalars += [(event.step, v.simple_value) for v in event.summary.value if v.tag == "stage1_align/loss"]
        at += 12 + length + 4
    assert scalars == [(1, 2.5), (2, 1.25)]
