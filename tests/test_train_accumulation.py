"""Gradient accumulation: M interleaved micro-batches give the whole batch's loss, metrics and gradient.

The reference is the one-shot step (micro_batches=1) on the same batch; the optimizer is plain SGD with lr 1 so
the parameter update IS the gradient. The masks hold different token counts per micro-batch, so a plain mean of
the micro-batch losses would be wrong: only the N_i / N weighting matches. The tolerance is f32 summation order:
the sums over tokens are split into M partial sums. The error of a reordered f32 sum is bounded relative to the
sum of the magnitudes of its terms, not to its result, so a gradient entry whose terms cancel (a rare token's
embedding row) is held to the scale of its leaf: |a − b| ≤ 1e-4·(|b| + max|leaf|) (the per-token terms are as large as the leaf's largest entries).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_student, new_param_filter
from hydrahead_jax.models import Transformer
from hydrahead_jax.training import sharding as shd
from hydrahead_jax.training.steps import (
    LossSettings,
    StepSettings,
    jit_train_step,
    make_train_step,
    stage_layout,
)

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)


def _models():
    teacher = Transformer(CFG, rngs=nnx.Rngs(0))
    head_map = HeadMap.from_fa_groups(CFG, [[0], [1]], method="test")
    student = build_student(teacher, head_map, HybridConfig(gdn_chunk_size=16), rngs=nnx.Rngs(1))
    return teacher, student


def _batch(b=8, t=32, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, 64, (b, t)), jnp.int32)
    mask = rng.random((b, t)) > 0.2
    mask[1, :28] = False  # unequal token counts per micro-batch
    return {"input_ids": ids, "targets": jnp.roll(ids, -1, axis=1), "loss_mask": jnp.asarray(mask, jnp.float32)}


def _close_to_leaf_scale(a, b):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()) + 1e-12)


def _step(kind, micro_batches, chunk_rows=0):
    teacher, student = _models()
    graphdef, params, frozen = nnx.split(student, new_param_filter if kind == "align" else nnx.Param, ...)
    t_graphdef, t_state = nnx.split(teacher)
    settings = LossSettings(kind=kind, chunk=8, chunk_rows=chunk_rows, kl_weight=0.5 if kind == "long" else 0.0)
    step = make_train_step(graphdef, t_graphdef, optax.sgd(1.0), settings, step_settings=StepSettings(micro_batches))
    params = nnx.as_pure(params)
    state = {"params": params, "frozen": nnx.as_pure(frozen), "opt_state": optax.sgd(1.0).init(params), "step": 0}
    new_state, metrics = jax.jit(step)(state, nnx.as_pure(t_state), _batch(), jnp.float32(1.0))
    grads = jax.tree.map(lambda a, b: a - b, params, new_state["params"])
    return grads, metrics


@pytest.mark.parametrize(
    "kind", ["align", pytest.param("distil", marks=pytest.mark.slow), pytest.param("long", marks=pytest.mark.slow)]
)
def test_micro_batches_match_the_whole_batch(kind):
    g1, m1 = _step(kind, 1)
    for m in (2, 4):
        gm, mm = _step(kind, m, chunk_rows=1 if kind != "align" else 0)
        assert set(mm) == set(m1)
        for k in m1:
            np.testing.assert_allclose(float(mm[k]), float(m1[k]), rtol=1e-5, err_msg=k)
        for a, b in zip(jax.tree.leaves(gm), jax.tree.leaves(g1), strict=True):
            _close_to_leaf_scale(a, b)
    assert float(m1["grad_norm"]) > 0


def test_a_plain_mean_of_micro_batch_losses_would_differ():
    """Guards the test above: the batch's masks make unweighted micro-batch means visibly wrong."""
    mask = np.asarray(_batch()["loss_mask"])
    groups = [mask[j::2] for j in range(2)]
    counts = [g.sum() for g in groups]
    assert abs(counts[0] - counts[1]) >= 10


def test_sharded_micro_batches_match_one_device():
    """On a (data 2, fsdp 2, tensor 2) mesh, each micro-batch keeps its rows on their devices; same result."""
    teacher, student = _models()
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: student))
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    tx = optax.sgd(1.0)
    settings = LossSettings(kind="distil", chunk=8, chunk_rows=4)
    layout = stage_layout(graphdef, abstract, nnx.Param, tx, mesh, StepSettings(micro_batches=2))
    _, params, frozen = nnx.split(student, nnx.Param, ...)
    t_graphdef, t_state = nnx.split(teacher)
    t_sh = shd.state_shardings(t_state, mesh)
    step = make_train_step(layout.graphdef, t_graphdef, tx, settings, step_settings=StepSettings(micro_batches=2))
    params = nnx.as_pure(params)
    state = {"params": params, "frozen": nnx.as_pure(frozen), "opt_state": tx.init(params), "step": jnp.int32(0)}
    params = jax.device_get(params)  # host copies: the step donates (and may delete) the placed state
    state = jax.device_put(state, layout.shardings)
    batch = jax.device_put(_batch(), layout.batch_sharding)
    lr = jnp.float32(1.0)
    hlo = jit_train_step(step, layout, t_sh).lower(state, jax.device_put(nnx.as_pure(t_state), t_sh), batch, lr)
    new_state, metrics = hlo.compile()(state, jax.device_put(nnx.as_pure(t_state), t_sh), batch, lr)
    g_sharded = jax.tree.map(lambda a, b: a - b, params, jax.device_get(new_state["params"]))
    g_ref, m_ref = _step("distil", 1)
    np.testing.assert_allclose(float(metrics["loss"]), float(m_ref["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_sharded), jax.tree.leaves(g_ref), strict=True):
        _close_to_leaf_scale(a, b)


def test_indivisible_micro_batches_are_refused_with_the_valid_choices():
    with pytest.raises(ValueError, match=r"choose micro_batches in \[1, 2\]"):
        StepSettings(micro_batches=4).check_batch(8, 4)
    with pytest.raises(ValueError, match="loss_chunk_rows=3"):
        StepSettings(micro_batches=1).check_batch(16, 2, chunk_rows=6)
    with pytest.raises(ValueError, match="micro_batches=0"):
        StepSettings(micro_batches=0)
