"""Softmax attention with the sequence split over devices (``sequence_parallel_attention``) equals the unsharded
causal ``flash_attention`` — values and dq/dk/dv — for both token layouts, both modes (all-gather, ring), on the
meshes (sequence=8) and (data=2, sequence=4) of the 8 simulated CPU devices; and the teacher's ``Attention`` layer
under a sequence mesh equals the unsharded layer (outputs, parameter gradients, the KV cache a prefill fills).

The oracle is ``flash_attention(implementation="reference")`` (the whole [T, S] score matrix in fp32) on the natural-
order rows; the sharded call gets them permuted with ``to_layout`` and its outputs are permuted back.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hydrahead_jax.config import ConfigError, ModelConfig
from hydrahead_jax.context_parallel import from_layout, sequence_parallel_attention, to_layout
from hydrahead_jax.context_parallel.attention import key_tiles_visited
from hydrahead_jax.hybrid import HybridConfig
from hydrahead_jax.models.attention import Attention, HeadProbe
from hydrahead_jax.models.kernel_sharding import BS, BSHD, kernel_call, sequence_axes
from hydrahead_jax.training.sharding import make_mesh
from pallas_kernels.flash_attention import BlockSizes, flash_attention

B, T, HQ, HKV, D = 2, 128, 4, 2, 16  # GQA: Hq = 2·Hkv
MESHES = {"seq8": dict(data=1, sequence=8), "data2_seq4": dict(data=2, sequence=4)}
LAYOUTS = ("contiguous", "zigzag")
MODES = ("allgather", "ring")


def _mesh(name):
    m = MESHES[name]
    return make_mesh(m["data"], 1, 1, sequence=m["sequence"]), m["sequence"]


def _qkv(seed=0, t=T):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(kq, (B, t, HQ, D)),
        jax.random.normal(kk, (B, t, HKV, D)),
        jax.random.normal(kv, (B, t, HKV, D)),
        jax.random.normal(kc, (B, t, HQ, D)),  # output cotangent
    )


def _packed_ids():
    """Documents (ids 1, 2, …; trailing padding 0) whose boundaries fall exactly on shard borders of both layouts
    and meshes (16, 64: multiples of every chunk length, 8 and 16) and inside shards (37, 100, 5, 90)."""
    rows = ((16, 37, 64, 100, 128), (5, 48, 90, 120, 128))
    ids = np.zeros((B, T), np.int32)
    for r, ends in enumerate(rows):
        start = 0
        for doc, end in enumerate(ends[:-1], start=1):
            ids[r, start:end] = doc
            start = end
    return jnp.asarray(ids)


def _sharded_call(mode, layout, implementation="xla", block_sizes=None):
    """The per-device attention through kernel_call over the ambient mesh's sequence axes (as the model calls it)."""

    def run(q, k, v, ids):
        kernel = functools.partial(
            sequence_parallel_attention,
            axis_name=sequence_axes(),
            layout=layout,
            mode=mode,
            scale=D**-0.5,
            implementation=implementation,
            block_sizes=block_sizes,
        )
        return kernel_call(kernel, q, k, v, ids, in_axes=(BSHD, BSHD, BSHD, None if ids is None else BS), out_axes=BSHD)

    return run


def _value_and_grads(attend, q, k, v, ids, ct):
    """(out, (dq, dk, dv)) of Σ out·ct."""
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, ids), q, k, v)
    return out, vjp(ct.astype(out.dtype))


def _reference(q, k, v, ids, ct):
    attend = lambda q, k, v, ids: flash_attention(  # noqa: E731
        q, k, v, causal=True, scale=D**-0.5, segment_ids=ids, implementation="reference"
    )
    return _value_and_grads(attend, q, k, v, ids, ct)


def _sharded(mesh, n, layout, attend, q, k, v, ids, ct):
    """The sharded call on the permuted rows, results permuted back to natural order."""
    to = lambda x: None if x is None else to_layout(x, n, layout)  # noqa: E731
    with jax.set_mesh(mesh):
        out, grads = jax.jit(functools.partial(_value_and_grads, attend))(to(q), to(k), to(v), to(ids), to(ct))
    return from_layout(out, n, layout), tuple(from_layout(g, n, layout) for g in grads)


def _assert_close(got, want, atol=2e-5):
    (out, grads), (ref_out, ref_grads) = got, want
    np.testing.assert_allclose(out, ref_out, atol=atol, rtol=1e-5)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=atol, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_packed_documents_values_and_gradients_equal_unsharded(mesh_name, layout, mode):
    mesh, n = _mesh(mesh_name)
    q, k, v, ct = _qkv()
    ids = _packed_ids()
    got = _sharded(mesh, n, layout, _sharded_call(mode, layout), q, k, v, ids, ct)
    _assert_close(got, _reference(q, k, v, ids, ct))


@pytest.mark.parametrize("mode", MODES)
def test_one_sequence_per_row_values_and_gradients_equal_unsharded(mode):
    mesh, n = _mesh("seq8")
    q, k, v, ct = _qkv(seed=1)
    got = _sharded(mesh, n, "zigzag", _sharded_call(mode, "zigzag"), q, k, v, None, ct)
    _assert_close(got, _reference(q, k, v, None, ct))


def test_pallas_kernel_runs_unchanged_inside_allgather():
    """The Triton kernel (interpret mode on CPU) as the per-chunk attention; small tiles so the sentinel ids and
    the causal bound really skip tiles."""
    mesh, n = _mesh("data2_seq4")
    t = 64
    q, k, v, ct = _qkv(seed=2, t=t)
    ids = jnp.asarray(np.repeat([[1, 2, 3, 4]], B, axis=0).repeat([10, 14, 24, 16], axis=1), jnp.int32)
    attend = _sharded_call("allgather", "zigzag", implementation="pallas_gpu", block_sizes=BlockSizes(16, 16))
    got = _sharded(mesh, n, "zigzag", attend, q, k, v, ids, ct)
    _assert_close(got, _reference(q, k, v, ids, ct))


def test_zigzag_gives_every_device_the_same_key_tiles():
    """The all-gather mode's kernel calls visit the tiles of each held chunk's causal prefix only: zig-zag gives
    every device (2n+1)·c/b_k key tiles per query tile row; contiguous grows linearly to n× on the last device."""
    n, length, tile = 8, 1024, 16
    c = length // (2 * n)
    zigzag = [key_tiles_visited(i, n, "zigzag", length, block_q=tile, block_k=tile) for i in range(n)]
    # chunk j: c/tile query tiles, each over its (j+1)·c/tile prefix tiles minus the causal upper triangle.
    per_chunk = lambda j: sum((j * c + (r + 1) * tile) // tile for r in range(c // tile))  # noqa: E731
    assert zigzag == [per_chunk(i) + per_chunk(2 * n - 1 - i) for i in range(n)]
    assert len(set(zigzag)) == 1
    contiguous = [key_tiles_visited(i, n, "contiguous", length, block_q=tile, block_k=tile) for i in range(n)]
    assert contiguous == sorted(contiguous) and contiguous[-1] > 10 * contiguous[0]
    assert sum(contiguous) == sum(zigzag)  # the same total work, only distributed differently


@pytest.mark.parametrize("mode", MODES)
def test_compiled_call_is_split_over_the_sequence(mode):
    """The jitted sharded call holds a per-device q of [B, T/n, Hq, D] and communicates with the mode's collective;
    the whole row's q never exists on a device."""
    mesh, n = _mesh("seq8")
    q, k, v, _ = _qkv()
    with jax.set_mesh(mesh):
        shard = jax.NamedSharding(mesh, jax.P(None, "sequence"))
        args = [jax.device_put(x, shard) for x in (q, k, v)]
        hlo = jax.jit(_sharded_call(mode, "zigzag")).lower(*args, None).compile().as_text()
    collective = {"allgather": "all-gather", "ring": "collective-permute"}[mode]
    assert collective in hlo
    assert f"f32[{B},{T // n},{HQ},{D}]" in hlo
    assert f"f32[{B},{T},{HQ},{D}]" not in hlo


def test_bad_input_is_refused_before_any_work():
    q, k, v, _ = _qkv(t=24)
    call = functools.partial(sequence_parallel_attention, axis_name="sequence", scale=0.25)
    with pytest.raises(ValueError, match="mode must be one of"):
        call(q, k, v, layout="zigzag", mode="broadcast")
    with pytest.raises(ValueError, match="sequence layout must be one of"):
        call(q, k, v, layout="striped")
    with pytest.raises(ValueError, match="do not split into the 2 equal chunks"):
        call(q[:, :3], k[:, :3], v[:, :3], layout="zigzag")
    with pytest.raises(ValueError, match="segment_ids must be"):
        call(q, k, v, jnp.zeros((B, 5), jnp.int32), layout="zigzag")
    # Under the mesh: 24 tokens split over 8 devices, but not into the zig-zag's 16 chunks.
    mesh, _ = _mesh("seq8")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="multiple of 2 x the sequence axis size"):
        jax.jit(_sharded_call("allgather", "zigzag")).lower(q, k, v, None)


# --- one layer: the teacher's Attention module -------------------------------------------------------------------

CFG = ModelConfig(
    vocab_size=53,
    hidden_size=32,
    intermediate_size=48,
    num_layers=1,
    num_heads=HQ,
    num_kv_heads=HKV,
    head_dim=D,
    qk_norm=True,
    attention_bias=True,
    rms_norm_eps=1e-5,
)


def _layer(mode="allgather"):
    layer = Attention(CFG, rngs=nnx.Rngs(0), attention_impl="xla", context_parallel=mode)
    for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(layer, nnx.Param))):  # biases, norms off 0 / 1
        var.set_value(var[...] + 0.1 * jax.random.normal(jax.random.key(10 + i), var.shape))
    return layer


def _layer_inputs(t=T):
    kx, kc = jax.random.split(jax.random.key(7))
    x = jax.random.normal(kx, (B, t, CFG.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(t), (B, t))
    return x, positions, jax.random.normal(kc, (B, t, CFG.hidden_size))


@nnx.jit
def _layer_value_and_grads(layer, x, positions, ct):
    def loss(layer):
        out, _ = layer(x, positions)
        return jnp.sum(out * ct), out

    (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
    return out, grads


@pytest.mark.parametrize("mode", MODES)
def test_layer_under_sequence_mesh_equals_unsharded(mode):
    layer = _layer(mode)
    x, positions, ct = _layer_inputs()
    want_out, want_grads = _layer_value_and_grads(layer, x, positions, ct)
    mesh, n = _mesh("seq8")
    to = lambda a: to_layout(a, n, "zigzag")  # noqa: E731  (MODEL_LAYOUT)
    with jax.set_mesh(mesh):
        out, grads = _layer_value_and_grads(layer, to(x), to(positions), to(ct))
    np.testing.assert_allclose(from_layout(out, n, "zigzag"), want_out, atol=2e-5, rtol=1e-5)
    for (path, g), (_, w) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads)):
        np.testing.assert_allclose(g[...], w[...], atol=5e-5, rtol=1e-4, err_msg=str(path))


def test_prefill_under_sequence_mesh_fills_the_unsharded_cache():
    layer = _layer()
    x, positions, _ = _layer_inputs()
    max_len = T + 16

    @nnx.jit
    def prefill(layer, x, positions):
        return layer(x, positions, cache=layer.init_cache(B, max_len, jnp.float32), cache_index=jnp.int32(0))

    want_out, want_cache = prefill(layer, x, positions)
    mesh, n = _mesh("seq8")
    with jax.set_mesh(mesh):
        out, cache = prefill(layer, to_layout(x, n, "zigzag"), to_layout(positions, n, "zigzag"))
    np.testing.assert_allclose(from_layout(out, n, "zigzag"), want_out, atol=2e-5, rtol=1e-5)
    # Natural order, as unsharded (the decode steps read it as is). Not bitwise: the k/v projections run on [T/n]
    # row blocks per device, whose matmuls round differently (~1e-7); a token out of place would differ by O(1).
    for name in ("k", "v"):
        np.testing.assert_allclose(cache[name], want_cache[name], atol=1e-6, rtol=1e-6)
        np.testing.assert_array_equal(cache[name][:, T:], 0.0)


def test_probe_and_bad_mode_are_refused():
    layer = _layer()
    x, positions, _ = _layer_inputs()
    mesh, _ = _mesh("seq8")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="probes run unsharded"):
        nnx.jit(lambda layer, x, p: layer(x, p, probe=HeadProbe()))(layer, x, positions)
    with pytest.raises(ValueError, match="mode must be one of"):
        Attention(CFG, rngs=nnx.Rngs(0), context_parallel="gather")
    with pytest.raises(ConfigError, match="attention_context_parallel"):
        HybridConfig(attention_context_parallel="gather")
