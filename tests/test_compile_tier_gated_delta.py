"""Compile tier of the gated delta kernels: they compile for an H200 and for TPU chips, proven without either.

What this proves (pallas_kernels/cross_compile.py does the work): every Pallas GPU kernel of the rule, forward and
backward, translates to Triton IR and is compiled by Triton for sm_90a with its own warps/stages, and fits the
H200's 232,448 B of shared memory per block (a kernel over it fails to launch on the device); the Pallas TPU
kernels are compiled by the real TPU compiler (libtpu's compile-only devices: Mosaic's layout inference and VMEM
allocation included) for a v5e and a v6e chip and, inside ``jax.shard_map``, for an 8-chip v5e slice with the
batch sharded, each kernel's VMEM and the program's per-chip memory reported; with segment ids (packed documents: one more operand per kernel, in G's layout) as without. What it does
not prove: speed, or values on the device (tests/test_gated_delta.py checks the same
kernel bodies' values and gradients in interpret mode; bench/gpu_check_gated_delta.py on a GPU).

Registers and spills are printed (``pytest -s``) and recorded as test properties; the table in bench/RESULTS.md
comes from the same call.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import cross_compile
from pallas_kernels.gated_delta import pallas_gpu, pallas_tpu

# The compile tier is in the end-to-end tier (`make test-all`); libtpu from its own folder (conftest's `libtpu`).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("libtpu")]

KERNELS = {
    "gated_delta_state",
    "gated_delta_output",
    "gated_delta_dv_local",
    "gated_delta_dstate",
    "gated_delta_grads",
}
# On a GPU the WY prologue of half-precision runs is a kernel too (fp32 runs and the TPU keep XLA's).
HALF_PRECISION_GPU_KERNELS = KERNELS | {"gated_delta_prologue"}
B, T, H = 2, 300, 2  # T = 300: ragged (padded to 320 inside); the grid size does not change what compiles


def _args(dim, dtype, segmented=False):
    """q, k, v, g, β, s0 (and segment ids [B, T] int32 when ``segmented``) as abstract values."""
    x = jax.ShapeDtypeStruct((B, T, H, dim), dtype)
    gate = jax.ShapeDtypeStruct((B, T, H), dtype)
    args = (x, x, x, gate, gate, jax.ShapeDtypeStruct((B, H, dim, dim), jnp.float32))
    return args + (jax.ShapeDtypeStruct((B, T), jnp.int32),) if segmented else args


def _value_and_grads(kernel_fn):
    """Forward and backward of the rule as the model uses it (l2norm, initial and final state; segment ids when a
    7th argument is given)."""

    def loss(q, k, v, g, beta, s0, segment_ids=None):
        o, s = kernel_fn(
            q,
            k,
            v,
            g,
            beta,
            scale=q.shape[-1] ** -0.5,
            initial_state=s0,
            output_final_state=True,
            use_qk_l2norm=True,
            segment_ids=segment_ids,
        )
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    return jax.value_and_grad(loss, argnums=range(6))


def _dtype_params():
    return [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "segment_ids"])
@pytest.mark.parametrize("dtype", _dtype_params())
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_kernels_compile_for_h200_within_shared_memory(dim, dtype, segmented, record_property):
    fn = _value_and_grads(pallas_gpu.chunk_gated_delta_rule_pallas_gpu)
    stats = cross_compile.compile_triton_kernels(fn, *_args(dim, dtype, segmented))
    config = f"K=V={dim} {jnp.dtype(dtype).name} chunk 64" + (" segment ids" if segmented else "")
    table = cross_compile.format_stats_table([(config, s) for s in stats])
    print("\n" + table)
    record_property("compile_table", table)
    assert {s.name for s in stats} == (KERNELS if dtype == jnp.float32 else HALF_PRECISION_GPU_KERNELS), table
    cfg = pallas_gpu.gpu_config(dim, dim)
    for s in stats:
        assert s.shared_bytes <= cross_compile.H200_SHARED_MEMORY_BYTES, f"{s.name} over the H200 limit:\n{table}"
        assert s.num_warps in (cfg.warps_seq, cfg.warps_par), f"{s.name}: warps not from pallas_gpu.GPU_CONFIGS"


# Compile targets: a v5e and a v6e chip (one of an 8-chip slice's), and the slice itself for the sharded program.
TPU_CHIPS = {"v5e": "v5e:2x4", "v6e": "v6e:2x4"}


@pytest.fixture(scope="module")
def tpu_table(show):
    rows = []
    yield rows
    show("\ngated delta compiled by XLA:TPU (libtpu):\n" + cross_compile.format_tpu_table(rows))


def _check_tpu_kernels(compiled):
    names = {k.name for k in compiled.kernels}
    assert names == KERNELS, names
    assert len(compiled.kernels) == len(KERNELS), compiled.kernels
    assert compiled.peak_bytes < compiled.hbm_bytes


# (head dim, chip, dtype, segment ids). A compile of the five kernels takes 20-35 s of CPU, so the rows cover each
# axis rather than the product: both head dims, both chips, bf16 (the training dtype) with and without segment ids
# on each chip, f32 (other tile layouts: (8, 128) instead of (16, 128)) on the v5e.
TPU_CONFIGS = [
    (128, "v5e", jnp.bfloat16, False),
    (128, "v5e", jnp.bfloat16, True),
    (64, "v5e", jnp.float32, False),
    (128, "v6e", jnp.bfloat16, False),
    (64, "v6e", jnp.bfloat16, True),
]


@pytest.mark.parametrize("dim,chip,dtype,segmented", TPU_CONFIGS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_tpu_kernels_compile(dim, chip, dtype, segmented, tpu_table):
    """The five Mosaic kernels (forward and backward) compile with the TPU compiler for one chip."""
    compiled = cross_compile.compile_for_tpu(
        _value_and_grads(pallas_tpu.chunk_gated_delta_rule_pallas_tpu),
        *_args(dim, dtype, segmented),
        topology=TPU_CHIPS[chip],
    )
    config = f"K=V={dim} {jnp.dtype(dtype).name} B={B} T={T} H={H}" + (" segment ids" if segmented else "")
    tpu_table.append((config, compiled))
    _check_tpu_kernels(compiled)


def test_tpu_kernels_compile_in_shard_map_on_a_slice(tpu_table):
    """Batch sharded over an 8-chip v5e slice, packed documents: the kernels compile inside shard_map (Mosaic cannot
    be partitioned)."""
    segmented = True
    n_args = 7
    specs = (P("data"),) * n_args  # every argument's leading axis is the batch
    value_and_grads = _value_and_grads(pallas_tpu.chunk_gated_delta_rule_pallas_tpu)

    def per_shard(*args):
        value, grads = value_and_grads(*args)
        return jax.lax.psum(value, "data"), grads

    def sharded(*args):
        mesh = jax.sharding.get_abstract_mesh()
        # check_vma=False: pallas_call has no varying-manual-axes rule to infer from.
        out_specs = (P(), specs[:6])  # no gradient for the segment ids
        return jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(*args)

    args = tuple(jax.ShapeDtypeStruct((8,) + a.shape[1:], a.dtype) for a in _args(64, jnp.bfloat16, segmented))
    compiled = cross_compile.compile_for_tpu(
        sharded, *args, topology=TPU_CHIPS["v5e"], mesh_axes={"data": 8}, in_specs=specs
    )
    tpu_table.append(("K=V=64 bfloat16 B=8 over 8 chips" + (" segment ids" if segmented else ""), compiled))
    _check_tpu_kernels(compiled)
