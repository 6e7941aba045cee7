"""f32 master weights with bf16 compute: small updates accumulate, norms and fusion γ move, checkpoints keep them.

Reference: the same gradient (the loss of the bf16-cast parameters, differentiated w.r.t. f32 copies) fed to an
independently built optax AdamW on f32 copies. With master_dtype="param" (the old all-bf16 training) the norm
weights and γ (≈ 1.0, bf16 ulp 2⁻⁷) cannot move at lr 1e-5: the test shows both.
"""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from train_helpers import run_train as _run_train

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_student
from hydrahead_jax.models import Transformer
from hydrahead_jax.training.steps import LossSettings, StepSettings, compute_loss, make_train_step, to_master

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    param_dtype="bfloat16",
    dtype="bfloat16",
)
LR = 1e-5


def _setup(fusion):
    teacher = Transformer(CFG, rngs=nnx.Rngs(0))
    head_map = HeadMap.from_fa_groups(CFG, [[0], [1]], method="test")
    student = build_student(teacher, head_map, HybridConfig(gdn_chunk_size=16, fusion=fusion), rngs=nnx.Rngs(1))
    graphdef, params, frozen = nnx.split(student, nnx.Param, ...)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, 32)), jnp.int32)
    batch = {"input_ids": ids, "targets": jnp.roll(ids, -1, 1), "loss_mask": jnp.ones((2, 32), jnp.float32)}
    return graphdef, nnx.as_pure(params), nnx.as_pure(frozen), batch


def _run(master_dtype, fusion, steps=3):
    graphdef, params, frozen, batch = _setup(fusion)
    settings = LossSettings(kind="long", chunk=16)
    tx = optax.adamw(LR, b1=0.9, b2=0.95, weight_decay=0.0)
    ss = StepSettings(master_dtype=master_dtype)
    step = jax.jit(make_train_step(graphdef, None, tx, settings, step_settings=ss, model_params=params))
    master = to_master(params, ss)
    state = {"params": master, "frozen": frozen, "opt_state": tx.init(master), "step": jnp.int32(0)}
    for _ in range(steps):
        state, _ = step(state, None, batch, jnp.float32(LR))
    return params, state


def _reference(fusion, steps=3):
    """Independent: grads of loss(bf16(θ)) w.r.t. f32 θ, then optax.adamw built here on f32 copies."""
    graphdef, params, frozen, batch = _setup(fusion)
    theta = jax.tree.map(lambda x: x.astype(jnp.float32), params)

    def loss(theta):
        student = nnx.merge(graphdef, jax.tree.map(lambda t: t.astype(jnp.bfloat16), theta), frozen)
        return compute_loss(student, None, batch, LossSettings(kind="long", chunk=16))[0]

    tx = optax.adamw(LR, b1=0.9, b2=0.95, weight_decay=0.0)
    opt = tx.init(theta)
    for _ in range(steps):
        updates, opt = tx.update(jax.jit(jax.grad(loss))(theta), opt, theta)
        theta = optax.apply_updates(theta, updates)
    return theta, opt


def _leaves(tree, word):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(p), x) for p, x in flat if word in jax.tree_util.keystr(p)]


# "la_scale" (HybridConfig's default and the demo's, configs/smollm2_hydrahead.py): only the LA heads scaled, γ ⊙ o,
# without normalisation; "both" (`make test-all`): every head of a mixed layer RMS-normalised and scaled. In both,
# every γ entry gets a gradient of the size the movement check below was measured at.
@pytest.mark.parametrize("fusion", ["la_scale", pytest.param("both", marks=pytest.mark.slow)])
def test_f32_master_matches_an_f32_reference_and_moves_norms_and_gamma(fusion):
    params, state = _run("float32", fusion)
    theta, opt = _reference(fusion)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(theta), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state["opt_state"]) if x.ndim)
    # The bf16 weights the model computes with change exactly where the f32 reference's rounding changes.
    for (name, a), b in zip(_leaves(state["params"], ""), jax.tree.leaves(theta), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b.astype(jnp.bfloat16)), name)
    # 3 Adam steps at lr 1e-5 move every norm weight / γ entry by ~3e-5 in the master (far below bf16's ulp of 1.0).
    for word in ("layernorm", "['norm']", "gamma", "o_norm_weight"):
        moved = [
            (n, np.abs(np.asarray(a, np.float64) - np.asarray(p, np.float64)))
            for (n, a), (_, p) in zip(_leaves(state["params"], word), _leaves(params, word))
        ]
        assert moved, word
        for name, delta in moved:
            assert np.mean(delta > 1e-5) > 0.9, (name, float(np.mean(delta > 1e-5)))
    q_changed = [
        np.mean(np.asarray(a.astype(jnp.bfloat16)) != np.asarray(p))
        for (_, a), (_, p) in zip(_leaves(state["params"], "q_proj"), _leaves(params, "q_proj"))
    ]
    assert min(q_changed) > 0.0


def test_bf16_training_without_master_cannot_move_norms():
    """The old behaviour (master_dtype="param"): every norm weight and γ update rounds away (whatever the fusion:
    the updates are below bf16's ulp; shown on the default one)."""
    params, state = _run("param", "la_scale")
    for word in ("layernorm", "['norm']", "gamma", "o_norm_weight"):
        for (name, a), (_, p) in zip(_leaves(state["params"], word), _leaves(params, word)):
            assert a.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(a), np.asarray(p), name)


def test_f32_model_takes_the_plain_path():
    """An f32 model has no separate master: the step is the plain one (bit-identical losses to before)."""
    from hydrahead_jax.training.steps import uses_master

    f32 = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    bf16 = {"w": jax.ShapeDtypeStruct((2,), jnp.bfloat16)}
    assert not uses_master(f32, StepSettings()) and uses_master(bf16, StepSettings())
    assert not uses_master(bf16, StepSettings(master_dtype="param"))


@pytest.mark.slow
def test_bf16_run_checkpoints_master_resumes_exactly_and_exports_bf16(tmp_path):
    """train.py on a bf16 tiny recipe: stage checkpoints hold f32 trained parameters (not bf16-representable
    after updates), a resume from step 2 reproduces step 4's master bit for bit, the export is bf16."""
    recipe = tmp_path / "tiny_bf16.py"
    recipe.write_text(
        "from configs import tiny\n\n\ndef get_config(arg=None):\n    c = tiny.get_config(arg)\n"
        "    c.teacher.model.param_dtype = 'bfloat16'\n    c.teacher.model.dtype = 'bfloat16'\n    return c\n"
    )
    run_train = functools.partial(_run_train, config=recipe)
    stage1 = ("--config.stage1.steps=4", "--config.stage1.lr=1e-5")
    stage = (*stage1, "--until_stage=align")
    a = tmp_path / "a"
    r = run_train(a, *stage)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "compiled step memory per device" in r.stdout
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "stage1_align" / "4")
    (b / "stage1_align" / "DONE").unlink()
    r = run_train(b, *stage)
    assert r.returncode == 0 and "resuming from step 2" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]

    def model(run):
        with ocp.StandardCheckpointer() as c:
            return c.restore(run / "stage1_align" / "4" / "model")

    ma, mb = model(a), model(b)
    gdn = [(n, x) for n, x in _leaves(ma, "gdn") if "float" in str(x.dtype)]
    assert gdn and all(x.dtype == np.float32 for _, x in gdn)
    assert any(np.any(np.asarray(x) != np.asarray(x.astype(jnp.bfloat16)).astype(np.float32)) for _, x in gdn)
    for x, y in zip(jax.tree.leaves(ma), jax.tree.leaves(mb), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # run a goes on to the export: its finished stage 1 is kept
    r = run_train(a, *stage1, "--config.stage2.steps=2", "--config.stage3.steps=2")
    assert r.returncode == 0 and "[stage1_align] finished earlier" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    with ocp.StandardCheckpointer() as c:
        exported = c.restore(a / "final" / "params")
    floats = [x for x in jax.tree.leaves(exported) if "float" in str(x.dtype)]
    assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
