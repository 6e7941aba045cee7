"""Held-out evaluation per stage: its values against an independent computation from the stage's checkpoints, the
fixed held-out batch (validation split, deterministic, never a training batch), its rows in metrics.jsonl,
TensorBoard and heldout.json, heldout_rows=0, refusals. (Kill + resume: tests/test_train_resume.py and
tests/test_recovery_faults.py check the held-out rows after a resume.)"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers
from train_helpers import FINISHED_RUN_STEPS as STEPS
from train_helpers import finished_run_config, tiny_config

from hydrahead_jax.config import ConfigError, ModelConfig
from hydrahead_jax.data.corpus import CorpusStore, prepare_corpus
from hydrahead_jax.data.tiny_tokenizer import TokenizersAdapter
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_model
from hydrahead_jax.models import Transformer
from hydrahead_jax.run_config import STAGES, DataConfig, RunConfig
from hydrahead_jax.training import losses
from hydrahead_jax.training import sharding as shd
from hydrahead_jax.training.checkpoint import StageCheckpointer
from hydrahead_jax.training.data import HELDOUT_SEED_OFFSET, make_heldout_batch, make_stage_iterator
from hydrahead_jax.training.pipeline import run_pipeline
from hydrahead_jax.training.trainer import abstract_with_shardings


def _heldout_batch(run, index):
    stage = STAGES[index]
    scfg = run.stage(stage)
    return make_heldout_batch(
        run.data,
        seq_len=scfg.seq_len,
        rows=scfg.heldout_rows,
        seed=run.seed + HELDOUT_SEED_OFFSET + index,
        vocab_size=run.teacher.model.vocab_size,
    )


@pytest.fixture(scope="module")
def finished_run(tiny_finished_run):
    """The shared finished tiny run (conftest): (recipe, workdir, metrics.jsonl rows, what it printed)."""
    run = tiny_finished_run
    rows = [json.loads(line) for line in (run.workdir / "metrics.jsonl").read_text().splitlines()]
    return run.config, run.workdir, rows, run.stdout


def _restore(workdir, stage_dir, c):
    """The student of a stage's final checkpoint, on one device, outside the trainer."""
    cfg = ModelConfig.from_dict(dict(c.teacher.model))
    head_map = HeadMap.load(workdir / "head_map.json", cfg)
    hybrid = HybridConfig.from_dict(dict(c.hybrid))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build_model(cfg, head_map, hybrid, nnx.Rngs(0))))
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    ckpt = StageCheckpointer(workdir / stage_dir, save_every=1)
    try:
        state = ckpt.restore_model(abstract_with_shardings(nnx.as_pure(abstract), shd.state_shardings(abstract, mesh)))
    finally:
        ckpt.close()
    return nnx.merge(graphdef, state), Transformer(cfg, rngs=nnx.Rngs(int(c.teacher.seed)))


def _reference(student, teacher, batch, stage, scfg):
    """The stage's loss and metrics from their formulas, in float64 from the models' outputs (whole [B,T,V]
    logits; for stage 1 the teacher's per-layer attention inputs and outputs and the student's attention blocks),
    none of the training code's loss functions involved:

        align:  loss = Σ_l ⟨mean_d (attn_l^S(x_l^T) − y_l^T)²⟩,  align_mse_mean = loss / L
        distil: loss = τ² ⟨KL(softmax(z_T/τ) ‖ softmax(z_S/τ))⟩ + w_ce · ce
        long:   loss = w_ce · ce + w_kl · τ² ⟨KL_τ⟩,  ce = ⟨−log q(target)⟩,  accuracy = ⟨argmax q = target⟩
        every stage: kl = ⟨KL⟩ at τ = 1, top1 = ⟨argmax p = argmax q⟩

    (⟨·⟩: the mean over tokens with loss_mask = 1). Copy rows are one document each (positions 0..T−1), so the
    plain forward pass is the run the stage computes."""
    ids = jnp.asarray(batch["input_ids"])
    mask = np.asarray(batch["loss_mask"], np.float64)

    def mean(per_token):
        return float((per_token * mask).sum() / mask.sum())

    z_s = np.asarray(student(ids).astype(jnp.float32), np.float64)
    z_t = np.asarray(teacher(ids).astype(jnp.float32), np.float64)

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    def kl(tau):
        log_p, log_q = log_softmax(z_t / tau), log_softmax(z_s / tau)
        return mean((np.exp(log_p) * (log_p - log_q)).sum(-1)) * tau**2

    want = {"kl": kl(1.0), "top1": mean(z_t.argmax(-1) == z_s.argmax(-1))}
    if stage.loss == "align":
        inter: dict[str, list] = {}
        teacher.hidden_states(ids, intermediates=inter)
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        mse = []
        for i, (x, y) in enumerate(zip(inter["attn_inputs"], inter["attn_outputs"], strict=True)):  # [L, B, T, d]
            attn = student.layer(i).self_attn
            out = np.asarray(attn(x, positions, kind=student.layer_kinds[i])[0].astype(jnp.float32), np.float64)
            mse.append(mean(np.mean((out - np.asarray(y.astype(jnp.float32), np.float64)) ** 2, axis=-1)))
        return dict(want, loss=float(np.sum(mse)), align_mse_mean=float(np.mean(mse)))
    loss = 0.0
    if stage.loss == "distil" or scfg.kl_weight > 0:
        loss += (1.0 if stage.loss == "distil" else scfg.kl_weight) * kl(scfg.temperature)
    if stage.loss == "long" or scfg.ce_weight > 0:
        targets = np.asarray(batch["targets"])
        log_q = log_softmax(z_s)
        want["ce"] = mean(-np.take_along_axis(log_q, targets[..., None], axis=-1)[..., 0])
        want["accuracy"] = mean(z_s.argmax(-1) == targets)
        loss += scfg.ce_weight * want["ce"]
    return dict(want, loss=loss)


def _heldout_rows(rows, stage_dir):
    return [r for r in rows if r["stage"] == stage_dir and r.get("split") == "heldout"]


@pytest.mark.slow  # reads the whole pipeline run (conftest's tiny_finished_run): the end-to-end tier
def test_heldout_values_equal_an_independent_computation_from_the_checkpoints(finished_run):
    c, workdir, rows, _ = finished_run
    run = RunConfig.from_recipe(c)
    # Stage s's last held-out row is its final checkpoint's values; stage s+1's step-0 row is the same student
    # (stage s's final state) on stage s+1's batch and loss.
    checks = [(i, STAGES[i].directory, STEPS) for i in range(3)] + [(1, STAGES[0].directory, 0)]
    for index, state_dir, step in checks:
        stage = STAGES[index]
        (got,) = [r for r in _heldout_rows(rows, stage.directory) if r["step"] == step]
        student, teacher = _restore(workdir, state_dir, c)
        want = _reference(student, teacher, _heldout_batch(run, index), stage, run.stage(stage))
        assert set(got) == {"stage", "step", "tokens_seen", "split"} | set(want), stage.name
        assert got["tokens_seen"] == step * run.stage(stage).tokens_per_step
        for name, value in want.items():
            # The trainer's f32 tiles against float64 whole logits: measured at most 1.3e-6 relative (the KL; 1.9e-8
            # for CE, 7.9e-9 for the align MSE; top-1 and accuracy equal up to float32 rounding).
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-9, err_msg=f"{stage.name} {name} {step}")


@pytest.mark.slow  # reads the whole pipeline run (conftest's tiny_finished_run): the end-to-end tier
def test_heldout_points_logs_and_summaries(finished_run, tmp_path):
    c, workdir, rows, out = finished_run
    assert [r["step"] for r in _heldout_rows(rows, "stage1_align")] == [0, 2, 3]  # heldout_every=2
    assert [r["step"] for r in _heldout_rows(rows, "stage2_distil")] == [0, 3]  # heldout_every=0
    assert [r["step"] for r in _heldout_rows(rows, "stage3_long")] == [0, 3]
    assert sorted(r["step"] for r in rows if "split" not in r and r["stage"] == "stage1_align") == [1, 2, 3]
    for stage in STAGES:
        held = _heldout_rows(rows, stage.directory)
        summary = json.loads((workdir / stage.directory / "heldout.json").read_text())
        assert summary["first"] == held[0] and summary["last"] == held[-1]
        shape = (c[stage.config_key].heldout_rows, c[stage.config_key].seq_len)
        assert (summary["rows"], summary["seq_len"]) == shape
        assert all(np.isfinite(r["loss"]) and 0.0 <= r["top1"] <= 1.0 and r["kl"] >= 0.0 for r in held)
        events = b"".join(p.read_bytes() for p in (workdir / "tensorboard" / stage.directory).glob("events.*"))
        assert f"{stage.directory}/heldout_kl".encode() in events and b"heldout_top1" in events
        first, last = held[0], held[-1]
        line = (
            f"[{stage.directory}] held-out ({shape[0]} rows x {shape[1]} tokens), step 0 -> {STEPS}: loss "
            f"{first['loss']:.4g} -> {last['loss']:.4g}, KL {first['kl']:.4g} -> {last['kl']:.4g}, top-1 "
            f"{100 * first['top1']:.1f}% -> {100 * last['top1']:.1f}%"
        )
        assert line in out
    # The rerun (on a copy: the run is shared) skips the finished stages: no row is evaluated or logged again.
    rerun = tmp_path / "rerun"
    shutil.copytree(workdir, rerun)
    before = (rerun / "metrics.jsonl").read_text()
    run_pipeline(RunConfig.from_recipe(c), rerun)
    assert (rerun / "metrics.jsonl").read_text() == before


@pytest.mark.slow  # a stage through the pipeline: the end-to-end tier
def test_heldout_rows_0_turns_the_evaluation_off(tmp_path, capsys):
    c = finished_run_config()
    c.stage1.steps = 1
    c.stage1.heldout_rows = 0
    run_pipeline(RunConfig.from_recipe(c), tmp_path, until_stage="align")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and "split" not in rows[0]
    assert not (tmp_path / "stage1_align" / "heldout.json").exists()
    assert "held-out" not in capsys.readouterr().out


def test_copy_heldout_batch_is_fixed_and_never_a_training_batch():
    run = RunConfig.from_recipe(finished_run_config())
    for index, stage in enumerate(STAGES):
        scfg = run.stage(stage)
        a, b = _heldout_batch(run, index), _heldout_batch(run, index)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)  # the same every time
        assert a["input_ids"].shape == (scfg.heldout_rows, scfg.seq_len)
        # Every batch the run trains on (each stage's iterator, the calibration batch) holds none of its rows.
        seeds = [run.seed + 1000 * (i + 1) for i in range(len(STAGES))] + [run.seed + 7919]
        for seed in seeds:
            it = make_stage_iterator(
                run.data, seq_len=scfg.seq_len, batch_size=8, seed=seed, vocab_size=128, synthetic_rate=0.0
            )
            train_rows = {row.tobytes() for _ in range(4) for row in next(it)["input_ids"]}
            assert not train_rows & {row.tobytes() for row in a["input_ids"]}, (stage.name, seed)


def _numbered_tokenizer(n):
    """Word-level tokenizer: <eos>=0, w0=1, w1=2, ...: a token names the document it came from."""
    vocab = {"<eos>": 0, **{f"w{i}": i + 1 for i in range(n)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TokenizersAdapter(tok, name=f"numbered{n}", eos_token="<eos>")


def test_corpus_heldout_rows_come_from_validation_documents_only(tmp_path):
    n = 40
    tokenizer = _numbered_tokenizer(n)
    (tmp_path / "docs").mkdir()
    for i in range(n):  # document i is the word w{i} repeated
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(" ".join([f"w{i}"] * (6 + i % 5)))
    store = prepare_corpus(tokenizer, tmp_path / "docs", out_dir=tmp_path / "store", validation_fraction=0.25)
    validation_docs = set(json.loads((store / "metadata.json").read_text())["validation_documents"])
    files = sorted((tmp_path / "docs").iterdir())
    validation_tokens = {int(files[d].stem) + 1 for d in validation_docs}
    data = DataConfig(source=str(tmp_path / "docs"), validation_fraction=0.25)
    batch = make_heldout_batch(data, seq_len=8, rows=6, seed=3, vocab_size=n + 1, store_path=store)
    again = make_heldout_batch(data, seq_len=8, rows=6, seed=3, vocab_size=n + 1, store_path=store)
    assert all(np.array_equal(batch[k], again[k]) for k in batch)
    seen = set(np.unique(np.concatenate([batch["input_ids"], batch["targets"]]))) - {0}
    assert seen and seen <= validation_tokens  # validation documents only
    assert len(CorpusStore(store, "train").read(0, 10**9)) > 0
    train = make_stage_iterator(
        data, seq_len=8, batch_size=6, seed=3, vocab_size=n + 1, synthetic_rate=0.0, store_path=store
    )
    train_tokens = {int(t) for _ in range(5) for t in np.unique(next(train)["input_ids"])} - {0}
    assert train_tokens and not train_tokens & validation_tokens


def test_empty_validation_split_is_refused_with_the_fix(tmp_path):
    tokenizer = _numbered_tokenizer(4)
    (tmp_path / "docs").mkdir()
    for i in range(4):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"w{i} w{i} w{i}")
    store = prepare_corpus(tokenizer, tmp_path / "docs", out_dir=tmp_path / "store", validation_fraction=0.0)
    data = DataConfig(source=str(tmp_path / "docs"), validation_fraction=0.0)
    with pytest.raises(ConfigError, match=r"config\.stage2\.heldout_rows=4 .*validation split.*empty") as err:
        make_heldout_batch(data, seq_len=4, rows=4, seed=0, vocab_size=5, store_path=store, config_key="stage2")
    assert "--config.stage2.heldout_rows=0" in str(err.value) and "validation_fraction=0.02" in str(err.value)


@pytest.mark.parametrize("field,value", [("heldout_rows", -1), ("heldout_every", -2)])
def test_bad_heldout_settings_are_refused_with_the_fix(field, value):
    c = tiny_config()
    c.stage3[field] = value
    with pytest.raises(ConfigError, match=rf"config\.stage3\.{field}={value}: must be >= 0.*Fix"):
        RunConfig.from_recipe(c)


def test_chunked_teacher_agreement_matches_whole_logits():
    rng = np.random.default_rng(0)
    b, t, d, v = 4, 10, 6, 11
    w_s, w_t = rng.normal(size=(d, v)), rng.normal(size=(d, v))
    h_s, h_t = rng.normal(size=(b, t, d)), rng.normal(size=(b, t, d))
    h_t[0, :3] = h_s[0, :3] @ w_s @ np.linalg.pinv(w_t)  # some tokens agree
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    kl, top1 = losses.chunked_teacher_agreement(
        f32(h_s), f32(h_t), lambda h: h @ f32(w_s), lambda h: h @ f32(w_t), f32(mask), chunk=4, rows=2
    )
    z_s, z_t = h_s @ w_s, h_t @ w_t
    log_q = z_s - np.log(np.exp(z_s).sum(-1, keepdims=True))
    log_p = z_t - np.log(np.exp(z_t).sum(-1, keepdims=True))
    want_kl = ((np.exp(log_p) * (log_p - log_q)).sum(-1) * mask).sum() / mask.sum()
    want_top1 = ((z_s.argmax(-1) == z_t.argmax(-1)) * mask).sum() / mask.sum()
    assert 0 < want_top1 < 1
    np.testing.assert_allclose(float(kl), want_kl, rtol=1e-5)
    np.testing.assert_allclose(float(top1), want_top1, rtol=1e-6)
