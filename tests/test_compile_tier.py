"""Compile tier: the Pallas kernels compile for the accelerators users run them on, proven from a CPU.

GPU: every flash-attention kernel (forward, dq, dk/dv) is lowered as on an NVIDIA H200, compiled by the `triton`
package for sm_90a, and must fit the H200's shared memory per block; registers and spills are reported (run with
``-s`` to see the table; bench/RESULTS.md keeps a copy). TPU: the Mosaic kernels are compiled by the real TPU
compiler (libtpu's compile-only devices) for a v5e and a v6e chip and, inside ``shard_map``, for an 8-chip slice;
per-chip memory and each kernel's VMEM are reported. The glue (pallas_kernels/cross_compile.py) is itself tested on
tiny kernels whose properties are known.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from pallas_kernels import cross_compile as cc
from pallas_kernels.flash_attention import BlockSizes, flash_attention
from pallas_kernels.flash_attention.pallas_gpu import flash_attention_gpu

# The compile tier is in the end-to-end tier (`make test-all`); libtpu from its own folder (conftest's `libtpu`).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("libtpu")]

# The TPU tier's targets: an 8-chip slice of each generation (kernels compile for one of its chips, sharded
# programs for all eight). v5p's chips are megacore (two TensorCores as one device): the model tier covers it.
TPU_CHIPS = {"v5e": "v5e:2x4", "v6e": "v6e:2x4"}

# ---------------------------------------------------------------- the glue, on kernels with known properties


def _scale_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + 1.0


def _elementwise(x, params=None):
    return pl.pallas_call(
        _scale_kernel,
        grid=(4, 2),
        in_specs=[pl.BlockSpec((16, 64), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((16, 64), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=params,
        name="tiny_scale",
    )(x)


def _matmul_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


def test_triton_stats_of_an_elementwise_kernel():
    """Name, grid and launch configuration come from the pallas_call (Pallas' defaults, 4 warps and 3 stages, when
    unset); an elementwise kernel stages nothing in shared memory and does not spill."""
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    [default] = cc.compile_triton_kernels(_elementwise, x)
    [tuned] = cc.compile_triton_kernels(_elementwise, x, params=plgpu.CompilerParams(num_warps=2, num_stages=1))
    assert (default.name, default.grid, default.num_warps, default.num_stages) == ("tiny_scale", (4, 2, 1), 4, 3)
    assert (tuned.num_warps, tuned.num_stages, tuned.programs) == (2, 1, 8)
    assert default.shared_bytes == 0 and default.spill_bytes == 0 and 0 < default.registers <= 255
    assert default.fits_h200


def test_triton_stats_of_a_tensor_core_matmul():
    """A 64x64x64 bf16 tl.dot on sm_90 runs as a wgmma whose operands are read from shared memory: at least the two
    8 KiB operand tiles must be there."""
    a = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    matmul = lambda a, b: pl.pallas_call(
        _matmul_kernel, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32), name="tiny_matmul"
    )(a, b)
    [stats] = cc.compile_triton_kernels(matmul, a, a)
    assert 2 * 64 * 64 * 2 <= stats.shared_bytes <= cc.H200_SHARED_MEMORY_BYTES


def test_triton_capture_needs_a_pallas_kernel():
    with pytest.raises(ValueError, match="no Pallas GPU kernel"):
        cc.compile_triton_kernels(lambda x: x + 1, jax.ShapeDtypeStruct((8,), jnp.float32))


def test_tpu_compile_of_a_tiny_kernel():
    """The real TPU compiler on a kernel whose buffers are known: a (16, 128) f32 block, double-buffered in and out,
    is 4 x 8 KiB of VMEM at least; the program's arguments and outputs are the (64, 128) f32 arrays (32 KiB each)."""
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)

    def kernel(x):
        return pl.pallas_call(
            _scale_kernel,
            grid=(4,),
            in_specs=[pl.BlockSpec((16, 128), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((16, 128), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            name="tiny_scale",
        )(x)

    c = cc.compile_for_tpu(kernel, x, topology=TPU_CHIPS["v5e"])
    assert c.device_kind == "TPU v5 lite" and c.chips == 1
    assert [k.name for k in c.kernels] == ["tiny_scale"]
    assert c.kernels[0].vmem_bytes >= 4 * 16 * 128 * 4, c
    assert c.argument_bytes == c.output_bytes == 64 * 128 * 4
    assert c.hbm_bytes == 16 * cc.GiB


def test_tpu_compile_refuses_a_mosaic_call_outside_shard_map_on_a_sharded_mesh():
    """As on a pod: on one chip the kernel compiles; with the batch sharded over 8 chips it must sit in shard_map."""
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)

    def kernel(x):
        return pl.pallas_call(_scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    def sharded(x):
        mesh = jax.sharding.get_abstract_mesh()
        return jax.shard_map(kernel, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)(x)

    topology = TPU_CHIPS["v5e"]
    assert len(cc.compile_for_tpu(kernel, x, topology=topology).kernels) == 1
    with pytest.raises(NotImplementedError, match="shard_map"):
        cc.compile_for_tpu(kernel, x, topology=topology, mesh_axes={"data": 8}, in_specs=P("data"))
    c = cc.compile_for_tpu(sharded, x, topology=topology, mesh_axes={"data": 8}, in_specs=P("data"))
    assert c.chips == 8 and c.argument_bytes == 64 * 128 * 4 // 8  # one chip's shard
    with pytest.raises(ValueError, match="needs mesh_axes"):
        cc.compile_for_tpu(kernel, x, topology=topology, in_specs=P("data"))
    with pytest.raises(ValueError, match="multiply to 8"):
        cc.compile_for_tpu(kernel, x, topology=topology, mesh_axes={"data": 4})
    with pytest.raises(ValueError, match="no TPU topology"):
        cc.compile_for_tpu(kernel, x, topology="v9z:2x2")


# ---------------------------------------------------------------- flash attention on an H200

_T = 1100  # ragged for every tile (16..128): the masked tail loops are compiled too; padded rows are not a power of 2
_HKV = 2
# (head_dim, query heads per KV head, causal, dtype, batch): every (head dim, group) pair causal and not in bf16 (the
# training dtype), f32 at both head dims, causal and not, with the smallest and largest groups, and the head-dim-256
# row of the tile table once. Batch 1 leaves the dk/dv grid short of the SMs (the kernel splits each group across
# programs), batch 8 fills it (no split).
FA_CONFIGS = [
    (d, g, causal, "bfloat16", 1 if causal else 8)
    for d in (64, 128)
    for g in (1, 2, 3, 4, 8)
    for causal in (True, False)
]
FA_CONFIGS += [(64, 1, True, "float32", 1), (64, 8, False, "float32", 8)]
FA_CONFIGS += [(128, 1, False, "float32", 8), (128, 8, True, "float32", 1), (256, 4, True, "bfloat16", 1)]


@pytest.fixture(scope="module")
def compile_table(request):
    rows = []
    yield rows
    table = cc.format_stats_table(rows)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:  # shown even when pytest captures output
        reporter.write_line("\nflash attention kernels compiled for sm_90a (triton):\n" + table)
    else:
        print(table)


@pytest.mark.parametrize("d,groups,causal,dtype,batch", FA_CONFIGS, ids=lambda v: str(v))
def test_flash_attention_gpu_kernels_fit_an_h200(d, groups, causal, dtype, batch, compile_table):
    """Forward, dq and dk/dv compile for sm_90a with the default tiles of their head dim and dtype, within the H200's
    shared memory per block; bf16 kernels also keep every value in registers (no spills)."""
    dtype = jnp.dtype(dtype)
    q = jax.ShapeDtypeStruct((batch, _T, _HKV * groups, d), dtype)
    kv = jax.ShapeDtypeStruct((batch, _T, _HKV, d), dtype)
    blocks = BlockSizes.default("gpu", head_dim=d, dtype=dtype)

    def loss(q, k, v):
        o = flash_attention_gpu(q, k, v, causal=causal, scale=d**-0.5, q_offset=0, block_sizes=blocks)
        return jnp.sum(o.astype(jnp.float32))

    # The precision users get by default (conftest asks for "highest", under which f32 dots leave the tensor cores for
    # FMA loops that spill tens of KB per thread and take minutes to compile).
    with jax.default_matmul_precision("default"):
        stats = cc.compile_triton_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    config = f"d={d} G={groups} {'causal' if causal else 'full'} {dtype.name} B={batch} T={_T}"
    compile_table.extend((config, s) for s in stats)
    assert [s.name for s in stats] == ["flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"]
    for s in stats:
        assert s.shared_bytes <= cc.H200_SHARED_MEMORY_BYTES, (config, s)
        if dtype == jnp.bfloat16:
            assert s.spill_bytes == 0, (config, s)


# Packed documents: every (head dim, group) corner, causal and not, in bf16, and f32 at both head dims, plus d=256.
FA_SEGMENT_CONFIGS = [
    (d, g, causal, "bfloat16", 1 if causal else 8) for d in (64, 128) for g in (1, 4, 8) for causal in (True, False)
]
FA_SEGMENT_CONFIGS += [(64, 1, True, "float32", 1), (128, 8, True, "float32", 1), (256, 4, True, "bfloat16", 1)]


@pytest.mark.parametrize("d,groups,causal,dtype,batch", FA_SEGMENT_CONFIGS, ids=lambda v: str(v))
def test_flash_attention_gpu_kernels_with_segment_ids_fit_an_h200(d, groups, causal, dtype, batch, compile_table):
    """With segment ids (extra id and span operands, the id mask in every computed tile) the three kernels still
    compile for sm_90a within the H200's shared memory, and bf16 kernels still do not spill."""
    dtype = jnp.dtype(dtype)
    q = jax.ShapeDtypeStruct((batch, _T, _HKV * groups, d), dtype)
    kv = jax.ShapeDtypeStruct((batch, _T, _HKV, d), dtype)
    ids = jax.ShapeDtypeStruct((batch, _T), jnp.int32)
    blocks = BlockSizes.default("gpu", head_dim=d, dtype=dtype)

    def loss(q, k, v, ids):
        o = flash_attention_gpu(
            q, k, v, causal=causal, scale=d**-0.5, q_offset=0, block_sizes=blocks, segment_ids=ids, kv_segment_ids=ids
        )
        return jnp.sum(o.astype(jnp.float32))

    with jax.default_matmul_precision("default"):  # as in the test above
        stats = cc.compile_triton_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, ids)
    config = f"d={d} G={groups} {'causal' if causal else 'full'} {dtype.name} B={batch} T={_T} segment ids"
    compile_table.extend((config, s) for s in stats)
    assert [s.name for s in stats] == ["flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"]
    for s in stats:
        assert s.shared_bytes <= cc.H200_SHARED_MEMORY_BYTES, (config, s)
        if dtype == jnp.bfloat16:
            assert s.spill_bytes == 0, (config, s)


# The recipes' shapes: Qwen3-1.7B (16 query heads over 8 KV heads, d = 128) and SmolLM2-135M (9 over 3, d = 64) in
# bf16; a decode step (T = 1) against caches of 4K and 32K keys (forward only) and a 16K-token prefill with its
# gradient (stage 3's length).
RECIPE_SHAPES = [
    pytest.param(1, 4096, 16, 8, 128, False, id="qwen3-decode-4K"),
    pytest.param(1, 32768, 16, 8, 128, False, id="qwen3-decode-32K"),
    pytest.param(1, 32768, 9, 3, 64, False, id="smollm2-decode-32K"),
    pytest.param(16384, 16384, 16, 8, 128, True, id="qwen3-prefill-16K-grad"),
    pytest.param(16384, 16384, 9, 3, 64, True, id="smollm2-prefill-16K-grad"),
]


@pytest.mark.parametrize("t,s,hq,hkv,d,grad", RECIPE_SHAPES)
def test_flash_attention_gpu_kernels_at_the_recipes_shapes_fit_an_h200(t, s, hq, hkv, d, grad, compile_table):
    """The kernels at the shapes the recipes run: a decode step's query against the whole cache (q_offset = S − 1,
    a grid of one query tile per head and batch row) and a 16K prefill with dq and dk/dv, within the H200's shared
    memory and without spills (bf16)."""
    q = jax.ShapeDtypeStruct((1, t, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, s, hkv, d), jnp.bfloat16)
    blocks = BlockSizes.default("gpu", head_dim=d, dtype=jnp.bfloat16)

    def attend(q, k, v):
        return flash_attention_gpu(q, k, v, causal=True, scale=d**-0.5, q_offset=s - t, block_sizes=blocks)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32))

    fn = jax.grad(loss, argnums=(0, 1, 2)) if grad else attend
    with jax.default_matmul_precision("default"):  # as in the tests above
        stats = cc.compile_triton_kernels(fn, q, kv, kv)
    config = f"d={d} {hq}/{hkv} heads bf16 T={t} S={s}"
    compile_table.extend((config, st) for st in stats)
    want = ["flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"] if grad else ["flash_attention_fwd"]
    assert [st.name for st in stats] == want
    for st in stats:
        assert st.shared_bytes <= cc.H200_SHARED_MEMORY_BYTES and st.spill_bytes == 0, (config, st)


# ---------------------------------------------------------------- flash attention on a TPU


@pytest.fixture(scope="module")
def tpu_table(show):
    rows = []
    yield rows
    show("\nflash attention compiled by XLA:TPU (libtpu):\n" + cc.format_tpu_table(rows))


_OUR_TPU_KERNELS = ["flash_attention_dkv", "flash_attention_dq", "flash_attention_fwd"]


def _compile_fa_grad_for_tpu(chip, grad, args, spec, table, config, kernels=_OUR_TPU_KERNELS):
    """Compile ``grad`` for one chip of ``chip`` and, inside shard_map with batch and KV heads sharded, for the 8-chip
    slice (2 x 4); both must hold the three Mosaic kernels ``kernels`` (forward, dq, dk/dv) within the chip's HBM."""
    single = cc.compile_for_tpu(grad, *args, topology=TPU_CHIPS[chip])
    n = len(args)

    def sharded(*a):
        mesh = jax.sharding.get_abstract_mesh()
        in_specs = (spec,) * 3 + (P("data", None),) * (n - 3)
        return jax.shard_map(grad, mesh=mesh, in_specs=in_specs, out_specs=(spec,) * 3, check_vma=False)(*a)

    in_specs = (spec,) * 3 + (P("data", None),) * (n - 3)
    pod = cc.compile_for_tpu(
        sharded, *args, topology=TPU_CHIPS[chip], mesh_axes={"data": 2, "heads": 4}, in_specs=in_specs
    )
    table.extend([(config, single), (config + " in shard_map", pod)])
    for c in (single, pod):
        names = [k.name for k in c.kernels]
        assert sorted(names) == sorted(kernels), names
        assert c.peak_bytes < c.hbm_bytes
    # Each chip holds a quarter of the heads and half the batch: its arguments are an eighth of the whole, up to the
    # tile padding of its layouts (rows pad to the (8 or 16, 128) tile; 300 -> 304 is 1.3 %; measured 0.3 %).
    assert single.argument_bytes <= pod.argument_bytes * 8 <= 1.02 * single.argument_bytes, (pod, single)


@pytest.mark.parametrize("chip", TPU_CHIPS)
@pytest.mark.parametrize("d,groups,causal,dtype", [(64, 1, True, "float32"), (128, 8, False, "bfloat16")])
def test_flash_attention_tpu_kernels_compile_for_tpu(chip, d, groups, causal, dtype, tpu_table):
    """Forward and backward Mosaic kernels compile with the TPU compiler for a v5e and a v6e chip: on one chip, and
    inside shard_map with batch and KV heads sharded over an 8-chip slice (2 x 4)."""
    q = jax.ShapeDtypeStruct((2, 300, 4 * groups, d), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((2, 300, 4, d), jnp.dtype(dtype))

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=causal, implementation="pallas_tpu").astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    config = f"d={d} G={groups} {'causal' if causal else 'full'} {dtype} B=2 T=300"
    _compile_fa_grad_for_tpu(chip, grad, (q, kv, kv), P("data", None, "heads", None), tpu_table, config)


@pytest.mark.parametrize("chip", TPU_CHIPS)
@pytest.mark.parametrize("causal,kv_len,block_k", [(False, 300, None), (True, 1024, None), (True, 1024, 136)])
def test_flash_attention_tpu_kernels_with_segment_ids_compile_for_tpu(chip, causal, kv_len, block_k, tpu_table):
    """With segment ids (scalar prefetch of the tile id ranges and spans, id tiles of (bq, 1) and (1, bk)) forward and
    backward compile for a v5e and a v6e chip: keys covered by one tile (S = 300), split into the default 512-wide
    tiles and into 136-wide ones (no multiple of 128: the key ids' block must still pass Mosaic's block rule),
    queries continuing a cached prefix through kv_segment_ids (S = 1024); on one chip and inside shard_map."""
    blocks = None
    if block_k is not None:
        blocks = BlockSizes(block_k=block_k, block_k_dq=block_k, block_k_dkv=block_k, block_q_dq=256, block_q_dkv=256)
    q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, kv_len, 4, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 300), jnp.int32)
    kv_ids = jax.ShapeDtypeStruct((2, kv_len), jnp.int32)

    def grad(q, k, v, ids, kv_ids):
        def loss(q, k, v):
            o = flash_attention(
                q,
                k,
                v,
                causal=causal,
                segment_ids=ids,
                kv_segment_ids=kv_ids,
                implementation="pallas_tpu",
                block_sizes=blocks,
            )
            return jnp.sum(o.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    config = (
        f"d=128 G=2 {'causal' if causal else 'full'} bfloat16 T=300 S={kv_len} bk={block_k or 'default'} segment ids"
    )
    _compile_fa_grad_for_tpu(chip, grad, (q, kv, kv, ids, kv_ids), P("data", None, "heads", None), tpu_table, config)


@pytest.mark.parametrize("chip", TPU_CHIPS)
@pytest.mark.parametrize("implementation", ["splash", "pallas_tpu"])
def test_splash_and_our_kernel_compile_for_tpu(chip, implementation, tpu_table):
    """The FA groups' training shape on TPU (causal, GQA 16 query / 8 KV heads, d = 128, packed documents, bf16,
    T = 2048) compiles with Google's splash attention and with our kernel for a v5e and a v6e chip and in shard_map
    over the 8-chip slice; the table puts their VMEM and temporaries side by side."""
    q = jax.ShapeDtypeStruct((2, 2048, 16, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 2048, 8, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 2048), jnp.int32)

    def grad(q, k, v, ids):
        def loss(q, k, v):
            o = flash_attention(q, k, v, causal=True, segment_ids=ids, implementation=implementation)
            return jnp.sum(o.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    kernels = _OUR_TPU_KERNELS
    if implementation == "splash":
        kernels = [f"splash_mha_{k}_segmented_{r}" for k, r in (("dkv", "no_residuals"), ("dq", "no_residuals"))]
        kernels.append("splash_mha_fwd_segmented_residuals")
    config = f"{implementation}: d=128 16/8 heads causal bfloat16 B=2 T=2048 segment ids"
    # The precision users get by default: under conftest's "highest", Mosaic cannot compile splash's bf16 dots
    # (splash_unsupported says so, and auto then takes our kernel, which pins DEFAULT for them).
    with jax.default_matmul_precision("default"):
        _compile_fa_grad_for_tpu(
            chip, grad, (q, kv, kv, ids), P("data", None, "heads", None), tpu_table, config, kernels
        )
