"""Compile Pallas kernels for accelerators this machine does not have: an H200 (Triton) and a TPU pod (Mosaic).

JAX cross-lowers a program for another platform (``.lower(lowering_platforms=...)``), and its Pallas lowerings
consult the *abstract device* of the current abstract mesh (``jax.sharding.use_abstract_mesh``) instead of the local
device when one is set. This module uses that to prove, on a CPU-only machine, that kernels fit the hardware:

* :func:`compile_triton_kernels` traces ``jax.jit(fn)`` as if on an NVIDIA H200, captures the Triton IR of every
  ``pallas_call`` in the program (forward and, for a ``jax.grad`` of a ``custom_vjp``, backward), and compiles each
  with the ``triton`` package for ``sm_90a`` using the kernel's own ``num_warps`` / ``num_stages``. Shared memory
  comes from Triton's metadata, registers and spills from ``ptxas -v`` on the PTX. XLA compiles the same IR with
  the Triton bundled in jaxlib, so the figures are those of the ``triton`` package's version of the compiler: a
  kernel that exceeds the shared-memory limit here is over budget on the device too, modulo version drift.
* :func:`lower_for_tpu` lowers ``jax.jit(fn)`` for TPU, optionally under an abstract TPU mesh with the arguments
  sharded over it, so Mosaic's lowering checks run as on a pod (for instance, a Mosaic call outside
  ``jax.shard_map`` on sharded operands fails here exactly as it would there).

Private JAX API used (tried with jax 0.12.0.x and triton 3.7.x; other versions get a warning, a missing piece a
RuntimeError that names it):
  ``jax._src.pallas.core._backend_lowering_rules``: the registry of per-backend ``pallas_call`` lowering rules;
  ``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module``: the jaxpr → Triton MLIR translation.
Both are wrapped only for the duration of one capture (see :func:`_capture_triton_ir`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import subprocess
import tempfile
import threading
import warnings

import jax

__all__ = [
    "H200",
    "H200_SHARED_MEMORY_BYTES",
    "TritonKernelIR",
    "TritonKernelStats",
    "compile_triton_kernels",
    "format_stats_table",
    "lower_for_tpu",
    "tpu_abstract_mesh",
    "triton_ir",
]

# Largest dynamic shared memory one thread block may opt into on sm_90 (227 KiB; cudaDevAttrMaxSharedMemoryPerBlockOptin).
H200_SHARED_MEMORY_BYTES = 232_448
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
_SM90A_TARGET = ("cuda", 90, 32)  # (backend, compute capability, warp size) of triton's GPUTarget
_TRIED_VERSIONS = {"jax": "0.12.0", "triton": "3.7."}
# Pallas' own defaults when CompilerParams leaves them unset (jax/_src/pallas/triton/pallas_call_registration.py).
_PALLAS_DEFAULT_NUM_WARPS, _PALLAS_DEFAULT_NUM_STAGES = 4, 3
# TensorCores per chip (v4 and v5p pair two per chip as one megacore device).
_TPU_NUM_CORES = {"TPU v4": 2, "TPU v5p": 2, "TPU v5": 2, "TPU v5 lite": 1, "TPU v6 lite": 1, "TPU v6e": 1}

_lock = threading.Lock()  # the capture swaps module globals: one capture at a time


@dataclasses.dataclass(frozen=True)
class TritonKernelStats:
    """What the compiler says about one ``pallas_call`` compiled for sm_90a.

    name: the kernel's name (``pallas_call(name=...)``); num_warps, num_stages: its launch configuration;
    grid: the program grid (x, y, z) of the call as lowered; shared_bytes: static shared memory per block (Triton
    metadata); registers: registers per thread, spill_bytes: spill stores + loads per thread, stack_bytes: the
    stack frame (all from ``ptxas -v``).
    """

    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    shared_bytes: int
    registers: int
    spill_bytes: int
    stack_bytes: int

    @property
    def fits_h200(self) -> bool:
        return self.shared_bytes <= H200_SHARED_MEMORY_BYTES

    @property
    def programs(self) -> int:
        """Thread blocks launched: compare with the H200's 132 SMs."""
        x, y, z = self.grid
        return x * y * z


@dataclasses.dataclass(frozen=True)
class TritonKernelIR:
    """One pallas_call as lowered for an H200: its name, launch configuration, grid and Triton IR (MLIR text)."""

    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    ttir: str


def _check_versions() -> None:
    for pkg, module in (("jax", jax), ("triton", None)):
        if module is None:
            try:
                import triton as module
            except ImportError as e:
                raise RuntimeError(
                    "pallas_kernels.cross_compile needs the `triton` package (tried with triton 3.7.x; "
                    "`pip install triton==3.7.*`, torch installs it too)"
                ) from e
        if not module.__version__.startswith(_TRIED_VERSIONS[pkg]):
            warnings.warn(
                f"pallas_kernels.cross_compile was tried with {pkg} {_TRIED_VERSIONS[pkg]}x, found "
                f"{module.__version__}: it relies on private APIs that may have changed",
                stacklevel=3,
            )


def _triton_private_api():
    """(pallas core module, triton lowering module, triton CompilerParams class), or a RuntimeError naming what moved."""
    try:
        from jax._src.pallas import core as pallas_core
        from jax._src.pallas.triton import core as triton_core
        from jax._src.pallas.triton import lowering as triton_lowering
        from jax._src.pallas.triton import pallas_call_registration  # noqa: F401  (registers the GPU rule)

        if triton_core.CompilerParams not in pallas_core._backend_lowering_rules:
            raise KeyError("no Triton pallas_call lowering rule registered")
        if not callable(triton_lowering.lower_jaxpr_to_triton_module):
            raise AttributeError("lower_jaxpr_to_triton_module")
    except (ImportError, AttributeError, KeyError) as e:
        raise RuntimeError(
            f"pallas_kernels.cross_compile: JAX {jax.__version__} no longer has the private Pallas Triton hooks it "
            f"wraps ({e!r}); it was written against jax 0.12.0.x — update _capture_triton_ir for this version"
        ) from e
    return pallas_core, triton_lowering, triton_core.CompilerParams


@contextlib.contextmanager
def _capture_triton_ir():
    """Within the block, every pallas_call lowered for a GPU appends a TritonKernelIR to the yielded list.

    The GPU lowering rule is wrapped to learn each call's name and compiler params, and the jaxpr → Triton
    translation it calls to keep the module's text; both are restored on exit.
    """
    pallas_core, triton_lowering, params_cls = _triton_private_api()
    captured: list[TritonKernelIR] = []
    pending: list[tuple] = []
    rules = pallas_core._backend_lowering_rules
    original_rule, rule_platform = rules[params_cls]
    original_translate = triton_lowering.lower_jaxpr_to_triton_module

    def rule(ctx, *in_nodes, **params):
        compiler_params = params.get("compiler_params")
        warps = getattr(compiler_params, "num_warps", None)
        stages = getattr(compiler_params, "num_stages", None)
        pending.append((params.get("name"), warps, stages))
        return original_rule(ctx, *in_nodes, **params)

    def translate(jaxpr, *args, **kwargs):
        result = original_translate(jaxpr, *args, **kwargs)
        name, warps, stages = pending.pop() if pending else (None, None, None)
        grid = tuple(result.grid) + (1,) * (3 - len(result.grid))
        captured.append(
            TritonKernelIR(
                name=name or jaxpr.debug_info.func_name,
                num_warps=_PALLAS_DEFAULT_NUM_WARPS if warps is None else warps,
                num_stages=_PALLAS_DEFAULT_NUM_STAGES if stages is None else stages,
                grid=grid,
                ttir=result.module.operation.get_asm(),
            )
        )
        return result

    with _lock:
        rules[params_cls] = (rule, rule_platform)
        triton_lowering.lower_jaxpr_to_triton_module = translate
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
                yield captured
        finally:
            rules[params_cls] = (original_rule, rule_platform)
            triton_lowering.lower_jaxpr_to_triton_module = original_translate


def _ptxas_stats(ptx: str, workdir: str) -> tuple[int, int, int]:
    """(registers, spill bytes, stack frame bytes) of the one kernel in ``ptx``, from ``ptxas -v``."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    src = os.path.join(workdir, "kernel.ptx")
    with open(src, "w") as f:
        f.write(ptx)
    out = subprocess.run(
        [ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(workdir, "kernel.cubin")],
        capture_output=True,
        text=True,
        check=True,
    )
    log = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    if regs is None:
        raise RuntimeError(f"could not read the register count from ptxas -v:\n{log}")
    return (
        int(regs.group(1)),
        int(spills.group(1)) + int(spills.group(2)) if spills else 0,
        int(stack.group(1)) if stack else 0,
    )


def _compile_one(kernel: TritonKernelIR, workdir: str) -> TritonKernelStats:
    import triton
    from triton.backends.compiler import GPUTarget

    src = os.path.join(workdir, f"{kernel.name}.ttir")
    with open(src, "w") as f:
        f.write(kernel.ttir)
    try:
        compiled = triton.compiler.compile(
            src,
            target=GPUTarget(*_SM90A_TARGET),
            options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages),
        )
    except Exception as e:
        raise RuntimeError(f"Triton failed to compile pallas_call {kernel.name!r} for sm_90a: {e}") from e
    registers, spill_bytes, stack_bytes = _ptxas_stats(compiled.asm["ptx"], workdir)
    return TritonKernelStats(
        name=kernel.name,
        num_warps=kernel.num_warps,
        num_stages=kernel.num_stages,
        grid=kernel.grid,
        shared_bytes=int(compiled.metadata.shared),
        registers=registers,
        spill_bytes=spill_bytes,
        stack_bytes=stack_bytes,
    )


def triton_ir(fn, *args, **kwargs) -> list[TritonKernelIR]:
    """The Triton IR of every pallas_call in ``jax.jit(fn)(*args, **kwargs)`` lowered for an H200, in program order.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct``s; ``kwargs`` are bound before jitting (static).
    """
    _check_versions()
    # A fresh callable each time: jit's trace/lowering caches would otherwise skip the rule on a second call.
    jitted = jax.jit(lambda *a: fn(*a, **kwargs))
    mesh = jax.sharding.AbstractMesh((1,), ("_cross_compile",), abstract_device=H200)
    with _capture_triton_ir() as captured, jax.sharding.use_abstract_mesh(mesh):
        jitted.trace(*args).lower(lowering_platforms=("cuda",))
    if not captured:
        raise ValueError(f"{getattr(fn, '__name__', fn)!r} contains no Pallas GPU kernel (pallas_call) to compile")
    return captured


def compile_triton_kernels(fn, *args, **kwargs) -> list[TritonKernelStats]:
    """Compile every Pallas GPU kernel of ``jax.jit(fn)(*args, **kwargs)`` for an H200 (sm_90a) and report on it.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct``s; ``kwargs`` are static. Each pallas_call's Triton IR is
    compiled by the ``triton`` package with the call's own num_warps / num_stages (Pallas' defaults, 4 and 3, when
    unset); shared memory is Triton's ``metadata.shared``, registers and spills come from ``ptxas -v``. Returns one
    entry per pallas_call, in program order (a ``jax.grad`` function lists the forward kernels, then the backward).
    Raises RuntimeError when Triton cannot compile a kernel, ValueError when ``fn`` has no Pallas GPU kernel.
    """
    kernels = triton_ir(fn, *args, **kwargs)
    with tempfile.TemporaryDirectory(prefix="cross_compile_") as workdir:
        return [_compile_one(k, workdir) for k in kernels]


def format_stats_table(rows: list[tuple[str, TritonKernelStats]]) -> str:
    """A Markdown table of (config, stats) rows: kernel, config, shared memory, registers, spills, grid."""
    lines = [
        "| kernel | config | warps/stages | shared B | fits H200 | registers | spill B | programs |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for config, s in rows:
        lines.append(
            f"| {s.name} | {config} | {s.num_warps}/{s.num_stages} | {s.shared_bytes:,} | "
            f"{'yes' if s.fits_h200 else 'NO'} | {s.registers} | {s.spill_bytes} | {s.programs:,} |"
        )
    return "\n".join(lines)


@functools.cache
def _tpu_device(device_kind: str) -> jax.sharding.AbstractDevice:
    return jax.sharding.AbstractDevice(
        device_kind=device_kind, num_cores=_TPU_NUM_CORES.get(device_kind, 1), platform="tpu"
    )


def tpu_abstract_mesh(
    mesh_axes: dict[str, int], device_kind: str = "TPU v5p", axis_types=jax.sharding.AxisType.Auto
) -> jax.sharding.AbstractMesh:
    """An abstract mesh of ``device_kind`` TPU chips with the given ``{axis name: size}`` (no devices needed)."""
    if not mesh_axes or any(not isinstance(n, int) or n < 1 for n in mesh_axes.values()):
        raise ValueError(f"mesh_axes must map axis names to positive sizes, got {mesh_axes!r}")
    names = tuple(mesh_axes)
    if not isinstance(axis_types, tuple):
        axis_types = (axis_types,) * len(names)
    return jax.sharding.AbstractMesh(
        tuple(mesh_axes.values()), names, axis_types, abstract_device=_tpu_device(device_kind)
    )


def lower_for_tpu(
    fn,
    *args,
    mesh_axes: dict[str, int] | None = None,
    in_specs=None,
    device_kind: str = "TPU v5p",
    axis_types=jax.sharding.AxisType.Auto,
) -> str:
    """Lower ``jax.jit(fn)(*args)`` for TPU (Mosaic for every Pallas TPU kernel) and return the StableHLO text.

    Without ``mesh_axes`` the program is lowered for one ``device_kind`` chip. With ``mesh_axes`` (``{axis name:
    size}``) it is lowered under ``jax.sharding.use_abstract_mesh`` of an abstract ``device_kind`` mesh of that
    shape, and each argument carries a ``NamedSharding`` of that mesh: ``in_specs`` is a pytree prefix of ``args``
    of ``jax.sharding.PartitionSpec``s (default: replicated). Mosaic's checks then run as on a pod: for instance
    a Pallas TPU call on sharded operands outside ``jax.shard_map`` fails with "Mosaic kernels cannot be
    automatically partitioned", as it would there. ``fn`` may itself refer to the mesh (shard_map, sharding
    constraints) through ``jax.sharding.get_abstract_mesh()``.
    """
    if mesh_axes is None:
        if in_specs is not None:
            raise ValueError("lower_for_tpu: in_specs needs mesh_axes (the mesh the specs refer to)")
        mesh_axes = {"_cross_compile": 1}
    mesh = tpu_abstract_mesh(mesh_axes, device_kind, axis_types)
    specs = jax.sharding.PartitionSpec() if in_specs is None else in_specs
    if isinstance(specs, jax.sharding.PartitionSpec):
        specs = (specs,) * len(args)

    def shard(spec, x):
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    sharded_args = jax.tree.map(
        lambda spec, sub: jax.tree.map(functools.partial(shard, spec), sub),
        tuple(specs),
        args,
        is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec),
    )
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*sharded_args).lower(lowering_platforms=("tpu",)).as_text()
