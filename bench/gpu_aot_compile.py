"""Our GPU kernels compiled by jaxlib's own XLA:GPU pipeline (its Triton, LLVM and ptxas) for an H200, without a GPU.

    pip install "jax-cuda12-plugin[with-cuda]==$(python -c 'import jax; print(jax.__version__)')"   # ~5 GB
    python bench/gpu_aot_compile.py                  # the recipes' attention and gated delta shapes, bf16 and f32
    python bench/gpu_aot_compile.py --quick          # one small case of each kernel family

JAX compiles for a GPU it does not have from a device description: `jax.experimental.topologies.get_topology_desc(
platform="cuda", target_config=H200, topology="1x1x1")` with the CUDA PJRT plugin installed gives a compile-only
H200, and `jit(...).lower(...).compile()` then runs XLA:GPU's passes, including the Pallas kernels' Triton
compilation, as on the device. The compile tier of the test suite compiles our Triton IR with the `triton`
package instead (the CUDA plugin and its libraries are ~5 GB, too much for every test environment); this script is
the check against jaxlib's bundled Triton, whose shared memory per kernel can differ from the package's.

Per kernel it reports what XLA's thunk sequence records (``--xla_dump_to``): grid, threads per block and the
shared memory the compiled kernel needs, against the H200's 232,448 B per block (a kernel over it fails to launch).
cuDNN's fused attention is compiled too (XLA accepts the custom call and its layout); whether cuDNN supports the
configuration is decided only when it builds its graph on a device. JAX_PLATFORMS is set to ``cpu`` so the plugin
registers without a CUDA driver (it then skips its driver version checks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
DUMP = Path(tempfile.mkdtemp(prefix="gpu_aot_dump_"))
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP}".strip()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.cross_compile import H200_SHARED_MEMORY_BYTES  # noqa: E402

# The H200 (SXM) as XLA describes a GPU (GpuTargetConfigProto): NVIDIA's published figures (132 SMs, 228 KiB of
# shared memory per SM, 227 KiB per block opt-in, 64K registers, 50 MiB L2, 141 GB of HBM3e at 4.8 TB/s) and the
# CUDA 12.9 / cuDNN 9 of the plugin's libraries.
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version { major: 12 minor: 9 }
dnn_version_info { major: 9 minor: 8 }
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""

_THUNK = re.compile(
    r"kCustomKernel.*?\]\s+(?P<name>\S+) grid: \[(?P<grid>[\d, ]+)\] threads: \[(?P<threads>[\d, ]+)\]"
    r"\s+shared_memory: (?P<shared>\d+) bytes"
)


def h200_mesh():
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc("h200", "cuda", target_config=H200, topology="1x1x1")
    except (NotImplementedError, RuntimeError) as e:
        sys.exit(
            f"no CUDA PJRT plugin to compile for a GPU ({e}). Install it beside this jax: "
            f'pip install "jax-cuda12-plugin[with-cuda]=={jax.__version__}"'
        )
    return jax.sharding.Mesh(topology.devices, ("x",))


def kernels_of(module_name: str, known: set[str]) -> list[dict]:
    """The Pallas kernels (names in ``known``) of the newest dumped module called ``module_name``."""
    files = sorted(DUMP.glob(f"module_*.{module_name}.thunk_sequence.txt"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise RuntimeError(f"no thunk sequence dumped for {module_name} in {DUMP}")
    rows = []
    for m in _THUNK.finditer(files[-1].read_text()):
        base = re.sub(r"(__\d+)+$", "", m["name"])
        if base in known:
            grid = tuple(int(x) for x in m["grid"].split(","))
            threads = int(m["threads"].split(",")[0])
            rows.append(dict(kernel=m["name"], grid=grid, warps=threads // 32, shared_bytes=int(m["shared"])))
    return rows


def _named(fn, name):
    def call(*args):
        return fn(*args)

    call.__name__ = call.__qualname__ = name
    return call


def cases(quick: bool):
    """(name, function, abstract arguments, kernel names, needs cuDNN's probes answered)."""
    from pallas_kernels.flash_attention import flash_attention
    from pallas_kernels.gated_delta import chunk_gated_delta_rule

    fa_kernels = {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"}
    gd_kernels = {f"gated_delta_{k}" for k in ("prologue", "state", "output", "dv_local", "dstate", "grads")}
    T = 512 if quick else 2048
    out = []
    fa_shapes = [("SmolLM2 9/3 d=64", 9, 3, 64)] + ([] if quick else [("Qwen3 16/8 d=128", 16, 8, 128)])
    for label, heads, kv, d in fa_shapes:
        for impl in ("pallas_gpu", "cudnn"):

            def fa(q, k, v, impl=impl):
                return flash_attention(q, k, v, causal=True, implementation=impl).astype(jnp.float32).sum()

            q = jax.ShapeDtypeStruct((1, T, heads, d), jnp.bfloat16)
            kvs = jax.ShapeDtypeStruct((1, T, kv, d), jnp.bfloat16)
            name = f"flash attention {impl}, {label}, bf16 T={T}"
            out.append((name, jax.value_and_grad(fa, argnums=(0, 1, 2)), (q, kvs, kvs), fa_kernels, impl == "cudnn"))
    dims = [64] if quick else [64, 128]
    for dim in dims:
        for dtype in (jnp.bfloat16,) if quick else (jnp.bfloat16, jnp.float32):

            def gd(q, k, v, g, beta):
                o, s = chunk_gated_delta_rule(
                    q, k, v, g, beta, use_qk_l2norm=True, output_final_state=True, implementation="pallas_gpu"
                )
                return o.astype(jnp.float32).sum() + s.sum()

            x = jax.ShapeDtypeStruct((1, T, 16, dim), dtype)
            gate = jax.ShapeDtypeStruct((1, T, 16), dtype)
            name = f"gated delta pallas_gpu, 16 heads K=V={dim}, {jnp.dtype(dtype).name} T={T}"
            out.append((name, jax.value_and_grad(gd, argnums=range(5)), (x, x, x, gate, gate), gd_kernels, False))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = ap.parse_args(argv)
    from pallas_kernels.flash_attention.cudnn import assume_cuda_runtime

    mesh = h200_mesh()
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    print(f"jax {jax.__version__}; compile-only {mesh.devices.flat[0].device_kind}; dumps in {DUMP}")
    print(
        "\n| case | kernel | grid | warps | shared memory B | fits 232,448 B | compile s |\n|---|---|---|---|---|---|---|"
    )
    rows = []
    for i, (name, fn, args, known, cudnn) in enumerate(cases(a.quick)):
        module = f"case{i}"  # XLA names the module jit_<function name>: its dump files are found by it
        fn = _named(fn, module)
        args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated) for x in args]
        start = time.perf_counter()
        with jax.set_mesh(mesh), assume_cuda_runtime(cudnn_version=90800) if cudnn else contextlib.nullcontext():
            lowered = jax.jit(fn).trace(*args).lower()
        with jax.set_mesh(mesh):
            compiled = lowered.compile()
        seconds = time.perf_counter() - start
        found = kernels_of(f"jit_{module}", known)
        if not cudnn and not found:
            sys.exit(f"{name}: none of the kernels {sorted(known)} is in the compiled program")
        if cudnn:
            calls = compiled.as_text().count("__cudnn$fmha")
            rows.append(dict(case=name, kernel=f"cuDNN fused attention ({calls} calls)", compile_s=seconds))
            print(f"| {name} | cuDNN fused attention, {calls} custom calls | — | — | — | — | {seconds:.1f} |")
            continue
        for k in found:
            fits = k["shared_bytes"] <= H200_SHARED_MEMORY_BYTES
            rows.append(dict(case=name, **k, fits=fits, compile_s=seconds))
            grid = "x".join(map(str, k["grid"]))
            print(
                f"| {name} | {k['kernel']} | {grid} | {k['warps']} | {k['shared_bytes']:,} | "
                f"{'yes' if fits else 'NO'} | {seconds:.1f} |"
            )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    if any(r.get("fits") is False for r in rows):
        sys.exit("a kernel needs more shared memory than an H200 block has")


if __name__ == "__main__":
    main()
