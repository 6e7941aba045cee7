"""The model's kernels run per device inside ``jax.shard_map`` (``hydrahead_jax.models.kernel_sharding``).

On 8 simulated CPU devices the Pallas kernels run in interpret mode, which XLA could partition by itself; what these
tests prove is therefore (1) the numbers: the sharded train step, with every kernel split over batch and heads,
gives the unsharded losses, and a sharded prefill + decode gives the unsharded logits; (2) the structure: every
``pallas_call`` of the traced train step (forward and backward) sits inside a ``shard_map``, which is what a TPU or
GPU needs (Mosaic and Triton calls cannot be partitioned; ``test_compile_tier_model.py`` lowers the step for TPU).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from train_helpers import run_tiny_distil, tiny_config, tiny_models

from hydrahead_jax.hybrid import build_model
from hydrahead_jax.models.kernel_sharding import BTH, BTHD, kernel_call
from hydrahead_jax.training import sharding as shd

PALLAS = dict(gdn_implementation="pallas", attention_implementation="pallas")


def one_device_mesh():
    return shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])


@pytest.mark.slow
def test_sharded_pallas_train_step_gives_the_unsharded_losses(tmp_path):
    # data=4 × tensor=2: the tiny recipe's batch of 4 splits over data; its LA groups (2 GDN heads per layer) split
    # over tensor, its FA group (1 KV head) cannot and stays whole (replicated over tensor).
    mesh = shd.make_mesh(4, 1, 2)
    losses_one, _ = run_tiny_distil(tmp_path / "one", one_device_mesh(), steps=3, **PALLAS)
    losses_sharded, _ = run_tiny_distil(tmp_path / "sharded", mesh, steps=3, **PALLAS)
    assert len(losses_one) == len(losses_sharded) == 3
    # Each device runs the kernels on its own rows and heads, the same per-row arithmetic as on one device; only
    # XLA's reductions (batch mean, the o_proj/MLP contractions over tensor shards, the gradient sums) change order,
    # f32 rounding of ~1e-7 per op carried through 3 Adam steps: measured ≤ 5e-6 relative. The losses move by ~10%
    # per step, so a kernel fed the wrong rows or heads would be off by orders of magnitude more than 1e-4.
    np.testing.assert_allclose(losses_sharded, losses_one, rtol=1e-4, atol=0)
    assert abs(losses_one[-1] - losses_one[0]) > 100 * 1e-4 * losses_one[0]


def pallas_calls(jaxpr, inside: bool = False, found=None) -> list[tuple[str, bool]]:
    """(kernel name, whether it sits inside a shard_map) of every pallas_call in ``jaxpr`` and its sub-jaxprs."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append((str(eqn.params["name"]), inside))
            continue
        nested = inside or eqn.primitive.name == "shard_map"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    pallas_calls(sub, nested, found)
    return found


def shard_map_in_specs(jaxpr, found=None) -> list[tuple]:
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            found.append(tuple(eqn.params["in_specs"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = sub.jaxpr if isinstance(sub, jax.extend.core.ClosedJaxpr) else sub
                if isinstance(sub, jax.extend.core.Jaxpr):
                    shard_map_in_specs(sub, found)
    return found


def student_loss_jaxpr(mesh, **hybrid_changes):
    """jaxpr of value_and_grad(mean logit² of the tiny HydraHead student) w.r.t. its params, traced under ``mesh``
    (None: no mesh)."""
    c = tiny_config()
    cfg, _, head_map, hybrid = tiny_models(c, **hybrid_changes)
    gd, params, rest = nnx.split(build_model(cfg, head_map, hybrid, nnx.Rngs(0)), nnx.Param, ...)
    ids = jnp.zeros((4, 32), jnp.int32)

    def loss(params):
        return jnp.mean(nnx.merge(gd, params, rest)(ids) ** 2)

    trace = functools.partial(jax.make_jaxpr(jax.value_and_grad(loss)), params)
    if mesh is None:
        return trace().jaxpr
    with jax.set_mesh(mesh):
        return trace().jaxpr


def test_every_pallas_call_of_the_train_step_sits_in_a_shard_map():
    jaxpr = student_loss_jaxpr(shd.make_mesh(4, 1, 2), **PALLAS)
    calls = pallas_calls(jaxpr)
    names = {name for name, _ in calls}
    # Forward and backward of both kernels of both layers.
    assert any(n.startswith("flash_attention") for n in names) and any(n.startswith("gated_delta") for n in names)
    assert len(calls) >= 2 * 2 * 2, calls
    assert [c for c in calls if not c[1]] == []
    # Split where the head counts allow: GDN q/k/v/g/β (2 LA heads) over tensor; FA (1 KV head) whole; batch over
    # (data, fsdp) as the rules say (fsdp has size 1 here). The other shard_maps are the transposes, for the backward.
    # Inside the scanned layers, the gradient's partial evaluation passes per-device values (float32[8], one per
    # device, spec over every mesh axis) to a kernel's shard_map ahead of its own operands: the kernel's operands
    # are the trailing ones.
    specs = shard_map_in_specs(jaxpr)
    rows = ("data", "fsdp")

    def a_call_ends_with(operands: tuple) -> bool:
        return any(s[-len(operands) :] == operands for s in specs)

    assert a_call_ends_with((P(rows, None, "tensor", None),) * 3 + (P(rows, None, "tensor"),) * 2), specs
    assert a_call_ends_with((P(rows, None, None, None),) * 3), specs

    # One device (no mesh): the kernels are called as before, with no shard_map around them.
    unwrapped = pallas_calls(student_loss_jaxpr(None, **PALLAS))
    assert sorted(n for n, _ in unwrapped) == sorted(n for n, _ in calls)
    assert not any(inside for _, inside in unwrapped)


def test_sharded_prefill_and_decode_give_the_unsharded_logits():
    """Decode paths (flash attention and the chunked rule from a cache at prefill, the one-token GDN step) under a
    data=4 × tensor=2 mesh; the XLA kernels go through the same ``kernel_call`` wrapping as the Pallas ones."""
    c = tiny_config()
    cfg, _, head_map, hybrid = tiny_models(c, gdn_implementation="xla", attention_implementation="xla")
    model = build_model(cfg, head_map, hybrid, nnx.Rngs(0))
    gd, state = nnx.split(model)
    ids = jax.random.randint(jax.random.key(1), (4, 9), 0, cfg.vocab_size)

    @jax.jit
    def prefill(state, ids):
        m = nnx.merge(gd, state)
        return m(ids, cache=m.init_cache(4, 16))

    @jax.jit
    def decode(state, token, cache):
        return nnx.merge(gd, state)(token, cache=cache)

    def generate(state, ids):
        logits, cache = prefill(state, ids[:, :8])
        step_logits, cache = decode(state, ids[:, 8:9], cache)
        return jnp.concatenate([logits, step_logits], axis=1), cache["layers"][0]["gdn_state"]

    logits_one, state_one = generate(state, ids)
    mesh = shd.make_mesh(4, 1, 2)
    with jax.set_mesh(mesh):
        wrapped = shard_map_in_specs(jax.make_jaxpr(generate)(state, ids).jaxpr)
        logits_sharded, state_sharded = generate(state, ids)
    # The layers are one scan whose body is traced once per layer kind (here both layers keep one FA group):
    # prefill's flash attention and chunked rule, decode's GDN step.
    assert model.kinds == (1,) and len(wrapped) == 2 + 1, wrapped
    # Same per-row arithmetic; only XLA's partitioned reductions around the kernels change order.
    np.testing.assert_allclose(logits_sharded, logits_one, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state_sharded, state_one, rtol=1e-5, atol=1e-6)


def test_kernel_call_splits_only_what_divides():
    """A per-(row, head) kernel on a data=2 × fsdp=2 × tensor=2 mesh: batch 4 splits over (data, fsdp), batch 2
    over data alone; 6 heads split over tensor, 3 do not. The values are those of the kernel called directly."""
    mesh = shd.make_mesh(2, 2, 2)

    def kernel(x, w):  # x [B,T,H,D], w [B,T,H]: a cumulative sum over time, independent per (row, head)
        return jnp.cumsum(x * w[..., None], axis=1)

    for (b, h), expect in {
        (4, 6): P(("data", "fsdp"), None, "tensor", None),
        (2, 6): P("data", None, "tensor", None),
        (4, 3): P(("data", "fsdp"), None, None, None),
    }.items():
        x = jax.random.normal(jax.random.key(b * h), (b, 5, h, 3))
        w = jax.random.normal(jax.random.key(b + h), (b, 5, h))
        call = functools.partial(kernel_call, kernel, in_axes=(BTHD, BTH), out_axes=BTHD)
        with jax.set_mesh(mesh):
            specs = shard_map_in_specs(jax.make_jaxpr(call)(x, w).jaxpr)
            out = jax.jit(call)(x, w)
        assert specs == [(expect, P(*expect[:3]))], (b, h, specs)
        np.testing.assert_allclose(out, kernel(x, w), rtol=1e-6, atol=1e-6)

    # One device: called as is.
    with jax.set_mesh(one_device_mesh()):
        assert shard_map_in_specs(jax.make_jaxpr(call)(x, w).jaxpr) == []


@pytest.mark.parametrize("mesh", [None, (4, 1, 2)], ids=["no-mesh", "mesh"])
def test_kernel_call_refuses_layouts_that_do_not_fit(mesh):
    x = jnp.zeros((4, 5, 2, 3))
    with jax.set_mesh(shd.make_mesh(*mesh)) if mesh else contextlib.nullcontext():
        with pytest.raises(ValueError, match="one layout each"):
            kernel_call(lambda x: x, x, in_axes=(BTHD, BTHD), out_axes=BTHD)
        with pytest.raises(ValueError, match=r"must name every dimension of an array of shape \(4, 5, 2, 3\)"):
            kernel_call(lambda x: x, x, in_axes=(BTH,), out_axes=BTHD)
        with pytest.raises(ValueError, match="name no input dimension"):
            kernel_call(lambda x: x, x, in_axes=((None,) * 4,), out_axes=BTHD)
