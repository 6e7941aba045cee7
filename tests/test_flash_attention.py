"""Tests of pallas_kernels.flash_attention against exact oracles.

What this proves on a CPU: the blockwise XLA path and the Pallas kernels (run with interpret=True, i.e.
the kernel bodies, grids, index maps, loop bounds and masks exactly as written, executed by XLA) agree
with the materialising fp32 reference and with jax.nn.dot_product_attention, forward and gradients,
for GQA, causal offsets and lengths that are not tile multiples, and with segment ids (packed documents) give each
document the results of running it alone. It does NOT prove that the kernels
lower through Triton / Mosaic: the lowering tests at the end run only on a GPU / TPU.
"""

import functools
import logging

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import dispatch
from pallas_kernels.flash_attention import BlockSizes, attention_reference, flash_attention, pallas_gpu

F32 = jnp.float32
# Small tiles so that every case spans several query and key tiles, including ragged last ones.
SMALL = BlockSizes(block_q=32, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=16, block_k_dkv=32)
SMALL_TPU = BlockSizes(block_q=32, block_k=24, block_q_dq=16, block_k_dq=40, block_q_dkv=16, block_k_dkv=32)


def _inputs(seed, b, t, s, hq, hkv, d, dtype=F32):
    rng = np.random.default_rng(seed)
    shapes = [(b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, t, hq, d)]
    return [jnp.asarray(rng.standard_normal(sh), dtype) for sh in shapes]  # q, k, v, dout


def _fwd_and_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))


def _dpa_oracle(q, k, v, causal, q_offset):
    """jax.nn.dot_product_attention with an explicit mask (its is_causal aligns queries top-left)."""
    t, s = q.shape[1], k.shape[1]
    mask = None
    if causal:
        off = s - t if q_offset is None else q_offset
        mask = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + off)[None, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


# (B, T, S, Hq, Hkv, D, causal, q_offset)
CASES = [
    pytest.param(2, 100, 100, 4, 4, 16, True, None, id="mha-causal-ragged"),
    pytest.param(1, 37, 100, 6, 3, 8, True, None, id="gqa-prefill-continuation"),
    pytest.param(1, 37, 100, 6, 3, 8, True, 20, id="gqa-explicit-offset"),
    pytest.param(2, 64, 50, 4, 1, 16, False, None, id="mqa-noncausal-S<T"),
    pytest.param(1, 1, 77, 4, 2, 16, True, None, id="decode-one-token"),
    pytest.param(1, 45, 45, 8, 1, 8, True, None, id="gqa8-causal-ragged"),
    pytest.param(2, 45, 61, 8, 1, 8, False, None, id="gqa8-noncausal-ragged-S>T"),
]


@pytest.mark.parametrize("b,t,s,hq,hkv,d,causal,q_offset", CASES)
def test_xla_matches_reference_and_jax_nn(b, t, s, hq, hkv, d, causal, q_offset):
    q, k, v, do = _inputs(0, b, t, s, hq, hkv, d)
    ref = lambda q, k, v: attention_reference(q, k, v, causal=causal, q_offset=q_offset)
    fa = lambda q, k, v: flash_attention(
        q, k, v, causal=causal, q_offset=q_offset, implementation="xla", block_sizes=SMALL
    )
    got, want = _fwd_and_grads(fa, q, k, v, do), _fwd_and_grads(ref, q, k, v, do)
    np.testing.assert_allclose(want[0], _dpa_oracle(q, k, v, causal, q_offset), atol=1e-5, rtol=1e-5)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("impl,blocks", [("pallas_gpu", SMALL), ("pallas_tpu", SMALL_TPU)])
@pytest.mark.parametrize("b,t,s,hq,hkv,d,causal,q_offset", [CASES[2], CASES[3], CASES[5], CASES[6]])
def test_pallas_interpret_matches_reference(impl, blocks, b, t, s, hq, hkv, d, causal, q_offset):
    q, k, v, do = _inputs(1, b, t, s, hq, hkv, d)
    ref = lambda q, k, v: attention_reference(q, k, v, causal=causal, q_offset=q_offset)
    fa = lambda q, k, v: flash_attention(
        q, k, v, causal=causal, q_offset=q_offset, implementation=impl, block_sizes=blocks
    )
    got, want = _fwd_and_grads(fa, q, k, v, do), _fwd_and_grads(ref, q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("splits", [1, 2, 8])
def test_pallas_gpu_dkv_group_split_matches_reference(splits, monkeypatch):
    """The dk/dv kernel splits a KV head's 8 query heads over `splits` programs (f32 partial sums added by XLA)
    when the grid would otherwise leave SMs idle; every split, including none, gives the reference gradients."""
    b, t, hq, hkv = 1, 45, 8, 1
    programs = b * hkv * -(-t // SMALL.dkv[1])  # the dk/dv grid without a split
    monkeypatch.setattr(pallas_gpu, "_TARGET_PROGRAMS", splits * programs)
    assert pallas_gpu._group_splits(hq // hkv, programs) == splits
    q, k, v, do = _inputs(6, b, t, t, hq, hkv, 16)
    fa = lambda q, k, v: flash_attention(q, k, v, implementation="pallas_gpu", block_sizes=SMALL)
    got, want = _fwd_and_grads(fa, q, k, v, do), _fwd_and_grads(attention_reference, q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=name)


def _pallas_call_rows(fn, *args):
    """{kernel name: rows of its query operand (the T axis, padded by the kernel)} over fn's pallas_calls."""
    rows = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                name = eqn.params["name"] if "name" in eqn.params else eqn.params["name_and_src_info"].name
                rows[name] = eqn.invars[0].aval.shape[2]  # [B, Hq, T, D] on TPU
            for param in eqn.params.values():
                for p in param if isinstance(param, (tuple, list)) else (param,):
                    sub = getattr(p, "jaxpr", p)
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return rows


@pytest.mark.parametrize("t,want", [(264, (264, 512, 512)), (300, (304, 512, 512)), (1000, (1024, 1024, 1024))])
def test_pallas_tpu_pads_each_pass_to_its_own_tile(t, want):
    """Default TPU tiles: forward 512 (capped at T rounded up to 8), backward query tiles 256. Each kernel pads
    the queries to its own tile only, never to the lcm of all three (T=264 used to become 8,448 rows)."""
    q = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, implementation="pallas_tpu").astype(F32))
    rows = _pallas_call_rows(jax.grad(loss, argnums=(0, 1, 2)), q, q, q)
    assert (rows["flash_attention_fwd"], rows["flash_attention_dq"], rows["flash_attention_dkv"]) == want


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu"])
def test_bf16_error_within_twice_the_reference_error(impl):
    """bf16 kernels (bf16 P and dS in the matmuls, as in FlashAttention) vs an fp32 oracle on the same
    bf16-rounded inputs: Frobenius error at most 2x that of the reference run in bf16 (which rounds
    only its inputs and outputs). The Frobenius norm is used because a max-abs error is set by a
    single rounding of the reference's output and fluctuates between seeds."""
    q, k, v, do = _inputs(2, 1, 100, 100, 4, 2, 32, jnp.bfloat16)
    blocks = SMALL_TPU if impl == "pallas_tpu" else SMALL
    oracle = _fwd_and_grads(lambda *a: attention_reference(*a), *(x.astype(F32) for x in (q, k, v, do)))
    ref = _fwd_and_grads(lambda *a: attention_reference(*a), q, k, v, do)
    got = _fwd_and_grads(lambda *a: flash_attention(*a, implementation=impl, block_sizes=blocks), q, k, v, do)
    for name, g, r, o in zip(("out", "dq", "dk", "dv"), got, ref, oracle):
        assert g.dtype == jnp.bfloat16, name
        err_ref = float(jnp.linalg.norm(r.astype(F32) - o))
        err = float(jnp.linalg.norm(g.astype(F32) - o))
        assert 0 < err <= 2 * err_ref, (name, err, err_ref)


@hypothesis.settings(max_examples=4, deadline=None, derandomize=True)
@hypothesis.given(
    b=st.integers(1, 2),
    t=st.integers(1, 70),
    extra=st.integers(0, 40),
    hkv=st.integers(1, 2),
    g=st.integers(1, 3),
    d=st.sampled_from([4, 8, 16]),
    causal=st.booleans(),
    bq=st.sampled_from([8, 16, 64]),
    bk=st.sampled_from([8, 24, 64]),
)
def test_xla_random_shapes(b, t, extra, hkv, g, d, causal, bq, bk):
    q, k, v, do = _inputs(t * 7 + extra, b, t, t + extra, hkv * g, hkv, d)
    blocks = BlockSizes(block_q=bq, block_k=bk)
    ref = lambda q, k, v: attention_reference(q, k, v, causal=causal)
    fa = lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation="xla", block_sizes=blocks)
    for name, gt, w in zip(
        ("out", "dq", "dk", "dv"), _fwd_and_grads(fa, q, k, v, do), _fwd_and_grads(ref, q, k, v, do)
    ):
        np.testing.assert_allclose(gt, w, atol=2e-5, rtol=2e-5, err_msg=name)


def test_xla_never_materialises_scores():
    """At T = S = 8K, 8 heads of 64, fwd+bwd: XLA's compiled temp memory for the blockwise path is far
    below one fp32 score matrix (T·T·4·H = 2 GiB); the reference, compiled the same way, is above it
    (which shows that the measurement sees a materialised score matrix when there is one)."""
    t, h, d = 8192, 8, 64
    spec = jax.ShapeDtypeStruct((1, t, h, d), F32)
    score_bytes = t * t * 4 * h

    def temp_bytes(impl):
        loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, implementation=impl) ** 2)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    blockwise = temp_bytes("xla")
    assert blockwise < score_bytes / 16, (blockwise, score_bytes)
    assert temp_bytes("reference") > score_bytes


def _pallas_calls_outside_and_inside(jaxpr, inside=False, acc=None):
    """Counts pallas_call equations outside / inside a shard_map, recursing into sub-jaxprs."""
    acc = {"outside": 0, "inside": 0} if acc is None else acc
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            acc["inside" if inside else "outside"] += 1
            continue
        sub_inside = inside or eqn.primitive.name == "shard_map"
        for param in eqn.params.values():
            for p in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(p, "jaxpr", p)
                if hasattr(sub, "eqns"):
                    _pallas_calls_outside_and_inside(sub, sub_inside, acc)
    return acc


def test_pallas_inside_shard_map_matches_unsharded():
    """8 devices as (data=2, heads=4): each shard holds 1 batch row, 2 query heads and their 1 KV head
    (contiguous GQA groups), so attention is shard-local and the kernel must sit inside shard_map."""
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("data", "heads"), axis_types=(AxisType.Explicit,) * 2)
    spec = P("data", None, "heads", None)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in _inputs(3, 2, 40, 40, 8, 4, 16)[:3])
    attn = lambda q, k, v: flash_attention(
        q, k, v, implementation="pallas_gpu", block_sizes=BlockSizes(block_q=64, block_k=64)
    )
    sharded = jax.jit(jax.shard_map(attn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False))
    counts = _pallas_calls_outside_and_inside(jax.make_jaxpr(sharded)(q, k, v).jaxpr)
    assert counts == {"outside": 0, "inside": 1}, counts
    np.testing.assert_allclose(sharded(q, k, v), attention_reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_auto_on_cpu_is_the_xla_path_and_interpret_logs_once(caplog, monkeypatch):
    q, k, v, _ = _inputs(4, 1, 20, 20, 2, 2, 8)
    np.testing.assert_array_equal(flash_attention(q, k, v), flash_attention(q, k, v, implementation="xla"))
    monkeypatch.setattr(dispatch, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        for _ in range(2):
            out = flash_attention(q, k, v, implementation="pallas")
    assert sum("interpret mode" in r.getMessage() for r in caplog.records) == 1
    np.testing.assert_allclose(out, attention_reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_a_jax_without_the_pallas_triton_lowering_fails_in_one_line(monkeypatch):
    """A jax whose ``jax.experimental.pallas.triton`` is gone (deprecated in jax 0.12) gets one line naming the
    versions the kernels were tried with and the fallbacks, not an error deep inside a kernel module's import."""
    import sys

    import jax.experimental.pallas

    # As if the submodule did not exist: not an attribute of the package, and None in sys.modules fails its import.
    monkeypatch.delattr(jax.experimental.pallas, "triton", raising=False)
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
    with pytest.raises(ImportError, match=r"no Pallas-Triton lowering.*jax>=0\.11\.2,<0\.12\.1.*'cudnn' / 'xla'"):
        dispatch.pallas_triton()


@pytest.mark.parametrize(
    "kwargs,shapes,match",
    [
        (dict(implementation="triton"), None, "valid: auto, xla, pallas"),
        ({}, ((1, 8, 6, 16), (1, 8, 4, 16)), "multiple of key/value heads"),
        ({}, ((1, 8, 4, 16), (1, 8, 2, 32)), "head_dim mismatch"),
        (dict(q_offset=-1), None, "q_offset"),
        ({}, ((1, 8, 4), (1, 8, 2, 16)), "4-D"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, shapes, match):
    qs, ks = shapes or ((1, 8, 4, 16), (1, 8, 2, 16))
    q, k = jnp.zeros(qs), jnp.zeros(ks)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k, **kwargs)
    with pytest.raises(ValueError, match="share a dtype"):
        flash_attention(
            jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 2, 16), jnp.bfloat16), jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
        )


def _lowering_check(platform_impl):
    q, k, v, do = _inputs(5, 2, 300, 300, 8, 2, 64)
    q, k, v, do = (x.astype(jnp.bfloat16) for x in (q, k, v, do))
    got = _fwd_and_grads(lambda *a: flash_attention(*a, implementation=platform_impl), q, k, v, do)
    oracle = _fwd_and_grads(lambda *a: attention_reference(*a), *(x.astype(F32) for x in (q, k, v, do)))
    ref = _fwd_and_grads(lambda *a: attention_reference(*a), q, k, v, do)
    for name, g, r, o in zip(("out", "dq", "dk", "dv"), got, ref, oracle):
        err_ref = float(jnp.linalg.norm(r.astype(F32) - o))
        assert float(jnp.linalg.norm(g.astype(F32) - o)) <= 2 * err_ref, name


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_triton_lowering_on_gpu():
    _lowering_check("pallas_gpu")


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")
def test_mosaic_lowering_on_tpu():
    _lowering_check("pallas_tpu")


# ---------------------------------------------------------------- packed documents (segment ids)

# Documents per batch row of T = 80, ids 1, 2, ... in order and 0 for the padding tail. Row 0 holds one document
# shorter than every tile (11), one spanning several (37), a single token and a padding tail of 12; row 1 packs
# different lengths, so the two rows need different tiles.
PACKED_T = 80
PACKED_DOCS = [[11, 37, 1, 19], [30, 1, 49]]
PACKED_BLOCKS = {"reference": None, "xla": SMALL, "pallas_gpu": SMALL, "pallas_tpu": SMALL_TPU}
PACKED_IMPLS = list(PACKED_BLOCKS)


def _packed_ids(docs, t):
    rows = []
    for lengths in docs:
        ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
        rows.append(np.pad(ids, (0, t - len(ids))))
    return jnp.asarray(np.stack(rows), jnp.int32)


_ORACLES = {}


@functools.partial(jax.jit, static_argnames=("causal", "q_offset"))
def _reference_fwd_and_grads(q, k, v, do, *, causal, q_offset):
    # Jitted: one compilation per document shape instead of one per primitive and shape in eager mode.
    return _fwd_and_grads(functools.partial(attention_reference, causal=causal, q_offset=q_offset), q, k, v, do)


def _per_document_oracle_cached(case: str, *args, **kwargs):
    """_per_document_oracle, computed once per case for all the backends compared against it."""
    if case not in _ORACLES:
        _ORACLES[case] = _per_document_oracle(*args, **kwargs)
    return _ORACLES[case]


def _per_document_oracle(q, k, v, do, q_ids, kv_ids, *, causal, q_offset=0):
    """(out, dq, dk, dv) from running every document of every row on its own through the reference WITHOUT segment
    ids. Each document's queries and keys are contiguous runs; query i of a document sits at key position
    i + q_offset of the row, so its offset inside the document is (first query + q_offset) - (first key). A document
    with queries but no keys outputs 0 and gets zero gradients."""
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    outs = [np.zeros(x.shape, np.float32) for x in (q, q, k, v)]
    for b in range(q.shape[0]):
        for seg in np.unique(q_ids[b]):
            qi, ki = np.flatnonzero(q_ids[b] == seg), np.flatnonzero(kv_ids[b] == seg)
            assert np.all(np.diff(qi) == 1) and np.all(np.diff(ki) == 1), "the oracle needs contiguous documents"
            if len(ki) == 0:
                continue
            qs, ks = slice(qi[0], qi[-1] + 1), slice(ki[0], ki[-1] + 1)
            doc_offset = int(qi[0] + q_offset - ki[0]) if causal else None
            res = _reference_fwd_and_grads(
                q[b : b + 1, qs],
                k[b : b + 1, ks],
                v[b : b + 1, ks],
                do[b : b + 1, qs],
                causal=causal,
                q_offset=doc_offset,
            )
            for acc, r, sl in zip(outs, res, (qs, qs, ks, ks)):
                acc[b, sl] = np.asarray(r[0])
    return outs


def _segmented(impl, *, causal, q_offset=None, ids, kv_ids=None):
    blocks = PACKED_BLOCKS[impl]
    return lambda q, k, v: flash_attention(
        q,
        k,
        v,
        causal=causal,
        q_offset=q_offset,
        segment_ids=ids,
        kv_segment_ids=kv_ids,
        implementation=impl,
        block_sizes=blocks,
    )


def _assert_close_all(got, want, tol=2e-5):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(np.asarray(g))), name
        np.testing.assert_allclose(g, w, atol=tol, rtol=tol, err_msg=name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("impl", PACKED_IMPLS)
def test_packed_documents_match_separate_runs(impl, causal):
    """Every backend, GQA (4 query heads on 2 KV heads), f32: each packed document's outputs and dq/dk/dv equal those
    of running it alone; the padding tail (segment 0) attends only to itself."""
    q, k, v, do = _inputs(11, 2, PACKED_T, PACKED_T, 4, 2, 8)
    ids = _packed_ids(PACKED_DOCS, PACKED_T)
    got = _fwd_and_grads(_segmented(impl, causal=causal, ids=ids), q, k, v, do)
    _assert_close_all(got, _per_document_oracle_cached(f"packed-{causal}", q, k, v, do, ids, ids, causal=causal))


@pytest.mark.parametrize("impl", PACKED_IMPLS)
def test_chunk_continuing_a_cached_packed_prefix(impl):
    """Queries 56..79 of a packed row (T=24, q_offset=56) against all 80 cached keys with kv_segment_ids: the chunk
    starts inside a document, so per document it is a causal continuation with its own offset."""
    t0, s = 56, PACKED_T
    q, k, v, do = _inputs(12, 2, s - t0, s, 4, 2, 8)
    kv_ids = _packed_ids(PACKED_DOCS, s)
    ids = kv_ids[:, t0:]
    got = _fwd_and_grads(_segmented(impl, causal=True, q_offset=t0, ids=ids, kv_ids=kv_ids), q, k, v, do)
    _assert_close_all(
        got, _per_document_oracle_cached("cached-prefix", q, k, v, do, ids, kv_ids, causal=True, q_offset=t0)
    )


@pytest.mark.parametrize("impl", PACKED_IMPLS)
def test_query_segment_without_keys_outputs_zero(impl):
    """Non-causal, S != T: queries of segment 7, which no key carries, output exactly 0 and get zero gradients (no
    NaN); the other queries see their own documents' keys only."""
    q, k, v, do = _inputs(13, 1, 40, 56, 4, 2, 8)
    ids = _packed_ids([[10, 14, 16]], 40).at[:, 10:24].set(7)
    kv_ids = _packed_ids([[20, 30]], 56).at[:, 50:].set(3)  # segments 1, 2, 0 (padding) and 3
    got = _fwd_and_grads(_segmented(impl, causal=False, ids=ids, kv_ids=kv_ids), q, k, v, do)
    want = _per_document_oracle_cached("segment-without-keys", q, k, v, do, ids, kv_ids, causal=False)
    _assert_close_all(got, want)
    assert not np.any(np.asarray(got[0])[:, 10:24]) and not np.any(np.asarray(got[1])[:, 10:24])


def _interleaved_ids(seed, b, n, n_segments):
    return jnp.asarray(np.random.default_rng(seed).integers(0, n_segments, (b, n)), jnp.int32)


def test_reference_segment_mask_matches_jax_nn():
    """The masked reference against jax.nn.dot_product_attention given the same [B, 1, T, S] boolean mask, for
    interleaved (unsorted) ids with a causal offset: an independent implementation of the same definition. Queries
    of a segment no key carries output 0."""
    q, k, v, _ = _inputs(14, 2, 30, 45, 4, 2, 8)
    ids, kv_ids = _interleaved_ids(1, 2, 30, 4), _interleaved_ids(2, 2, 45, 3)  # no key of segment 3
    got = attention_reference(q, k, v, causal=True, q_offset=15, segment_ids=ids, kv_segment_ids=kv_ids)
    mask = (ids[:, :, None] == kv_ids[:, None, :]) & (jnp.arange(45)[None, :] <= jnp.arange(30)[:, None] + 15)
    want = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
    seen = np.asarray(mask.any(-1))  # rows without a visible key: jax.nn averages v there, ours outputs 0
    assert seen.sum() > 30 and not seen.all()
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(want)[seen], atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(got)[~seen])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu"])
def test_unsorted_segment_ids_match_masked_reference(impl, causal):
    """Interleaved ids (every tile holds several segments, and a segment recurs in distant tiles): tile skipping by
    [min, max] ranges must not drop a visible pair; results equal the masked reference, gradients included."""
    q, k, v, do = _inputs(15, 2, 70, 70, 4, 2, 8)
    ids = _interleaved_ids(3, 2, 70, 4)
    ids = ids.at[1, :20].set(5).at[1, 50:].set(5)  # row 1: one segment at both ends, unlike ids in the middle
    ref = lambda q, k, v: attention_reference(q, k, v, causal=causal, segment_ids=ids)
    got = _fwd_and_grads(_segmented(impl, causal=causal, ids=ids), q, k, v, do)
    _assert_close_all(got, _fwd_and_grads(ref, q, k, v, do))


ALIGNED_BLOCKS = {
    "xla": SMALL,
    "pallas_gpu": SMALL,
    "pallas_tpu": BlockSizes(block_q=32, block_k=32, block_q_dq=16, block_k_dq=32, block_q_dkv=16, block_k_dkv=32),
}


@pytest.mark.parametrize("impl", list(ALIGNED_BLOCKS))
def test_tiles_of_other_documents_are_skipped(impl):
    """Three documents of 32 tokens, every tile inside one document; document 2's keys and values are NaN. A tile
    that is computed under the mask still multiplies its values (0 · NaN = NaN), so documents 1 and 3 come out
    finite, and equal to running them alone, only if no tile pair across documents is computed: forward, dq and
    dk/dv skip them. Non-causal, so without skipping every query tile would visit document 2's keys."""
    q, k, v, do = _inputs(17, 1, 96, 96, 4, 2, 8)
    ids = _packed_ids([[32, 32, 32]], 96)
    want = _per_document_oracle(q, k, v, do, ids, ids, causal=False)
    k, v = k.at[:, 32:64].set(jnp.nan), v.at[:, 32:64].set(jnp.nan)
    blocks = ALIGNED_BLOCKS[impl]
    attn = lambda q, k, v: flash_attention(
        q, k, v, causal=False, segment_ids=ids, implementation=impl, block_sizes=blocks
    )
    got = _fwd_and_grads(attn, q, k, v, do)
    others = np.r_[0:32, 64:96]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g)[:, others], w[:, others], atol=2e-5, rtol=2e-5, err_msg=name)


def test_segment_tile_spans_by_hand():
    """Spans of tiles whose [min, max] segment ranges meet, worked out by hand. Row 0 sorted ids 1 1 1 2 | 2 2 3 3 | 3 4
    (tiles of 4, the last edge-padded with 4s) against key tiles of 2; row 1 unsorted."""
    from pallas_kernels.flash_attention._common import segment_tile_spans

    q_ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 3, 3, 3, 4], [5, 1, 1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    (k_lo, k_hi), (q_lo, q_hi) = segment_tile_spans(q_ids, q_ids, bq=4, bk=2, tp=12, sp=10)
    # Row 0 key tiles (1 1)(1 2)(2 2)(3 3)(3 4): query tile [1,2] meets key tiles 0-2, [2,3] meets 1-4, [3,4] meets 3-4.
    # Row 1 key tiles (5 1)(1 1)(1 1)(1 1)(1 1): query tile [1,5] meets all; [1,1] and [1,1] meet all five too.
    np.testing.assert_array_equal(k_lo, [[0, 1, 3], [0, 0, 0]])
    np.testing.assert_array_equal(k_hi, [[3, 5, 5], [5, 5, 5]])
    np.testing.assert_array_equal(q_lo, [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(q_hi, [[1, 2, 2, 3, 3], [3, 3, 3, 3, 3]])
    # Disjoint documents of queries and keys: every span empty, returned as [0, 0).
    (k_lo, k_hi), (q_lo, q_hi) = segment_tile_spans(q_ids[:1], q_ids[:1] + 10, bq=4, bk=2, tp=12, sp=10)
    assert not np.any(k_lo) and not np.any(k_hi) and not np.any(q_lo) and not np.any(q_hi)


@pytest.mark.parametrize("impl", ["xla"])
def test_one_segment_equals_no_segments(impl):
    """A row that is one document (all ids equal) gives the unsegmented results: the segment path changes the mask
    only, not the arithmetic. (The Pallas kernels' segment paths are held to the per-document oracle above.)"""
    q, k, v, do = _inputs(16, 1, 50, 50, 4, 2, 8)
    ids = jnp.full((1, 50), 3, jnp.int32)
    blocks = PACKED_BLOCKS[impl]
    plain = lambda q, k, v: flash_attention(q, k, v, implementation=impl, block_sizes=blocks)
    _assert_close_all(
        _fwd_and_grads(_segmented(impl, causal=True, ids=ids), q, k, v, do), _fwd_and_grads(plain, q, k, v, do), 1e-6
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kv_segment_ids=jnp.zeros((1, 8), jnp.int32)), "kv_segment_ids given without segment_ids"),
        (dict(segment_ids=jnp.zeros((1, 8), jnp.int32)), r"pass kv_segment_ids \[batch, 12\]"),
        (
            dict(segment_ids=jnp.zeros((1, 8), jnp.int32), kv_segment_ids=jnp.zeros((1, 8), jnp.int32)),
            r"kv_segment_ids must have shape \[batch, S \(keys\)\] = \(1, 12\)",
        ),
        (
            dict(segment_ids=jnp.zeros((8,), jnp.int32), kv_segment_ids=jnp.zeros((1, 12), jnp.int32)),
            r"segment_ids must have shape \[batch, T \(queries\)\] = \(1, 8\)",
        ),
        (
            dict(segment_ids=jnp.zeros((1, 8)), kv_segment_ids=jnp.zeros((1, 12), jnp.int32)),
            "segment_ids must be an integer array",
        ),
    ],
)
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_bad_segment_ids_raise_clear_errors(impl, kwargs, match):
    q, k = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 12, 2, 16))
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k, implementation=impl, **kwargs)
