"""The Gated DeltaNet heads: the causal conv on packed rows (no tap reads across a document start), the whole heads
against plain autodiff, and the output gate's hand-written VJP.

Conv reference: each document run on its own through a direct loop over the taps (autodiff for its gradients),
from the row's conv state for the row's first document and from zeros for the others. Gate reference: ``jax.vjp``
of the gate's formula written plainly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_hybrid_model import CFG

from hydrahead_jax.hybrid import gdn as gdn_module
from hydrahead_jax.hybrid.attention import ScaleFusion
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.hybrid.gdn import GatedDeltaNetHeads, causal_depthwise_conv
from pallas_kernels.gated_delta import chunk_gated_delta_rule

W, C = 4, 5
# Two packed rows of 20 tokens: documents of ragged lengths, among them single tokens and documents shorter than
# the conv (W = 4); row 1 ends in padding (segment 0, as the data pipeline marks it).
DOC_LENGTHS = ([5, 1, 2, 9, 3], [3, 12, 1, 2, 2])
ROW_SEGMENTS = ([1, 2, 3, 4, 5], [1, 2, 3, 4, 0])


def _segment_ids():
    return jnp.asarray(
        [np.repeat(ids, lengths) for ids, lengths in zip(ROW_SEGMENTS, DOC_LENGTHS)],
        dtype=jnp.int32,
    )


def _conv_loop(x, w, state):
    """One document: y_t = Σ_j w_j · p_{t+j}, p = [state; x], a Python loop over t and the taps."""
    p = jnp.concatenate([state, x], axis=0)
    return jnp.stack([sum(w[j] * p[t + j] for j in range(W)) for t in range(x.shape[0])])


def _per_document(x, w, state):
    """y [B,T,C] and the new state of each row, every document run separately."""
    ys, new_states = [], []
    for b, lengths in enumerate(DOC_LENGTHS):
        row, start = [], 0
        for i, n in enumerate(lengths):
            history = state[b] if i == 0 else jnp.zeros((W - 1, C))
            row.append(_conv_loop(x[b, start : start + n], w, history))
            start += n
        ys.append(jnp.concatenate(row))
        last = jnp.concatenate([jnp.zeros((W - 1, C)), x[b, start - lengths[-1] : start]])[-(W - 1) :]
        new_states.append(last)
    return jnp.stack(ys), jnp.stack(new_states)


def _inputs(seed):
    kx, kw, ks, kd = jax.random.split(jax.random.key(seed), 4)
    T = sum(DOC_LENGTHS[0])
    return (
        jax.random.normal(kx, (2, T, C)),
        jax.random.normal(kw, (W, C)),
        jax.random.normal(ks, (2, W - 1, C)),
        jax.random.normal(kd, (2, T, C)),
    )


@pytest.mark.parametrize("with_state", [False, True])
def test_conv_on_packed_rows_equals_documents_run_separately(with_state):
    x, w, state, dy = _inputs(0)
    if not with_state:
        state = jnp.zeros_like(state)
    seg = _segment_ids()

    def ours(x, w, state):
        return causal_depthwise_conv(x, w, state if with_state else None, seg)

    y, new_state = ours(x, w, state)
    y_ref, new_state_ref = _per_document(x, w, state)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(new_state, new_state_ref)

    argnums = (0, 1, 2) if with_state else (0, 1)
    grads = jax.grad(lambda *a: jnp.vdot(ours(*a)[0], dy), argnums=argnums)(x, w, state)
    grads_ref = jax.grad(lambda *a: jnp.vdot(_per_document(*a)[0], dy), argnums=argnums)(x, w, state)
    for name, got, want in zip(("dx", "dweight", "dstate"), grads, grads_ref):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("split", [7, 13])
def test_packed_row_in_two_calls_equals_one_call(split):
    """Prefill in pieces: the state handed over keeps only the last document's inputs. Split 7 ends the first
    piece one token into a 2-token document (the state must not carry the two documents before it); split 13
    ends it inside the 9-token document."""
    x, w, _, _ = _inputs(1)
    seg = _segment_ids()
    y_all, state_all = causal_depthwise_conv(x, w, None, seg)
    y1, state1 = causal_depthwise_conv(x[:, :split], w, None, seg[:, :split])
    y2, state2 = causal_depthwise_conv(x[:, split:], w, state1, seg[:, split:])
    np.testing.assert_allclose(jnp.concatenate([y1, y2], axis=1), y_all, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(state2, state_all)


def test_conv_segment_ids_of_wrong_shape_are_refused():
    x, w, _, _ = _inputs(2)
    with pytest.raises(ValueError, match=r"segment_ids must be integer \[batch, time\]"):
        causal_depthwise_conv(x, w, None, _segment_ids()[:, :-1])
    with pytest.raises(ValueError, match="segment_ids must be integer"):
        causal_depthwise_conv(x, w, None, _segment_ids().astype(jnp.float32))


def test_heads_conv_stage_follows_segments():
    """GatedDeltaNetHeads.conv splits the q/k/v channels and masks each per document like the bare conv."""
    heads = GatedDeltaNetHeads(CFG, HybridConfig(), (0, 1), rngs=nnx.Rngs(0))
    heads.conv_weight[...] = jax.random.normal(jax.random.key(3), heads.conv_weight.shape)
    T = sum(DOC_LENGTHS[0])
    kq, kk, kv = jax.random.split(jax.random.key(4), 3)
    D = CFG.head_dim
    q = jax.random.normal(kq, (2, T, CFG.num_heads, D))
    k, v = jax.random.normal(kk, (2, T, 2, D)), jax.random.normal(kv, (2, T, 2, D))
    seg = _segment_ids()
    qc, kc, vc, state = heads.conv(q, k, v, None, seg)
    chans = jnp.concatenate([a.reshape(2, T, -1) for a in (q, k, v)], axis=-1)
    want, want_state = causal_depthwise_conv(chans, heads.conv_weight[...], None, seg)
    got = jnp.concatenate([a.reshape(2, T, -1) for a in (qc, kc, vc)], axis=-1)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(state, want_state)


def _heads_autodiff_reference(params, heads, x, q, k, v):
    """The heads' forward written plainly (XLA's depthwise conv, jnp.repeat, the gate's formula, the token-scan
    reference rule): its gradients come from autodiff alone, none of the module's hand-written VJPs."""
    cfg, hc = heads.cfg, heads.hybrid_cfg
    B, T = x.shape[:2]
    chans = jnp.concatenate([a.reshape(B, T, -1) for a in (q, k, v)], axis=-1)
    conv = jax.lax.conv_general_dilated(
        jnp.pad(chans, [(0, 0), (hc.conv_size - 1, 0), (0, 0)]),
        params["conv_weight"][:, None, :],
        window_strides=(1,),
        padding="VALID",
        dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=chans.shape[-1],
        precision=jax.lax.Precision.HIGHEST,
    )
    nq, nk = q.shape[2] * q.shape[3], k.shape[2] * k.shape[3]
    q = conv[..., :nq].reshape(q.shape)
    k = jnp.repeat(conv[..., nq : nq + nk].reshape(k.shape), cfg.group_size, axis=2)
    v = jnp.repeat(conv[..., nq + nk :].reshape(v.shape), cfg.group_size, axis=2)
    dt = jax.nn.softplus(x @ params["a"] + params["dt_bias"])
    g, beta = -jnp.exp(params["A_log"]) * dt, jax.nn.sigmoid(x @ params["b"])
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, implementation="reference")
    z = (x @ params["z"] + params["z_bias"]).reshape(o.shape)
    rms = jnp.sqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    return o / rms * params["o_norm_weight"] * z * jax.nn.sigmoid(z)


def test_heads_values_and_gradients_match_plain_autodiff():
    """The whole GDN heads (conv, decays, chunked rule, rematerialised gate, their barriers): values and the
    gradients of every parameter and input equal plain autodiff of the same equations, over two chunks."""
    heads = GatedDeltaNetHeads(CFG, HybridConfig(gdn_chunk_size=16, gdn_implementation="xla"), (0, 1), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(heads)
    flat = dict(nnx.to_flat_state(state))
    keys = jax.random.split(jax.random.key(5), len(flat) + 5)
    for i, (path, var) in enumerate(flat.items()):  # every parameter random (zero-initialised ones too)
        noise = 0.3 * jax.random.normal(keys[i], var.shape)
        var.set_value(jnp.exp(noise) if path[-1] == "o_norm_weight" else var[...] + noise)
    state = nnx.from_flat_state(flat)
    B, T, H, D = 2, 37, CFG.num_heads, CFG.head_dim
    kx, kq, kk, kv, kd = keys[-5:]
    x = jax.random.normal(kx, (B, T, CFG.hidden_size))
    q = jax.random.normal(kq, (B, T, H, D))
    k, v = jax.random.normal(kk, (B, T, 2, D)), jax.random.normal(kv, (B, T, 2, D))
    dy = jax.random.normal(kd, (B, T, H, D))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def ours(state, x, q, k, v):
        return nnx.merge(graphdef, state)(x, q, k, v, positions)[0]

    def reference(state, x, q, k, v):
        m = nnx.merge(graphdef, state)
        params = dict(
            conv_weight=m.conv_weight[...],
            a=m.a_proj.kernel[...],
            b=m.b_proj.kernel[...],
            A_log=m.A_log[...],
            dt_bias=m.dt_bias[...],
            z=m.z_proj.kernel[...],
            z_bias=m.z_proj.bias[...],
            o_norm_weight=m.o_norm_weight[...],
        )
        return _heads_autodiff_reference(params, m, x, q, k, v)

    np.testing.assert_allclose(ours(state, x, q, k, v), reference(state, x, q, k, v), atol=1e-4, rtol=1e-4)
    args = (state, x, q, k, v)
    grads = jax.jit(jax.grad(lambda *a: jnp.vdot(ours(*a), dy), argnums=(0, 1, 2, 3, 4)))(*args)
    grads_ref = jax.jit(jax.grad(lambda *a: jnp.vdot(reference(*a), dy), argnums=(0, 1, 2, 3, 4)))(*args)
    for (path, got), (_, want) in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree_util.tree_flatten_with_path(grads_ref)[0]
    ):
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 0, path
        np.testing.assert_allclose(got, want, atol=2e-4 * scale, rtol=1e-3, err_msg=jax.tree_util.keystr(path))


def _gate_reference(o, x, kernel, bias, weight, eps, dtype):
    """The output gate written plainly (z = x W_z + b_z in ``dtype``, the gated RMSNorm in fp32): autodiff only."""
    z = (jnp.dot(x.astype(dtype), kernel.astype(dtype)) + bias.astype(dtype)).reshape(o.shape).astype(jnp.float32)
    o32 = o.astype(jnp.float32)
    y = o32 / jnp.sqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps) * weight * z * jax.nn.sigmoid(z)
    return y.astype(o.dtype)


def _gate_case(dtype, eps, seed=3):
    """Gate heads with random parameters (W_z non-zero) and inputs B=2, T=37 in ``dtype``; o has rows that are
    exactly zero and rows of size 1e-20 (where r = 1 / sqrt(mean o² + eps) is all eps)."""
    cfg = dataclasses.replace(CFG, dtype=jnp.dtype(dtype).name, rms_norm_eps=eps)
    heads = GatedDeltaNetHeads(cfg, HybridConfig(), (0, 1), rngs=nnx.Rngs(0))
    H, D = heads.num_heads, cfg.head_dim
    keys = jax.random.split(jax.random.key(seed), 6)
    heads.z_proj.kernel.set_value(0.3 * jax.random.normal(keys[0], heads.z_proj.kernel.shape))
    heads.z_proj.bias.set_value(heads.z_proj.bias[...] + jax.random.normal(keys[1], (H * D,)))
    heads.o_norm_weight.set_value(jnp.exp(0.3 * jax.random.normal(keys[2], (H, D))))
    B, T = 2, 37
    o = jax.random.normal(keys[3], (B, T, H, D))
    o = o.at[0, 3].set(0.0).at[1, 20, 1].set(0.0).at[1, 30].multiply(1e-20).astype(dtype)
    x = jax.random.normal(keys[4], (B, T, cfg.hidden_size)).astype(dtype)
    dy = jax.random.normal(keys[5], (B, T, H, D)).astype(dtype)
    params = (heads.z_proj.kernel[...], heads.z_proj.bias[...], heads.o_norm_weight[...])
    return heads, o, x, dy, params


def _gate_vjp(heads, o, x):
    """(y, vjp) of heads.output_gate(o, x) as a function of (o, x, W_z, b_z, w); vjp(dy) returns them in that order."""
    graphdef, state = nnx.split(heads)
    y, vjp = jax.vjp(lambda state, o, x: nnx.merge(graphdef, state).output_gate(o, x), state, o, x)

    def grads(dy):
        dstate, do, dx = vjp(dy)
        m = nnx.merge(graphdef, dstate)
        return do, dx, m.z_proj.kernel[...], m.z_proj.bias[...], m.o_norm_weight[...]

    return y, grads


@pytest.mark.parametrize("block", [8, 64])  # 4 blocks and a 5-token tail; one block (T = 37 < 64)
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_output_gate_vjp_matches_autodiff_fp32(monkeypatch, block, eps):
    """The hand-written VJP of the output gate (in token blocks, z recomputed) equals ``jax.vjp`` of the plain
    formula for o, x, W_z, b_z and w, including rows where o is zero or tiny."""
    monkeypatch.setattr(gdn_module, "GATE_BLOCK_TOKENS", block)
    heads, o, x, dy, params = _gate_case(jnp.float32, eps)

    def reference(o, x, kernel, bias, weight):
        return _gate_reference(o, x, kernel, bias, weight, eps, jnp.float32)

    y, vjp = _gate_vjp(heads, o, x)
    y_ref, vjp_ref = jax.vjp(reference, o, x, *params)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(y[0, 3]) == 0)  # a zero row stays zero
    for name, got, want in zip(("o", "x", "W_z", "b_z", "w"), vjp(dy), vjp_ref(dy)):
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 0 and np.all(np.isfinite(got)), name
        np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_output_gate_vjp_bf16_is_as_accurate_as_autodiff(monkeypatch, eps):
    """bf16 activations (the compute dtype of training): the hand-written VJP returns each gradient in its input's
    dtype, and its error against the fp32 gradients of the same (bf16-valued) inputs is no larger than that of
    autodiff run in bf16 (plus bf16 rounding of one value)."""
    monkeypatch.setattr(gdn_module, "GATE_BLOCK_TOKENS", 8)
    heads, o, x, dy, params = _gate_case(jnp.bfloat16, eps)

    y, vjp = _gate_vjp(heads, o, x)
    args32 = [a.astype(jnp.float32) for a in (o, x, *params)]
    y32, vjp32 = jax.vjp(lambda *a: _gate_reference(*a, eps, jnp.float32), *args32)
    _, vjp16 = jax.vjp(lambda *a: _gate_reference(*a, eps, jnp.bfloat16), o, x, *params)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(y.astype(jnp.float32), y32, atol=2e-2 * float(jnp.max(jnp.abs(y32))), rtol=2e-2)
    for name, got, auto, want, arg in zip(
        ("o", "x", "W_z", "b_z", "w"), vjp(dy), vjp16(dy), vjp32(dy.astype(jnp.float32)), (o, x, *params)
    ):
        assert got.dtype == arg.dtype, name
        scale = float(jnp.max(jnp.abs(want)))
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
        err_auto = float(jnp.max(jnp.abs(auto.astype(jnp.float32) - want)))
        assert err <= err_auto + 2**-8 * scale, (name, err, err_auto, scale)
        assert err <= 3e-2 * scale, (name, err, scale)


def test_output_gate_backward_runs_as_one_block_when_time_is_split(monkeypatch):
    """With the time axis split over a ``sequence`` mesh axis (context parallelism), the gate's backward has no
    loop over token blocks (a dynamic slice of a split axis would gather the sequence) and the same gradients."""
    monkeypatch.setattr(gdn_module, "GATE_BLOCK_TOKENS", 8)
    heads, o, x, dy, _ = _gate_case(jnp.float32, 1e-6)

    def grads(o, x):
        return jax.vjp(heads.output_gate, o, x)[1](dy)

    looped = jax.make_jaxpr(grads)(o, x)
    mesh = jax.make_mesh((2,), ("sequence",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        split = jax.make_jaxpr(grads)(o, x)
        grads_split = grads(o, x)

    def has_loop(jaxpr):
        return any(f"{p}[" in str(jaxpr) for p in ("scan", "while"))

    assert has_loop(looped) and not has_loop(split)
    for got, want in zip(grads_split, grads(o, x)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("granularity", ["head", "channel"])
def test_scale_fusion_vjp_matches_autodiff(dtype, granularity):
    """The fusion's hand-written VJP (the gate's without a gate) equals ``jax.vjp`` of γ ⊙ o / sqrt(mean o² + eps)
    computed in fp32 from the same inputs, with zero rows; gradients come back in the inputs' dtypes."""
    H, D, eps = 3, 16, 1e-5
    fusion = ScaleFusion(H, D, granularity=granularity, eps=eps, param_dtype=jnp.float32)
    keys = jax.random.split(jax.random.key(11), 3)
    gamma = jnp.exp(0.3 * jax.random.normal(keys[0], fusion.gamma.shape))
    o = jax.random.normal(keys[1], (2, 13, H, D)).at[0, 4].set(0.0).at[1, 7, 2].set(0.0).astype(dtype)
    dy = jax.random.normal(keys[2], o.shape).astype(dtype)
    graphdef, state = nnx.split(fusion)
    state["gamma"].set_value(gamma)

    y, vjp = jax.vjp(lambda state, o: nnx.merge(graphdef, state)(o), state, o)
    dstate, do = vjp(dy)

    def reference(o, gamma):
        g = gamma[:, None] if granularity == "head" else gamma
        return o / jnp.sqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps) * g

    y_ref, vjp_ref = jax.vjp(reference, o.astype(jnp.float32), gamma)
    do_ref, dgamma_ref = vjp_ref(dy.astype(jnp.float32))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert y.dtype == dtype and do.dtype == dtype
    for name, got, want in (("y", y, y_ref), ("o", do, do_ref), ("gamma", dstate["gamma"][...], dgamma_ref)):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(got.astype(jnp.float32), want, atol=tol * scale, rtol=tol, err_msg=name)
