"""Compile tier of the gated delta kernels: they compile for an H200 and lower for TPU, proven without either.

What this proves (pallas_kernels/cross_compile.py does the work): every Pallas GPU kernel of the rule, forward and
backward, translates to Triton IR and is compiled by Triton for sm_90a with its own warps/stages, and fits the
H200's 232,448 B of shared memory per block (a kernel over it fails to launch on the device); the Pallas TPU
kernels pass Mosaic's lowering for a TPU chip and, inside ``jax.shard_map``, under an 8-chip abstract mesh with the
batch sharded; with segment ids (packed documents: one more (C, 1) operand per kernel) as without. What it does
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

KERNELS = {
    "gated_delta_state",
    "gated_delta_output",
    "gated_delta_dv_local",
    "gated_delta_dstate",
    "gated_delta_grads",
}
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
    return [pytest.param(jnp.float32, marks=pytest.mark.slow, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


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
    assert {s.name for s in stats} == KERNELS, table
    cfg = pallas_gpu.gpu_config(dim, dim)
    for s in stats:
        assert s.shared_bytes <= cross_compile.H200_SHARED_MEMORY_BYTES, f"{s.name} over the H200 limit:\n{table}"
        assert s.num_warps in (cfg.warps_seq, cfg.warps_par), f"{s.name}: warps not from pallas_gpu.GPU_CONFIGS"


def _kernel_names(stablehlo: str) -> set[str]:
    return {name for name in KERNELS if name in stablehlo}


@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "segment_ids"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", [64, 128])
def test_tpu_kernels_lower(dim, dtype, segmented):
    text = cross_compile.lower_for_tpu(
        _value_and_grads(pallas_tpu.chunk_gated_delta_rule_pallas_tpu), *_args(dim, dtype, segmented)
    )
    assert text.count("tpu_custom_call") == len(KERNELS)
    assert _kernel_names(text) == KERNELS


@pytest.mark.parametrize("segmented", [False, True], ids=["plain", "segment_ids"])
def test_tpu_kernels_lower_in_shard_map_on_a_pod(segmented):
    """Batch sharded over 8 abstract TPU chips: the kernels lower inside shard_map (Mosaic cannot be partitioned)."""
    n_args = 7 if segmented else 6
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
    text = cross_compile.lower_for_tpu(sharded, *args, mesh_axes={"data": 8}, in_specs=specs)
    assert _kernel_names(text) == KERNELS
