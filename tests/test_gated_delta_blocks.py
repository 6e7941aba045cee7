"""The XLA gated delta rule walks the sequence in blocks (`chunk_math.make_rule(..., block_chunks=...)`): the forward
carries S from block to block and saves one state per block, the backward carries dS back and recomputes each block's
chunk states. These tests cover sequences of several blocks plus a shorter last one, where the loop over full blocks,
the separate last block and the hand-over of S and dS between them all run (the other tests' short sequences fit in
one block)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import chunk_gated_delta_rule, chunk_math, naive_gated_delta_rule, xla

CHUNK = 16
BLOCK_CHUNKS = xla.BLOCK_TOKENS // CHUNK
T = 2 * xla.BLOCK_TOKENS + 88  # two full blocks, then a last block of 5.5 chunks (not a chunk multiple)


def inputs(B, H, K, V, seed):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)) - 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = jax.random.normal(ks[5], (B, H, K, V))
    return q, k, v, g, beta, s0


def weighted_loss(fn):
    """Touches every output element and the final state with distinct weights (no gradient can cancel)."""

    def loss(*args):
        o, s = fn(*args)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        return jnp.sum(o * w) + 0.3 * jnp.sum(jnp.sin(s))

    return loss


def xla_rule(q, k, v, g, beta, s0, segment_ids=None):
    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=s0,
        output_final_state=True,
        use_qk_l2norm=True,
        chunk_size=CHUNK,
        implementation="xla",
        segment_ids=segment_ids,
    )


def naive_rule(q, k, v, g, beta, s0):
    return naive_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def test_several_blocks_match_the_token_scan():
    """Values, final state and every gradient (initial state included) against the token-by-token reference."""
    assert T // xla.BLOCK_TOKENS == 2 and T % xla.BLOCK_TOKENS % CHUNK  # the layout this test is about
    args = inputs(1, 2, 16, 8, seed=0)
    o, s = jax.jit(xla_rule)(*args)
    o_ref, s_ref = naive_rule(*args)
    assert rel_err(o, o_ref) < 2e-5 and rel_err(s, s_ref) < 2e-5
    grads = jax.jit(jax.grad(weighted_loss(xla_rule), argnums=range(6)))(*args)
    grads_ref = jax.grad(weighted_loss(naive_rule), argnums=range(6))(*args)
    for name, a, b in zip("q k v g beta initial_state".split(), grads, grads_ref):
        assert rel_err(a, b) < 2e-5, name


def unblocked_rule(q, k, v, g, beta, s0, segment_ids):
    """The same XLA chunk functions through the whole-sequence `make_rule` (block_chunks=None)."""
    whole = chunk_math.make_rule(
        functools.partial(xla.fwd_call, chunk_size=CHUNK), functools.partial(xla.bwd_call, chunk_size=CHUNK)
    )
    return chunk_math.chunked_gated_delta_rule(
        whole,
        q,
        k,
        v,
        g,
        beta,
        scale=q.shape[-1] ** -0.5,
        initial_state=s0,
        output_final_state=True,
        use_qk_l2norm=True,
        chunk_size=CHUNK,
        pad_pow2=False,
        segment_ids=segment_ids,
        operand_dtype=jnp.float32,
    )


# Segment ids are an argument, so both layouts below share one compilation of each.
values_and_grads = {
    name: jax.jit(lambda *args, fn=fn: (fn(*args), jax.grad(weighted_loss(fn), argnums=range(6))(*args)))
    for name, fn in (("blocked", xla_rule), ("unblocked", unblocked_rule))
}


@pytest.mark.parametrize("starts", [(5, 300, 301), (256, 512, 520)], ids=["inside-blocks", "at-block-starts"])
def test_documents_across_blocks_match_the_unblocked_rule(starts):
    """Packed documents whose starts fall inside blocks, and exactly on block starts (so the first chunk of a block
    begins a document): values and gradients equal the whole-sequence rule's (block_chunks=None), which
    tests/test_gated_delta.py checks against documents run separately."""
    args = inputs(2, 1, 16, 8, seed=1)
    ids = np.zeros((2, T), np.int32)
    for i, t in enumerate(starts):
        ids[0, t:] = i + 1
    ids[1, 100:] = 7  # one start in the second row
    segment_ids = jnp.asarray(ids)
    (out, grads), (out_ref, grads_ref) = (values_and_grads[n](*args, segment_ids) for n in ("blocked", "unblocked"))
    for a, b in zip(out, out_ref):
        assert rel_err(a, b) < 1e-5
    for name, a, b in zip("q k v g beta initial_state".split(), grads, grads_ref):
        assert rel_err(a, b) < 1e-5, name
