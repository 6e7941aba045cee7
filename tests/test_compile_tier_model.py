"""Compile tier, model level: the tiny recipe's jitted train step lowers for a TPU pod, Pallas kernels included.

No TPU is needed: ``pallas_kernels.cross_compile.lower_for_tpu`` lowers under an abstract 8-chip TPU mesh with the
arguments sharded over it, so the kernels resolve to their Mosaic (``pallas_tpu``) versions and Mosaic's lowering
runs as it would on a pod. A Mosaic call left to XLA's partitioner on sharded operands fails there ("Mosaic kernels
cannot be automatically partitioned"): the control test removes the model's ``shard_map`` wrapping and sees exactly
that failure, so the passing case proves the wrapping, not a lenient lowering.
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from train_helpers import tiny_config, tiny_models

from hydrahead_jax.hybrid import attention as hybrid_attention
from hydrahead_jax.hybrid import build_model, gdn
from hydrahead_jax.models import attention as teacher_attention
from hydrahead_jax.training import sharding as shd
from hydrahead_jax.training.steps import LossSettings, compute_loss, make_optimizer, make_train_step
from pallas_kernels.cross_compile import lower_for_tpu, tpu_abstract_mesh

MOSAIC_CALL = "tpu_custom_call"


def _specs(shardings):
    return jax.tree.map(lambda s: s.spec, shardings)


def lower_tiny_train_step(mesh_axes: dict[str, int], batch_size: int, *, gradient: bool = True) -> str:
    """StableHLO of the tiny recipe's stage-2 (distillation) train step (``gradient=False``: its loss alone), lowered
    for TPU v5p chips on an abstract mesh of ``mesh_axes``, parameters and optimizer state placed by the
    logical-axis rules, the batch split over (data, fsdp). The recipe's kernel implementations are "auto": Mosaic
    on a TPU."""
    c = tiny_config()
    scfg = c.stage2
    cfg, teacher, head_map, hybrid = tiny_models(c)
    assert hybrid.gdn_implementation == hybrid.attention_implementation == "auto"
    mesh = tpu_abstract_mesh(mesh_axes)
    student = nnx.eval_shape(lambda: build_model(cfg, head_map, hybrid, nnx.Rngs(0)))
    gd, params, frozen = nnx.split(student, nnx.Param, ...)
    teacher_gd, teacher_state = nnx.split(teacher)
    tx, schedule = make_optimizer(lr=float(scfg.lr), warmup_steps=2, total_steps=int(scfg.steps))
    settings = LossSettings(kind="distil", chunk=int(scfg.loss_chunk))
    step = make_train_step(gd, teacher_gd, tx, settings, schedule)
    if not gradient:

        def step(state, teacher_state, batch):
            student = nnx.merge(gd, state["params"], state["frozen"])
            return compute_loss(student, nnx.merge(teacher_gd, teacher_state), batch, settings)[0]

    p_sh = shd.state_shardings(params, mesh)
    pure_params = nnx.as_pure(params)
    state = {
        "params": pure_params,
        "frozen": nnx.as_pure(frozen),
        "opt_state": jax.eval_shape(tx.init, pure_params),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    state_specs = {
        "params": _specs(p_sh),
        "frozen": _specs(shd.state_shardings(frozen, mesh)),
        "opt_state": _specs(shd.optimizer_shardings(tx, pure_params, p_sh, mesh)),
        "step": jax.sharding.PartitionSpec(),
    }
    teacher_pure = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.as_pure(teacher_state))
    teacher_specs = _specs(shd.state_shardings(teacher_state, mesh))
    rows = jax.ShapeDtypeStruct((batch_size, int(scfg.seq_len)), jnp.int32)
    # The data pipeline's full batch: packed documents reach both kernels as segment ids (data.mask_documents).
    batch = {name: rows for name in ("input_ids", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = jax.ShapeDtypeStruct(rows.shape, jnp.float32)
    batch_spec = shd.logical_to_spec(("batch", None), rows.shape, mesh)
    assert batch_spec != jax.sharding.PartitionSpec(None, None), "the batch must really be split for this test"
    return lower_for_tpu(
        step,
        state,
        teacher_pure,
        batch,
        mesh_axes=mesh_axes,
        in_specs=(state_specs, teacher_specs, jax.tree.map(lambda _: batch_spec, batch)),
    )


def mosaic_kernels(text: str) -> collections.Counter:
    """{kernel name: number of Mosaic calls} in lowered StableHLO."""
    return collections.Counter(re.findall(r'kernel_name = "([^"]+)"', text))


@pytest.mark.parametrize(
    "mesh_axes, batch_size",
    [({"data": 8, "fsdp": 1, "tensor": 1}, 8), ({"data": 2, "fsdp": 2, "tensor": 2}, 4)],
    ids=["data8", "data2-fsdp2-tensor2"],
)
def test_tiny_train_step_lowers_for_a_tpu_pod(mesh_axes, batch_size):
    forward = mosaic_kernels(lower_tiny_train_step(mesh_axes, batch_size, gradient=False))
    train = mosaic_kernels(lower_tiny_train_step(mesh_axes, batch_size))
    # Forward, per layer (2): the teacher's and the student's flash attention, the student's gated delta rule.
    families = ("flash_attention", "gated_delta")
    for counts in (forward, train):
        assert all(any(name.startswith(f) for name in counts) for f in families), counts
    assert sum(forward.values()) >= 2 * 3, forward
    # The gradient adds the backward kernels of the student's two kernels in both layers.
    assert sum(train.values()) >= sum(forward.values()) + 2 * 2, (forward, train)
    assert set(train) > set(forward), (forward, train)


def test_control_kernels_outside_shard_map_do_not_lower(monkeypatch):
    def unwrapped(kernel, *args, in_axes, out_axes):
        return kernel(*args)

    for module in (teacher_attention, gdn):
        monkeypatch.setattr(module, "kernel_call", unwrapped)
    assert hybrid_attention.Attention is teacher_attention.Attention
    with pytest.raises(Exception, match="cannot be automatically partitioned"):
        lower_tiny_train_step({"data": 8, "fsdp": 1, "tensor": 1}, 8)
