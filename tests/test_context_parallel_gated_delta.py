"""Gated DeltaNet heads under context parallelism: the rule, the conv and the module with the time axis split over
the ``sequence`` mesh axis equal the unsharded ones (values and gradients).

Reference: the unsharded call on the row in natural order (``chunk_gated_delta_rule`` with the XLA backend,
``causal_depthwise_conv``, the module without a mesh). The sharded call runs through ``kernel_call`` under
``jax.set_mesh`` on the row permuted by ``to_layout``, as the model runs it, and is permuted back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_hybrid_model import CFG

import hydrahead_jax.context_parallel.gated_delta as cp_gdn
from hydrahead_jax.context_parallel import (
    from_layout,
    sequence_parallel_causal_conv,
    sequence_parallel_gated_delta_rule,
    to_layout,
)
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.hybrid.gdn import GatedDeltaNetHeads, causal_depthwise_conv
from hydrahead_jax.models.kernel_sharding import BHKV, BS, BSH, BSHD, kernel_call, sequence_axes
from hydrahead_jax.training.sharding import make_mesh
from pallas_kernels.gated_delta import chunk_gated_delta_rule

MESHES = {"sequence8": (1, 8), "data2_sequence4": (2, 4)}  # (data, sequence)
B, T, H, K, V = 2, 128, 2, 16, 32
CHUNK = 16
# Packed rows of T tokens. Row 0: a 5-token document inside the first chunk, a document start at 16 and at 64 (chunk
# and shard borders under every mesh and layout here), a document from 16 to 64 (over 3+ shards at sequence=8) and
# trailing padding (id 0). Row 1: starts at 32 and 64 (borders), documents of 1 and 2 tokens.
DOC_LENGTHS = ([5, 11, 48, 9, 30, 25], [32, 32, 1, 2, 40, 21])
DOC_IDS = ([1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 6])


def _mesh(name):
    data, sequence = MESHES[name]
    return make_mesh(data, 1, 1, sequence=sequence), sequence


def _segment_ids(lengths=DOC_LENGTHS, ids=DOC_IDS):
    return jnp.asarray([np.repeat(i, n) for i, n in zip(ids, lengths)], jnp.int32)


def _rule_inputs(seed, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -0.3 * jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)))  # decays α ∈ (0.5, 1): long memories
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = jax.random.normal(ks[5], (B, H, K, V))
    cotangents = (jax.random.normal(ks[6], (B, T, H, V)), jax.random.normal(ks[7], (B, H, K, V)))
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta)) + (s0,), cotangents


def _values_and_grads(fn, args, cotangents, argnums):
    """(outputs, gradients of <outputs, cotangents> w.r.t. args[argnums]), one jit."""

    def run(*args):
        out, vjp = jax.vjp(
            lambda *diff: fn(*[dict(zip(argnums, diff)).get(i, a) for i, a in enumerate(args)]),
            *(args[i] for i in argnums),
        )
        return out, vjp(tuple(c if o is not None else None for o, c in zip(out, cotangents)))

    return jax.jit(run)(*args)


def _rule_reference(q, k, v, g, beta, s0, segment_ids=None, *, implementation="xla"):
    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=s0,
        segment_ids=segment_ids,
        output_final_state=True,
        use_qk_l2norm=True,
        chunk_size=CHUNK,
        implementation=implementation,
    )


def _rule_sharded(q, k, v, g, beta, s0, segment_ids=None, *, n, layout, implementation="xla"):
    """The context-parallel rule as the model calls it: per device, tokens in ``layout`` order."""
    rule = functools.partial(
        sequence_parallel_gated_delta_rule,
        axis_name=sequence_axes(),
        layout=layout,
        chunk_size=CHUNK,
        use_qk_l2norm=True,
        implementation=implementation,
        output_final_state=True,
    )
    tokens = [to_layout(x, n, layout) for x in (q, k, v, g, beta)]
    seg = None if segment_ids is None else to_layout(segment_ids, n, layout)
    o, state = kernel_call(
        rule,
        *tokens,
        s0,
        seg,
        in_axes=(BSHD, BSHD, BSHD, BSH, BSH, None if s0 is None else BHKV, None if seg is None else BS),
        out_axes=(BSHD, BHKV),
    )
    return from_layout(o, n, layout), state


def _assert_close(got, want, name, rel=1e-5):
    scale = float(jnp.max(jnp.abs(want)))
    assert scale > 0, name
    np.testing.assert_allclose(got, want, atol=rel * scale, rtol=rel, err_msg=name)


def _check_rule(mesh_name, layout, *, with_state, segments, implementation="xla", seed=0):
    mesh, n = _mesh(mesh_name)
    args, cotangents = _rule_inputs(seed)
    if not with_state:
        args = args[:5] + (None,)
    seg = _segment_ids() if segments else None
    argnums = (0, 1, 2, 3, 4, 5) if with_state else (0, 1, 2, 3, 4)
    want = _values_and_grads(functools.partial(_rule_reference, segment_ids=seg), args, cotangents, argnums)
    with jax.set_mesh(mesh):
        got = _values_and_grads(
            functools.partial(_rule_sharded, segment_ids=seg, n=n, layout=layout, implementation=implementation),
            args,
            cotangents,
            argnums,
        )
    names = ("o", "final_state") + tuple("d" + ("q", "k", "v", "g", "beta", "initial_state")[i] for i in argnums)
    for name, a, b in zip(names, jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _assert_close(a, b, f"{mesh_name} {layout}: {name}")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_rule_with_initial_state_equals_unsharded(mesh_name, layout):
    _check_rule(mesh_name, layout, with_state=True, segments=False)


@pytest.mark.parametrize(
    ("mesh_name", "layout", "with_state"),
    [("sequence8", "zigzag", False), ("data2_sequence4", "contiguous", True)],
)
def test_rule_on_packed_documents_equals_unsharded(mesh_name, layout, with_state):
    """Document starts inside a chunk, exactly on shard borders (the incoming state must be dropped there) and
    a document over several shards (its state must pass through them)."""
    _check_rule(mesh_name, layout, with_state=with_state, segments=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_rule_without_initial_state_equals_unsharded(layout):
    _check_rule("data2_sequence4", layout, with_state=False, segments=False)


@pytest.mark.slow
def test_rule_with_pallas_kernel_equals_unsharded():
    """The per-device call goes through the public API: the Pallas kernel (interpret mode here) works the same."""
    _check_rule("data2_sequence4", "zigzag", with_state=True, segments=True, implementation="pallas")


def test_rule_in_bf16_stays_within_the_unsharded_error():
    """bf16 inputs: the sharded rule's output error against an fp32 reference is at most 2x the unsharded bf16
    rule's. The final state is fp32 in both (the rule computes in fp32), so it gets the fp32 tolerance."""
    mesh, n = _mesh("sequence8")
    args, _ = _rule_inputs(1, jnp.bfloat16)
    exact = _rule_reference(*(x.astype(jnp.float32) for x in args))
    unsharded = jax.jit(_rule_reference)(*args)
    with jax.set_mesh(mesh):
        sharded = jax.jit(functools.partial(_rule_sharded, n=n, layout="zigzag"))(*args)
    assert sharded[0].dtype == jnp.bfloat16
    budget = float(jnp.max(jnp.abs(unsharded[0].astype(jnp.float32) - exact[0])))
    error = float(jnp.max(jnp.abs(sharded[0].astype(jnp.float32) - exact[0])))
    assert 0 < budget and error <= 2 * budget, (error, budget)
    _assert_close(sharded[1], unsharded[1], "final_state")


def test_rule_refuses_a_local_length_that_does_not_split_into_its_chunks():
    args, _ = _rule_inputs(0)
    odd = [x[:, :7] for x in args[:5]]
    with pytest.raises(ValueError, match="do not split into the 2 chunks of the zigzag layout"):
        sequence_parallel_gated_delta_rule(*odd, axis_name="sequence", layout="zigzag")


# ----------------------------------------------------------------------------------------------- the conv halo
W, C = 4, 6


def _conv_sharded(x, weight, state, segment_ids, *, n, layout):
    conv = functools.partial(sequence_parallel_causal_conv, axis_name=sequence_axes(), layout=layout)
    seg = None if segment_ids is None else to_layout(segment_ids, n, layout)
    chans = ("batch", "sequence", None)
    y, new_state = kernel_call(
        conv,
        to_layout(x, n, layout),
        weight,
        state,
        seg,
        in_axes=(chans, (None, None), None if state is None else ("batch", None, None), None if seg is None else BS),
        out_axes=(chans, ("batch", None, None)),
    )
    return from_layout(y, n, layout), new_state


@pytest.mark.parametrize(
    ("mesh_name", "layout", "length", "with_state", "segments"),
    [
        ("sequence8", "zigzag", T, True, True),
        ("data2_sequence4", "contiguous", T, False, True),
        ("data2_sequence4", "zigzag", T, True, False),
        # chunks of 1 token (sequence=8, zig-zag over 16 tokens): the halo spans the 3 chunks before each chunk.
        ("sequence8", "zigzag", 16, True, True),
        ("data2_sequence4", "zigzag", 16, True, True),
    ],
)
def test_conv_with_halo_equals_unsharded(mesh_name, layout, length, with_state, segments):
    mesh, n = _mesh(mesh_name)
    kx, kw, ks, kd, kn = jax.random.split(jax.random.key(2), 5)
    x, weight = jax.random.normal(kx, (B, length, C)), jax.random.normal(kw, (W, C))
    state = jax.random.normal(ks, (B, W - 1, C)) if with_state else None
    cotangents = (jax.random.normal(kd, (B, length, C)), jax.random.normal(kn, (B, W - 1, C)))
    if not segments:
        seg = None
    elif length == T:
        seg = _segment_ids()
    else:  # a 1-token document between two others, starts inside and on chunk borders, padding at the end
        seg = _segment_ids(([3, 1, 2, 6, 4], [5, 2, 1, 1, 7]), ([1, 2, 3, 4, 0], [1, 2, 3, 4, 5]))
    argnums = (0, 1, 2) if with_state else (0, 1)
    args = (x, weight, state)
    want = _values_and_grads(functools.partial(causal_depthwise_conv, segment_ids=seg), args, cotangents, argnums)
    with jax.set_mesh(mesh):
        got = _values_and_grads(
            functools.partial(_conv_sharded, segment_ids=seg, n=n, layout=layout), args, cotangents, argnums
        )
    for name, a, b in zip(("y", "new_state", "dx", "dweight", "dstate"), jax.tree.leaves(got), jax.tree.leaves(want)):
        _assert_close(a, b, name)


# ----------------------------------------------------------------------------------------------- the module
def _random_heads(seed):
    """GatedDeltaNetHeads with every parameter random (zero-initialised ones too), as test_gdn_heads builds it."""
    heads = GatedDeltaNetHeads(CFG, HybridConfig(gdn_chunk_size=16, gdn_implementation="xla"), (0, 1), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(heads)
    flat = dict(nnx.to_flat_state(state))
    keys = jax.random.split(jax.random.key(seed), len(flat))
    for key, (path, var) in zip(keys, flat.items()):
        noise = 0.3 * jax.random.normal(key, var.shape)
        var.set_value(jnp.exp(noise) if path[-1] == "o_norm_weight" else var[...] + noise)
    return graphdef, nnx.from_flat_state(flat)


def _module_inputs(seed, length):
    kx, kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 5)
    D = CFG.head_dim
    x = jax.random.normal(kx, (B, length, CFG.hidden_size))
    q = jax.random.normal(kq, (B, length, CFG.num_heads, D))
    k, v = jax.random.normal(kk, (B, length, 2, D)), jax.random.normal(kv, (B, length, 2, D))
    dy = jax.random.normal(kd, (B, length, CFG.num_heads, D))
    positions = jnp.broadcast_to(jnp.arange(length), (B, length))
    return (x, q, k, v), positions, dy


MODULE_T = 64  # zig-zag over 8 devices: chunks of 4 tokens, one more than the conv's halo


def test_heads_under_sequence_mesh_equal_unsharded_values_and_gradients():
    """Training call on packed rows: outputs and the gradients of every parameter and input."""
    graphdef, params = _random_heads(5)
    tokens, positions, dy = _module_inputs(6, MODULE_T)
    seg = _segment_ids(([5, 11, 16, 9, 23], [32, 3, 1, 28]), ([1, 2, 3, 4, 0], [1, 2, 3, 4]))
    n = 8

    def loss(params, *tokens, permute):
        order = (lambda a: to_layout(a, n, "zigzag")) if permute else (lambda a: a)
        o, _ = nnx.merge(graphdef, params)(*map(order, tokens), order(positions), segment_ids=order(seg))
        return jnp.vdot(from_layout(o, n, "zigzag") if permute else o, dy)

    grad = functools.partial(jax.value_and_grad, argnums=(0, 1, 2, 3, 4))
    want = jax.jit(grad(functools.partial(loss, permute=False)))(params, *tokens)
    with jax.set_mesh(make_mesh(1, 1, 1, sequence=8)):
        got = jax.jit(grad(functools.partial(loss, permute=True)))(params, *tokens)
    _assert_close(got[0], want[0], "loss")
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_flatten_with_path(got[1])[0], jax.tree_util.tree_flatten_with_path(want[1])[0], strict=True
    ):
        _assert_close(a, b, jax.tree_util.keystr(path), rel=2e-5)


def test_prefill_under_sequence_mesh_fills_the_unsharded_cache():
    graphdef, params = _random_heads(7)
    tokens, positions, _ = _module_inputs(8, MODULE_T)
    heads = nnx.merge(graphdef, params)
    kg, kc = jax.random.split(jax.random.key(9))
    cache = heads.init_cache(B, jnp.float32)
    cache = {
        "gdn_state": 0.3 * jax.random.normal(kg, cache["gdn_state"].shape),
        "conv_state": jax.random.normal(kc, cache["conv_state"].shape),
    }
    n = 8

    def prefill(params, cache, *tokens, permute):
        order = (lambda a: to_layout(a, n, "zigzag")) if permute else (lambda a: a)
        o, new_cache = nnx.merge(graphdef, params)(*map(order, tokens), order(positions), cache=cache)
        return (from_layout(o, n, "zigzag") if permute else o), new_cache

    want = jax.jit(functools.partial(prefill, permute=False))(params, cache, *tokens)
    with jax.set_mesh(make_mesh(1, 1, 1, sequence=8)):
        got = jax.jit(functools.partial(prefill, permute=True))(params, cache, *tokens)
    _assert_close(got[0], want[0], "o")
    _assert_close(got[1]["gdn_state"], want[1]["gdn_state"], "gdn_state")
    np.testing.assert_array_equal(got[1]["conv_state"], want[1]["conv_state"])


def test_each_device_runs_the_rule_on_its_own_tokens_only(monkeypatch):
    """Compiled under sequence=8, the module's rule call sees each device's T/8 tokens (two zig-zag chunks stacked
    on the batch axis), never the whole row."""
    seen = []

    def spy(q, *args, **kwargs):
        seen.append(q.shape)
        return chunk_gated_delta_rule(q, *args, **kwargs)

    monkeypatch.setattr(cp_gdn, "chunk_gated_delta_rule", spy)
    graphdef, params = _random_heads(5)
    tokens, positions, _ = _module_inputs(6, MODULE_T)

    def forward(params, *tokens):
        return nnx.merge(graphdef, params)(*tokens, positions)[0]

    with jax.set_mesh(make_mesh(1, 1, 1, sequence=8)):
        jax.jit(forward).lower(params, *tokens).compile()
    assert seen == [(2 * B, MODULE_T // 16, CFG.num_heads, CFG.head_dim)]
