"""flash_attention(implementation="splash"): Google's splash attention TPU kernel behind our API.

What this proves on a CPU: splash's kernels, run in interpret mode through our adapter (layout, GQA head mapping,
causal offset, logit scale, segment ids), give the outputs and dq/dk/dv of the materialising fp32 reference; ``auto``
on a TPU picks splash exactly where it covers the call and our Mosaic kernel elsewhere (traced under a mesh of
libtpu's compile-only TPU chips); ``splash`` asked for a call it cannot compute fails with the reason. The real TPU
compiler compiles both kernels in tests/test_compile_tier.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cross_compile
from pallas_kernels.flash_attention import attention_reference, flash_attention


def _inputs(seed, b, t, s, hq, hkv, d):
    rng = np.random.default_rng(seed)
    shapes = [(b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, t, hq, d)]
    return [jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in shapes]  # q, k, v, dout


def _fwd_and_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))


# (B, T, S, Hq, Hkv, D, causal, q_offset, document lengths or None)
CASES = [
    pytest.param(1, 256, 256, 4, 2, 128, True, None, [100, 120, 36], id="gqa-causal-packed"),
    pytest.param(2, 128, 256, 2, 1, 128, True, None, None, id="mqa-prefill-continuation"),
    pytest.param(1, 128, 384, 2, 2, 128, False, None, None, id="mha-full-S>T"),
]


@pytest.mark.parametrize("b,t,s,hq,hkv,d,causal,q_offset,docs", CASES)
def test_splash_interpret_matches_reference(b, t, s, hq, hkv, d, causal, q_offset, docs):
    q, k, v, do = _inputs(0, b, t, s, hq, hkv, d)
    ids = None
    if docs is not None:
        ids = jnp.asarray(np.repeat(np.arange(1, len(docs) + 1), docs)[None].repeat(b, 0), jnp.int32)
    kwargs = dict(causal=causal, q_offset=q_offset, segment_ids=ids)
    got = _fwd_and_grads(lambda q, k, v: flash_attention(q, k, v, implementation="splash", **kwargs), q, k, v, do)
    want = _fwd_and_grads(lambda q, k, v: attention_reference(q, k, v, **kwargs), q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        # fp32 in interpret mode; splash's online softmax differs from the reference's softmax by rounding only
        # (measured: |got - want| / (1 + |want|) at most 2.4e-6 over these cases and outputs).
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=name)


_OURS = {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"}


def _kernel_names(fn, *args) -> set[str]:
    """Names of the pallas_calls in fn's jaxpr, traced as for a TPU (a mesh of one compile-only v5e chip)."""
    with jax.set_mesh(cross_compile.tpu_mesh("v5e:2x4")):
        jaxpr = jax.make_jaxpr(fn)(*args)

    return {n for n in re.findall(r"name=(\w+)", str(jaxpr)) if n in _OURS or n.startswith("splash_mha_")}


def _grad(**kwargs):
    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, **kwargs))

    return jax.grad(loss, argnums=(0, 1, 2))


@pytest.mark.slow  # traced for libtpu's compile-only chips: the TPU compile tier
@pytest.mark.usefixtures("libtpu")
def test_auto_on_a_tpu_picks_splash_where_it_covers_the_call():
    """Causal GQA with packed documents at T = 256, d = 128: splash (forward and backward); a ragged length, a head
    dim of 64 or key segment ids of their own (context parallelism's rotated keys): our kernel."""
    q, k, v, _ = _inputs(1, 1, 256, 256, 4, 2, 128)
    ids = jnp.ones((1, 256), jnp.int32)
    splash = _kernel_names(_grad(segment_ids=ids), q, k, v)
    assert splash == {
        f"splash_mha_{k}_segmented_{r}"
        for k, r in (("fwd", "residuals"), ("dq", "no_residuals"), ("dkv", "no_residuals"))
    }
    ours = _OURS
    assert _kernel_names(_grad(), q[:, :200], k[:, :200], v[:, :200]) == ours
    assert _kernel_names(_grad(), q[..., :64], k[..., :64], v[..., :64]) == ours
    assert _kernel_names(_grad(segment_ids=ids, kv_segment_ids=ids + 0), q, k, v) == ours
    # The same array passed as both is self-attention: splash.
    assert _kernel_names(_grad(segment_ids=ids, kv_segment_ids=ids), q, k, v) == splash
    # bf16 under conftest's "highest" matmul precision: Mosaic cannot compile splash's dots, so our kernel; at the
    # default precision, splash.
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    assert _kernel_names(_grad(segment_ids=ids), *half) == ours
    with jax.default_matmul_precision("default"):
        assert _kernel_names(_grad(segment_ids=ids), *half) == splash


@pytest.mark.parametrize(
    "t,d,kv_ids,match",
    [(200, 128, False, "multiples of 128"), (256, 64, False, "head dim 64"), (256, 128, True, "no visible key")],
)
def test_splash_refuses_what_it_does_not_cover(t, d, kv_ids, match):
    q = jnp.zeros((1, t, 2, d))
    ids = jnp.ones((1, t), jnp.int32)
    kwargs = dict(segment_ids=ids, kv_segment_ids=ids + 0) if kv_ids else {}
    with pytest.raises(ValueError, match=match):
        flash_attention(q, q, q, implementation="splash", **kwargs)


def test_gated_delta_has_no_splash():
    from pallas_kernels.gated_delta import chunk_gated_delta_rule

    x = jnp.zeros((1, 64, 1, 16))
    with pytest.raises(ValueError, match="unknown implementation 'splash'"):
        chunk_gated_delta_rule(x, x, x, x[..., 0], x[..., 0], implementation="splash")
