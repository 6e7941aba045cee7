"""Gated delta rule: chunked XLA, decode step and Pallas kernels against the token-by-token reference.

What interpret mode proves here: the Pallas kernels' chunk math, block specs, index maps, chunk-state
saving and the custom_vjp backward are right (the same kernel bodies run on CPU). It does not prove
that Triton / Mosaic lower them; the tests marked "needs a GPU"/"needs a TPU" do that on such machines
(bench/gpu_check_gated_delta.py is the fuller GPU check).
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import import_oracle

from pallas_kernels.gated_delta import (
    chunk_gated_delta_rule,
    chunk_math,
    gated_delta_rule_step,
    naive_gated_delta_rule,
    pallas_gpu,
    pallas_tpu,
)


def make_inputs(B, T, H, K, V, seed=0, unit_keys=True, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    if unit_keys:  # the delta rule is only contractive for ‖k‖ ≈ 1 (what the model feeds it)
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)) - 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = 0.5 * jax.random.normal(ks[5], (B, H, K, V))
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta)) + (s0,)


def weighted_loss(fn):
    """A loss that touches every output element with a distinct weight (so no gradient cancels)."""

    def loss(q, k, v, g, beta, s0):
        o, s = fn(q, k, v, g, beta, s0)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        return jnp.sum(o.astype(jnp.float32) * w) + 0.3 * jnp.sum(jnp.sin(s))

    return loss


def runner(implementation, *, chunk_size=64, l2=False, **extra):
    def fn(q, k, v, g, beta, s0):
        kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm=l2)
        if implementation == "naive":
            return naive_gated_delta_rule(q, k, v, g, beta, **kw)
        if extra:  # direct backend call with non-default tiling
            mod = pallas_gpu if implementation == "pallas_gpu" else pallas_tpu
            f = getattr(mod, f"chunk_gated_delta_rule_{implementation}")
            return f(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, chunk_size=chunk_size, interpret=True, **kw, **extra)
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, implementation=implementation, **kw)

    return fn


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ---------------------------------------------------------------- chunked XLA == naive


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_xla_matches_naive(l2, with_state):
    q, k, v, g, beta, s0 = make_inputs(2, 100, 2, 16, 8, unit_keys=not l2)  # T = 100: not a chunk multiple
    s0 = s0 if with_state else None
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm=l2)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, **kw)
    for chunk_size in (32, 64):
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, implementation="xla", **kw)
        assert o.shape == (2, 100, 2, 8) and o.dtype == q.dtype
        assert s.shape == (2, 2, 16, 8) and s.dtype == jnp.float32
        np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5)
        o2, none = chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=chunk_size, implementation="xla", initial_state=s0, use_qk_l2norm=l2
        )
        assert none is None
        np.testing.assert_array_equal(o2, o)


def test_xla_gradients_match_naive():
    args = make_inputs(1, 100, 2, 16, 8, seed=1)
    g_ref = jax.grad(weighted_loss(runner("naive")), argnums=range(6))(*args)
    g_xla = jax.grad(weighted_loss(runner("xla", chunk_size=32)), argnums=range(6))(*args)
    for name, a, b in zip("q k v g beta initial_state".split(), g_xla, g_ref):
        assert rel_err(a, b) < 2e-5, name


def test_xla_gradients_match_naive_with_l2norm():
    args = make_inputs(1, 70, 1, 16, 8, seed=2, unit_keys=False)
    g_ref = jax.grad(weighted_loss(runner("naive", l2=True)), argnums=range(6))(*args)
    g_xla = jax.grad(weighted_loss(runner("xla", l2=True)), argnums=range(6))(*args)
    for name, a, b in zip("q k v g beta initial_state".split(), g_xla, g_ref):
        assert rel_err(a, b) < 2e-5, name


def test_strong_decay_stays_finite():
    """g = −20 every step: e^{−20·63} underflows inside a chunk; masking before exp keeps it finite."""
    q, k, v, _, beta, s0 = make_inputs(1, 150, 2, 16, 8, seed=3)
    g = jnp.full(beta.shape, -20.0)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, implementation="xla")
    assert np.isfinite(o).all() and np.isfinite(s).all()
    np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5)
    grads = jax.grad(weighted_loss(runner("xla")), argnums=range(6))(q, k, v, g, beta, s0)
    assert all(np.isfinite(x).all() for x in grads)


def test_long_sequence_65536():
    q, k, v, g, beta, s0 = make_inputs(1, 65536, 1, 16, 16, seed=4)
    fn = jax.jit(lambda *a: chunk_gated_delta_rule(*a, output_final_state=True, implementation="xla"))
    o, s = fn(q, k, v, g, beta)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    o_ref, s_ref = jax.jit(lambda *a: naive_gated_delta_rule(*a, output_final_state=True))(q, k, v, g, beta)
    np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- decode step


@pytest.mark.parametrize("l2", [False, True])
def test_step_iterated_matches_naive(l2):
    q, k, v, g, beta, s0 = make_inputs(2, 20, 3, 16, 8, seed=5, unit_keys=not l2)
    o_ref, s_ref = naive_gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=l2, scale=0.3
    )
    s, outs = s0, []
    for t in range(q.shape[1]):
        o_t, s = gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s, scale=0.3, use_qk_l2norm=l2)
        outs.append(o_t)
    np.testing.assert_allclose(jnp.stack(outs, 1), o_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5)


def test_step_rejects_bad_shapes():
    q, k, v, g, beta, s0 = make_inputs(1, 1, 2, 8, 4)
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0[..., :3])


# ---------------------------------------------------------------- Pallas kernels (interpret mode)


@pytest.mark.parametrize("impl,extra", [("pallas_gpu", dict(block_v=16)), ("pallas_tpu", {})])
def test_pallas_forward_and_grads_f32(impl, extra):
    """T = 100 with chunk 32 (ragged), K = 16, V = 24 (padded to 32: two value tiles on the GPU kernel)."""
    args = make_inputs(1, 100, 2, 16, 24, seed=6, unit_keys=False)
    ref = runner("naive", l2=True)
    pal = runner(impl, chunk_size=32, l2=True, **extra)
    for a, b in zip(pal(*args), ref(*args)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
    g_ref = jax.grad(weighted_loss(ref), argnums=range(6))(*args)
    g_pal = jax.grad(weighted_loss(pal), argnums=range(6))(*args)
    for name, a, b in zip("q k v g beta initial_state".split(), g_pal, g_ref):
        assert rel_err(a, b) < 2e-5, name


def test_pallas_strong_decay_stays_finite():
    q, k, v, _, beta, s0 = make_inputs(1, 80, 1, 16, 16, seed=7)
    g = jnp.full(beta.shape, -20.0)
    fn = runner("pallas")
    o, s = fn(q, k, v, g, beta, s0)
    o_ref, s_ref = runner("naive")(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5)
    grads = jax.grad(weighted_loss(fn), argnums=range(6))(q, k, v, g, beta, s0)
    assert all(np.isfinite(x).all() for x in grads)


def test_pallas_bf16_within_reference_error():
    """bf16 inputs: the kernel's error against an fp32 oracle must be within 2x of the reference's own."""
    f32_args = make_inputs(1, 96, 2, 32, 32, seed=8)
    bf_args = tuple(x.astype(jnp.bfloat16) for x in f32_args[:5]) + (f32_args[5],)
    oracle, ref, pal = runner("naive", l2=True), runner("naive", l2=True), runner("pallas", l2=True)
    o_oracle, s_oracle = oracle(*f32_args)
    (o_ref, s_ref), (o_pal, s_pal) = ref(*bf_args), pal(*bf_args)
    assert o_pal.dtype == jnp.bfloat16 and s_pal.dtype == jnp.float32
    for got, base, want in ((o_pal, o_ref, o_oracle), (s_pal, s_ref, s_oracle)):
        assert rel_err(got, want) <= 2 * rel_err(base, want)
    g_oracle = jax.grad(weighted_loss(oracle), argnums=range(6))(*f32_args)
    g_ref = jax.grad(weighted_loss(ref), argnums=range(6))(*bf_args)
    g_pal = jax.grad(weighted_loss(pal), argnums=range(6))(*bf_args)
    for name, got, base, want in zip("q k v g beta initial_state".split(), g_pal, g_ref, g_oracle):
        assert got.dtype == base.dtype, name
        assert rel_err(got, want) <= 2 * rel_err(base, want), name


@pytest.mark.parametrize("chunk,K,V,packed", [(64, 24, 20, False), (32, 16, 40, True), (64, 64, 16, True)])
def test_prologue_kernel_matches_the_xla_prologue(chunk, K, V, packed):
    """The GPU prologue kernel (interpret mode) against chunk_math's XLA prologue on the same inputs: q, k, W, U and
    G of every chunk, with nearly parallel keys (the case where an inaccurate inverse of I + A shows) and with
    packed documents. Measured: relative differences up to 1.2e-7 (fp32 rounding of two orders of summation)."""
    from pallas_kernels.gated_delta import chunk_math, pallas_gpu

    B, T, H = 2, 150, 2
    q, k, v, g, beta, _ = make_inputs(B, T, H, K, V, seed=31, unit_keys=False)
    base = jax.random.normal(jax.random.key(5), (K,))
    k = base + 0.05 * k  # every key close to one direction: A is far from diagonal
    cfg = chunk_math.RuleConfig(
        scale=K**-0.5,
        use_qk_l2norm=True,
        chunk_size=chunk,
        key_dim_padded=chunk_math._round_up_pow2(K),
        value_dim_padded=chunk_math._round_up_pow2(V),
        operand_dtype=jnp.dtype(jnp.float32),
        prec=jax.lax.Precision.HIGHEST,
    )
    doc = None
    if packed:
        seg = jnp.sort(jax.random.randint(jax.random.key(6), (B, T), 0, 5), axis=1)
        doc = chunk_math.chunk_documents(seg, chunk)
    want = chunk_math._prepare(cfg, q, k, v, g, beta, doc)
    got = pallas_gpu.prologue_call(
        cfg, q, k, v, g, beta, None if doc is None else chunk_math._doc_operand(doc, H), interpret=True
    )
    for name, a, b in zip(("q", "k", "W", "U", "G"), got, want):
        assert a.shape == b.shape, name
        assert rel_err(a, b) < 1e-6, (name, rel_err(a, b))


def test_pallas_gpu_rule_runs_the_prologue_kernel_forward_and_backward():
    """With bf16 inputs the kernel replaces the XLA prologue for the forward's operands and for the backward's
    recomputed ones (the prologue's VJP stays XLA's): two prologue kernels in the gradient's program. fp32 inputs
    keep the exact XLA prologue (no prologue kernel)."""
    args = make_inputs(1, 40, 1, 16, 16, seed=24)
    half = tuple(x.astype(jnp.bfloat16) for x in args[:5]) + (args[5],)
    grad = jax.grad(weighted_loss(runner("pallas_gpu", chunk_size=16)), argnums=range(6))
    assert _pallas_operand_counts(grad, *half).get("gated_delta_prologue") == 4  # k, v, g, beta
    assert str(jax.make_jaxpr(grad)(*half)).count("name=gated_delta_prologue") == 2
    assert "gated_delta_prologue" not in _pallas_operand_counts(grad, *args)


# Lengths from a few buckets (one token, under / exactly / over one chunk, several chunks with a ragged tail), so
# examples reuse compilations (in a run and through the persistent cache across runs) while covering every edge.
T_BUCKETS = [1, 15, 16, 33, 80]


@settings(max_examples=4, deadline=None)
@given(
    B=st.integers(1, 2),
    T=st.sampled_from(T_BUCKETS),
    H=st.integers(1, 2),
    K=st.sampled_from([8, 16, 24]),
    V=st.sampled_from([4, 16, 20]),
    chunk=st.sampled_from([16, 32]),
    l2=st.booleans(),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(B, T, H, K, V, chunk, l2, with_state, seed):
    q, k, v, g, beta, s0 = make_inputs(B, T, H, K, V, seed=seed, unit_keys=not l2)
    kw = dict(initial_state=s0 if with_state else None, output_final_state=True, use_qk_l2norm=l2)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, **kw)
    for impl in ("xla", "pallas"):
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, implementation=impl, **kw)
        np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5, err_msg=impl)
        np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5, err_msg=impl)


def _find_eqns(jaxpr, name, inside=False, found=None):
    """(eqn name, inside-shard_map) pairs for every eqn named `name`, walking all sub-jaxprs."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(inside)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    _find_eqns(sub, name, inside or eqn.primitive.name == "shard_map", found)
    return found


def test_pallas_inside_shard_map():
    """Pallas custom calls cannot be auto-partitioned: sharded use wraps the kernel in shard_map."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "heads"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    args = make_inputs(4, 40, 2, 16, 16, seed=9)
    spec4, spec3 = P("data", None, "heads", None), P("data", None, "heads")
    specs = (spec4, spec4, spec4, spec3, spec3, P("data", "heads"))
    q, k, v, g, beta, s0 = (jax.device_put(x, jax.NamedSharding(mesh, s)) for x, s in zip(args, specs))

    def kernel(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=32, implementation="pallas"
        )

    sharded = jax.jit(
        jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=(spec4, P("data", "heads")), check_vma=False)
    )
    jaxpr = jax.make_jaxpr(sharded)(q, k, v, g, beta, s0).jaxpr
    where = _find_eqns(jaxpr, "pallas_call")
    assert where and all(where), f"pallas_call outside shard_map: {where}"
    o_sh, s_sh = sharded(q, k, v, g, beta, s0)
    assert o_sh.sharding.spec == spec4
    o, s = kernel(*args)
    np.testing.assert_allclose(o_sh, o, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(s_sh, s, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- transformers' torch oracle


def test_matches_transformers_qwen3_next():
    torch = import_oracle("torch")  # the only external oracle of the rule: missing under `make test` is a failure
    m = import_oracle("transformers.models.qwen3_next.modeling_qwen3_next")

    # Called as transformers' model calls it: from 5.25 the name is a hub-kernel dispatcher (`kernels`' Func module)
    # that falls back to the torch code on CPU and drops keywords the implementation does not accept, so the
    # L2-norm switch is checked by its effect (the keys are not unit-norm) rather than by a signature.
    q, k, v, g, beta, s0 = make_inputs(2, 100, 2, 16, 8, seed=10, unit_keys=False)
    t = lambda x: torch.from_numpy(np.asarray(x))

    def oracle(l2norm):
        return m.torch_chunk_gated_delta_rule(
            t(q),
            t(k),
            t(v),
            t(g),
            t(beta),
            chunk_size=64,
            initial_state=t(s0),
            output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm,
        )

    o_t, s_t = oracle(True)
    assert not np.allclose(o_t.numpy(), oracle(False)[0].numpy(), atol=1e-3), "the oracle ignored its L2-norm switch"
    for impl in ("xla", "pallas"):
        o, s = chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True, implementation=impl
        )
        np.testing.assert_allclose(o, o_t.numpy(), atol=1e-5, rtol=1e-5, err_msg=impl)
        np.testing.assert_allclose(s, s_t.numpy(), atol=1e-5, rtol=1e-5, err_msg=impl)


# ---------------------------------------------------------------- WY solve


@pytest.mark.parametrize("c", [16, 64])
def test_unit_lower_solve_and_its_vjp_match_solve_triangular(c):
    """Values and both gradients of the blocked solve against LAPACK's triangular solve under autodiff."""
    ka, kr1, kr2, kw1, kw2 = jax.random.split(jax.random.key(c), 5)
    # Correlated keys make A large: entries in (0, 1), the case where solve-free products fail.
    a = jnp.tril(jax.random.uniform(ka, (2, 3, c, c)), -1)
    rhs = (jax.random.normal(kr1, (2, 3, c, 8)), jax.random.normal(kr2, (2, 3, c, 5)))
    wts = (jax.random.normal(kw1, (2, 3, c, 8)), jax.random.normal(kw2, (2, 3, c, 5)))
    eye = jnp.eye(c)

    def ref(a, rhs):
        return tuple(jax.scipy.linalg.solve_triangular(eye + a, r, lower=True, unit_diagonal=True) for r in rhs)

    def loss(fn):
        return lambda a, rhs: sum(jnp.vdot(x, w) for x, w in zip(fn(a, rhs), wts))

    for got, want in zip(chunk_math.unit_lower_solve(a, rhs), ref(a, rhs)):
        assert rel_err(got, want) < 1e-5
    (da, drhs), (da_ref, drhs_ref) = (
        jax.grad(loss(f), argnums=(0, 1))(a, rhs) for f in (chunk_math.unit_lower_solve, ref)
    )
    # Only the strictly lower part of A is an input of the solve; autodiff of the reference fills the rest too.
    assert rel_err(da, jnp.tril(da_ref, -1)) < 1e-5
    assert not np.any(np.triu(np.asarray(da)))
    for got, want in zip(drhs, drhs_ref):
        assert rel_err(got, want) < 1e-5


# ---------------------------------------------------------------- API


def test_api_validation():
    q, k, v, g, beta, s0 = make_inputs(1, 10, 2, 8, 4)
    with pytest.raises(ValueError, match="auto, xla, pallas, pallas_gpu, pallas_tpu, reference"):
        chunk_gated_delta_rule(q, k, v, g, beta, implementation="triton")
    with pytest.raises(ValueError, match="g must be"):
        chunk_gated_delta_rule(q, k, v, g[..., None], beta)
    with pytest.raises(ValueError, match="v must be"):
        chunk_gated_delta_rule(q, k, v[:, :5], g, beta)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0[:, :1])
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=48)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, implementation="reference")
    o_auto, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    np.testing.assert_allclose(o_auto, o, atol=1e-5, rtol=1e-5)


def test_pallas_interpret_is_logged_once(caplog):
    from pallas_kernels import dispatch

    if jax.default_backend() in ("gpu", "tpu"):
        pytest.skip("needs a CPU backend (interpret mode)")
    dispatch._warned.discard("chunk_gated_delta_rule")  # earlier tests in this process may have logged it already
    q, k, v, g, beta, _ = make_inputs(1, 16, 1, 8, 4)
    with caplog.at_level("WARNING", logger=dispatch.__name__):
        for _ in range(2):
            chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, implementation="pallas")
    assert sum("interpret mode" in r.getMessage() for r in caplog.records) == 1


def _pallas_call_eqns(fn, *args):
    """Every pallas_call equation in ``fn``'s jaxpr, sub-jaxprs included."""
    from jax.extend import core

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
            for sub in core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def _pallas_calls(fn, *args):
    """{kernel name: (grid, [lhs contracting dim of each 2-D dot in the kernel])} of the pallas_calls in ``fn``."""
    from jax.extend import core

    def dots(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn.params["dimension_numbers"][0][0][0]
            for sub in core.jaxprs_in_params(eqn.params):
                yield from dots(sub)

    return {
        eqn.params["name"]: (tuple(eqn.params["grid_mapping"].grid), list(dots(eqn.params["jaxpr"])))
        for eqn in _pallas_call_eqns(fn, *args)
    }


@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "segment_ids"])
def test_pallas_tpu_walks_several_chunks_per_grid_step(segmented):
    """T = 300 in chunks of 16: N = 19 chunks, 8 per grid step, so 3 steps with the state carried across them and 5
    identity chunks padded at the end; values and gradients as the token-by-token reference's (with segment ids:
    the XLA path's, itself checked against separate runs per document above)."""
    args = make_inputs(1, 300, 2, 16, 24, seed=30, unit_keys=False)
    seg = jnp.asarray(np.repeat([3, 5, 5, 9], [37, 101, 90, 72])[None]) if segmented else None  # starts at 37, 228
    kw = dict(chunk_size=16, l2=True, segment_ids=seg) if segmented else dict(chunk_size=16, l2=True)
    pal = runner("pallas_tpu", **kw)
    ref = packed_runner("xla", segment_ids=seg) if segmented else runner("naive", l2=True)
    expected = values_and_grads(ref, args)
    assert_matches(pal, args, expected, jit=False)
    grids = {name: grid for name, (grid, _) in _pallas_calls(jax.grad(weighted_loss(pal)), *args).items()}
    assert grids == {name: (1, 2, 3) for name in grids} and len(grids) == 5, grids


def test_pallas_tpu_products_read_no_transposed_left_operand():
    """The TPU kernels' layouts (k, q, W transposed for the sequential kernels; the transposed scores for dν_local)
    leave one product per chunk whose left operand is read transposed: (dP ⊙ D)ᵀ q in the chunk-parallel grads
    kernel. The GPU kernels, which keep the plain layouts, read one in each of the state, dstate, dv_local and
    grads kernels (kᵀ ν; (q ⊙ e^G)ᵀ dO and Wᵀ dν; scoresᵀ dO; (dP ⊙ D)ᵀ q)."""
    args = make_inputs(1, 100, 1, 16, 16, seed=31)  # 4 chunks of 32: one TPU program walks all 4
    tpu = _pallas_calls(jax.grad(weighted_loss(runner("pallas_tpu", chunk_size=32))), *args)
    assert {name: dots.count(0) for name, (_, dots) in tpu.items() if 0 in dots} == {"gated_delta_grads": 4}
    gpu = _pallas_calls(jax.grad(weighted_loss(runner("pallas_gpu", chunk_size=32, block_v=16))), *args)
    assert {name for name, (_, dots) in gpu.items() if 0 in dots} == {
        "gated_delta_state",
        "gated_delta_dstate",
        "gated_delta_dv_local",
        "gated_delta_grads",
    }


def test_pallas_tpu_chunks_per_step_must_fill_tiles():
    args = make_inputs(1, 64, 1, 16, 16)
    with pytest.raises(ValueError, match="chunks_per_step must be a positive multiple of 8"):
        runner("pallas_tpu", chunks_per_step=4)(*args)


# ---------------------------------------------------------------- lowering


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_lower_for_accelerators(platform, monkeypatch):
    """Cross-lowering from CPU: fwd and bwd kernels translate to Triton IR / Mosaic MLIR (not compiled:
    PTX generation and Mosaic's layout passes run only on the device; see the GPU/TPU tests below)."""
    if platform == "cuda":  # Triton lowering asks the local device for its compute capability
        from jax._src.pallas.triton import gpu_info as gi

        monkeypatch.setattr(gi, "get_gpu_info", lambda: gi.get_gpu_info_from_version(gi.GpuVersion.H200))
    impl = "pallas_gpu" if platform == "cuda" else "pallas_tpu"
    mod = pallas_gpu if platform == "cuda" else pallas_tpu
    fn = getattr(mod, f"chunk_gated_delta_rule_{impl}")
    args = make_inputs(1, 80, 1, 64, 128, dtype=jnp.bfloat16)

    def loss(*a):
        o, s = fn(*a[:5], scale=0.125, initial_state=a[5], output_final_state=True, use_qk_l2norm=True)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=range(6)))  # the value keeps the output kernel alive
    text = fwd_bwd.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    target = "@__gpu$xla.gpu.triton" if platform == "cuda" else "@tpu_custom_call"
    assert target in text
    for kernel in ("state", "output", "dv_local", "dstate", "grads"):
        assert f"gated_delta_{kernel}" in text, kernel


# ---------------------------------------------------------------- real lowering (accelerators only)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_pallas_gpu_lowering():
    args = make_inputs(2, 300, 2, 64, 64, seed=11)
    ref, pal = runner("naive", l2=True), runner("pallas_gpu", l2=True)
    for a, b in zip(pal(*args), ref(*args)):
        assert rel_err(a, b) < 1e-4
    for a, b in zip(
        jax.grad(weighted_loss(pal), argnums=range(6))(*args), jax.grad(weighted_loss(ref), argnums=range(6))(*args)
    ):
        assert rel_err(a, b) < 1e-4


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")
def test_pallas_tpu_lowering():
    args = make_inputs(2, 300, 2, 128, 128, seed=12)
    ref, pal = runner("naive", l2=True), runner("pallas_tpu", l2=True)
    for a, b in zip(pal(*args), ref(*args)):
        assert rel_err(a, b) < 1e-4
    for a, b in zip(
        jax.grad(weighted_loss(pal), argnums=range(6))(*args), jax.grad(weighted_loss(ref), argnums=range(6))(*args)
    ):
        assert rel_err(a, b) < 1e-4


# ---------------------------------------------------------------- packed documents (segment ids)

# Two rows of documents, chunk 16. Row 0: a document shorter than a chunk (11), one spanning three chunks (37, ending
# exactly at the chunk boundary 48), a single token (at 48: a start exactly at a chunk boundary), one of 14, then 6
# tokens of padding (segment 0); ids change at every document start but recur (5 … 5), as a packer's may. Row 1: a
# start inside a chunk and a start at a chunk boundary. T = 70 is no chunk multiple.
PACKED_LAYOUT = (((5, 11), (7, 37), (5, 1), (9, 15), (0, 6)), ((3, 21), (4, 11), (8, 38)))
PACKED_T = 70


def packed_segment_ids(layout=PACKED_LAYOUT):
    return jnp.array([[sid for sid, n in row for _ in range(n)] for row in layout], jnp.int32)


def run_documents_separately(layout=PACKED_LAYOUT, l2=False):
    """The independent oracle: every document of every row run alone with the token-scan reference and no segment
    ids (the row's first document from its initial state, the others from zero); outputs put back into rows, the
    final state that of each row's last document.

    The documents run as one batch (one scan to compile): each is its own batch row, padded at its end to the longest
    with identity steps (g = 0: α = 1; β = 0: nothing written; q = k = 0), whose outputs are dropped and which leave
    the state exactly as the document's last token left it."""
    docs, last_of_row = [], []  # (row, start, length, first in its row)
    for b, row in enumerate(layout):
        start = 0
        for i, (_, n) in enumerate(row):
            docs.append((b, start, n, i == 0))
            start += n
        last_of_row.append(len(docs) - 1)
    longest = max(n for _, _, n, _ in docs)

    def fn(q, k, v, g, beta, s0):
        def alone(x):  # [B, T, ...] → [documents, longest, ...]
            pad = [(0, 0)] * (x.ndim - 2)
            return jnp.stack([jnp.pad(x[b, t : t + n], [(0, longest - n)] + pad) for b, t, n, _ in docs])

        s_init = jnp.stack([s0[b] if first else jnp.zeros_like(s0[b]) for b, _, _, first in docs])
        o, s = naive_gated_delta_rule(
            *map(alone, (q, k, v, g, beta)), initial_state=s_init, output_final_state=True, use_qk_l2norm=l2
        )
        rows = [[o[d, :n] for d, (b, _, n, _) in enumerate(docs) if b == row] for row in range(len(layout))]
        return jnp.stack([jnp.concatenate(r, axis=0) for r in rows]), s[jnp.array(last_of_row)]

    return fn


def packed_runner(implementation, *, l2=True, chunk_size=16, segment_ids=None):
    seg = packed_segment_ids() if segment_ids is None else segment_ids
    if implementation == "pallas_gpu":  # V = 24 pads to 32: two value tiles of 16
        return runner("pallas_gpu", chunk_size=chunk_size, l2=l2, block_v=16, segment_ids=seg)
    if implementation == "pallas_tpu":
        return runner("pallas_tpu", chunk_size=chunk_size, l2=l2, segment_ids=seg)

    def fn(q, k, v, g, beta, s0):
        kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm=l2, segment_ids=seg)
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, implementation=implementation, **kw)

    return fn


def test_packed_layout_is_as_documented():
    seg = np.asarray(packed_segment_ids())
    assert seg.shape == (2, PACKED_T)
    starts = [sorted(set(np.flatnonzero(np.diff(row)) + 1)) for row in seg]
    assert starts == [[11, 48, 49, 64], [21, 32]]  # 48 and 32: chunk boundaries of chunk 16


GRAD_NAMES = "q k v g beta initial_state".split()


def values_and_grads(fn, args, jit=True):
    """(outputs, final state) and the `weighted_loss` gradients w.r.t. all six inputs. Jitted unless the function
    runs Pallas in interpret mode (one XLA program compiles faster than op-by-op dispatch; the interpreter does not)."""
    grad = jax.grad(weighted_loss(fn), argnums=range(6))
    fn, grad = (jax.jit(fn), jax.jit(grad)) if jit else (fn, grad)
    return fn(*args), grad(*args)


def _jit_for(impl):
    return not impl.startswith("pallas")


def assert_matches(fn, args, expected, jit):
    (values, grads), (want_values, want_grads) = values_and_grads(fn, args, jit), expected
    for got, want in zip(values, want_values):
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    for name, got, want in zip(GRAD_NAMES, grads, want_grads):
        assert rel_err(got, want) < 2e-5, name


# The oracle's separate runs (a scan per document, forward and backward) are computed once per module.
@pytest.fixture(scope="module")
def packed_f32():
    args = make_inputs(2, PACKED_T, 2, 16, 24, seed=20, unit_keys=False)
    return args, values_and_grads(run_documents_separately(l2=True), args)


@pytest.fixture(scope="module")
def packed_strong_decay():
    """g = −20 per token over whole documents (row 0's three-chunk one, row 1's last), ordinary decay elsewhere; and
    g = −20 everywhere (with the oracle's values only)."""
    q, k, v, g, beta, s0 = make_inputs(2, PACKED_T, 1, 16, 24, seed=21, unit_keys=False)
    strong = np.zeros((2, PACKED_T, 1), bool)
    strong[0, 11:48], strong[1, 32:] = True, True
    oracle = run_documents_separately(l2=True)
    args = (q, k, v, jnp.where(strong, -20.0, g), beta, s0)
    everywhere = (q, k, v, jnp.full(g.shape, -20.0), beta, s0)
    return (args, values_and_grads(oracle, args)), (everywhere, jax.jit(oracle)(*everywhere))


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_gpu", "pallas_tpu"])
def test_packed_documents_match_separate_runs(impl, packed_f32):
    """Outputs, final state and every gradient (q, k, v, g, β, initial state) of a packed batch equal those of running
    each document alone; f32, l2norm on."""
    args, expected = packed_f32
    assert_matches(packed_runner(impl), args, expected, _jit_for(impl))


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu"])
def test_packed_documents_strong_decay(impl, packed_strong_decay):
    """A reset emulated by huge decays would overflow or cancel; the masked form matches the separate runs where whole
    documents decay by e^{−20} per token, gradients included.

    (Where g = −20 everywhere, ∂L/∂g is ~1e-9, below the fp32 resolution of the sums that form it in every chunked
    form, with or without segments: there only values and finiteness are checked.)"""
    (args, expected), (everywhere, expected_values) = packed_strong_decay
    packed = packed_runner(impl)
    assert_matches(packed, args, expected, _jit_for(impl))
    values, grads = values_and_grads(packed, everywhere, _jit_for(impl))
    for got, want in zip(values, expected_values):
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    assert all(np.isfinite(x).all() for x in grads)


@pytest.fixture(scope="module")
def packed_bf16():
    """bf16 inputs, the fp32 oracle's values and gradients, and the bf16 reference scan's (with segment ids)."""
    f32_args = make_inputs(2, PACKED_T, 2, 32, 32, seed=8)  # the seed of test_pallas_bf16_within_reference_error
    bf_args = tuple(x.astype(jnp.bfloat16) for x in f32_args[:5]) + (f32_args[5],)
    oracle = values_and_grads(run_documents_separately(l2=True), f32_args)
    return bf_args, oracle, values_and_grads(packed_runner("reference"), bf_args)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_packed_documents_bf16_within_reference_error(impl, packed_bf16):
    """bf16 inputs: the kernel's error against the fp32 separate-runs oracle within 2x the bf16 reference's own."""
    bf_args, (want_values, want_grads), (ref_values, ref_grads) = packed_bf16
    values, grads = values_and_grads(packed_runner(impl), bf_args, jit=False)
    for got, base, want in zip(values, ref_values, want_values):
        assert rel_err(got, want) <= 2 * rel_err(base, want)
    for name, got, base, want in zip(GRAD_NAMES, grads, ref_grads, want_grads):
        assert got.dtype == base.dtype, name
        assert rel_err(got, want) <= 2 * rel_err(base, want), name


def test_one_segment_per_row_equals_no_segments():
    """Segment ids that never change start no document: the same values as without them."""
    args = make_inputs(2, 40, 1, 16, 8, seed=23)
    same = jnp.broadcast_to(jnp.array([[4], [0]], jnp.int32), (2, 40))
    for impl in ("xla", "pallas"):
        plain = runner(impl, chunk_size=16)(*args)
        segmented = packed_runner(impl, l2=False, segment_ids=same)(*args)
        for a, b in zip(segmented, plain):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6, err_msg=impl)


def _pallas_operand_counts(fn, *args):
    return {eqn.params["name"]: len(eqn.invars) for eqn in _pallas_call_eqns(fn, *args)}


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_segment_ids_add_one_operand_to_every_kernel_and_none_adds_nothing(impl):
    args = make_inputs(2, 40, 1, 16, 16, seed=24)
    seg = jnp.repeat(jnp.array([[1, 2], [3, 3]], jnp.int32), 20, axis=1)
    extra = dict(block_v=16) if impl == "pallas_gpu" else {}
    plain = jax.grad(weighted_loss(runner(impl, chunk_size=16, **extra)), argnums=range(6))
    packed = jax.grad(weighted_loss(runner(impl, chunk_size=16, segment_ids=seg, **extra)), argnums=range(6))
    n_plain, n_packed = _pallas_operand_counts(plain, *args), _pallas_operand_counts(packed, *args)
    # The forward's kernels (the state recurrence, the outputs) and the backward's are all reached, and every one
    # of them takes the ids as one more operand: none is left reading the unsegmented layout.
    assert {"gated_delta_state", "gated_delta_output"} < set(n_plain) and len(n_plain) >= 4, n_plain
    assert n_packed == {name: n + 1 for name, n in n_plain.items()}


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(
    T=st.sampled_from(T_BUCKETS),
    n_ids=st.integers(1, 4),
    chunk=st.sampled_from([16, 32]),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_segments_match_reference(T, n_ids, chunk, with_state, seed):
    """Random ids from a small set (documents of a few tokens, starts anywhere): every backend against the scan."""
    q, k, v, g, beta, s0 = make_inputs(2, T, 1, 16, 8, seed=seed)
    seg = jax.random.randint(jax.random.key(seed + 1), (2, T), 0, n_ids)
    kw = dict(initial_state=s0 if with_state else None, output_final_state=True, segment_ids=seg)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, **kw)
    for impl in ("xla", "pallas_gpu", "pallas_tpu"):
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, implementation=impl, **kw)
        np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5, err_msg=impl)
        np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5, err_msg=impl)


def test_segment_ids_validation():
    q, k, v, g, beta, _ = make_inputs(2, 10, 1, 8, 4)
    with pytest.raises(ValueError, match=r"segment_ids must be \[batch, time\]"):
        chunk_gated_delta_rule(q, k, v, g, beta, segment_ids=jnp.zeros((2, 9), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be integer"):
        chunk_gated_delta_rule(q, k, v, g, beta, segment_ids=jnp.zeros((2, 10), jnp.float32))
