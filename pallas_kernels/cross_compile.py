"""Compile Pallas kernels for accelerators this machine does not have: an H200 (Triton) and TPU pods (Mosaic, XLA:TPU).

JAX cross-lowers a program for another platform (``.lower(lowering_platforms=...)``), and its Pallas lowerings
consult the *abstract device* of the current abstract mesh (``jax.sharding.use_abstract_mesh``) instead of the local
device when one is set. This module uses that to prove, on a CPU-only machine, that kernels fit the hardware:

* :func:`compile_triton_kernels` traces ``jax.jit(fn)`` as if on an NVIDIA H200, captures the Triton IR of every
  ``pallas_call`` in the program (forward and, for a ``jax.grad`` of a ``custom_vjp``, backward), and compiles each
  with the ``triton`` package for ``sm_90a`` using the kernel's own ``num_warps`` / ``num_stages``. Shared memory
  comes from Triton's metadata, registers and spills from the ``ptxas -v`` log of Triton's own PTX → cubin step
  (ptxas is rerun with Triton's flags for a kernel that came from Triton's cache). XLA compiles the same IR with
  the Triton bundled in jaxlib, so the figures are those of the ``triton`` package's version of the compiler: a
  kernel that exceeds the shared-memory limit here is over budget on the device too, modulo version drift.
* :func:`compile_for_tpu` compiles ``jax.jit(fn)`` with the real TPU compiler: the ``libtpu`` wheel (the version
  ``jax[tpu]`` pins) gives compile-only devices of any TPU topology on a CPU-only machine
  (``jax.experimental.topologies.get_topology_desc``), so XLA:TPU and Mosaic run all their passes (layout inference,
  VMEM allocation, the checks that reject a kernel) for a chip or a whole slice, the arguments sharded over a mesh
  of its chips. It reports the per-chip memory of the compiled program, each Mosaic kernel's scoped VMEM and the
  compile time (:class:`TpuCompiled`).

Private API used (tried with jax 0.12.0.x and triton 3.7.x; other versions get a warning, a missing piece a
RuntimeError that names it):
  ``jax._src.pallas.core._backend_lowering_rules``: the registry of per-backend ``pallas_call`` lowering rules;
  ``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module``: the jaxpr → Triton MLIR translation
  (both wrapped only for the duration of one capture, see :func:`_capture_triton_ir`);
  ``triton.knobs.nvidia.dump_ptxas_log`` (Triton prints its ptxas -v log) and Triton's ptxas flags (_PTXAS_FLAGS);
  for TPU (tried with libtpu 0.0.50.x, the version jax 0.12.0.x pins): the environment libtpu reads
  (``TPU_SKIP_MDS_QUERY``: no metadata server to ask; ``ALLOW_MULTIPLE_LIBTPU_LOAD``: every process that compiles
  for TPU loads libtpu, e.g. two pytest workers at once, and without this only the first may hold
  /tmp/libtpu_lockfile), and the compiled HLO's ``backend_config`` field ``used_scoped_memory_configs`` (memory
  space 1 = VMEM) read as each kernel's VMEM.

libtpu must be importable by the process that compiles. `make libtpu` installs it in .venv/libtpu, a folder of its
own, rather than in the venv's site-packages: a JAX process that can import libtpu initialises it at start, which on
a machine without a TPU prints libtpu's errors. Put that folder on ``PYTHONPATH`` for a run of your own (the tests do
it for themselves: tests/conftest.py, fixture ``libtpu``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import re
import subprocess
import tempfile
import threading
import time
import warnings

import jax
import numpy as np

__all__ = [
    "H200",
    "H200_SHARED_MEMORY_BYTES",
    "TPU_HBM_BYTES",
    "TpuCompiled",
    "TpuKernel",
    "TritonKernelIR",
    "TritonKernelStats",
    "compile_for_tpu",
    "compile_triton_kernels",
    "format_stats_table",
    "format_tpu_table",
    "tpu_devices",
    "tpu_mesh",
    "triton_ir",
]

# Largest dynamic shared memory one thread block may opt into on sm_90 (227 KiB; cudaDevAttrMaxSharedMemoryPerBlockOptin).
H200_SHARED_MEMORY_BYTES = 232_448
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
_SM90A_TARGET = ("cuda", 90, 32)  # (backend, compute capability, warp size) of triton's GPUTarget
_TRIED_VERSIONS = {"jax": "0.12.0.", "triton": "3.7.", "libtpu": "0.0.50."}  # version prefixes
# Pallas' own defaults when CompilerParams leaves them unset (jax/_src/pallas/triton/pallas_call_registration.py).
_PALLAS_DEFAULT_NUM_WARPS, _PALLAS_DEFAULT_NUM_STAGES = 4, 3
GiB = 1 << 30
# HBM per chip by libtpu's device_kind (Cloud TPU system architecture pages): v4 32 GiB, v5e 16 GiB, v5p 95 GiB,
# v6e (Trillium) 32 GiB. The compile-only devices do not report it.
TPU_HBM_BYTES = {"TPU v4": 32 * GiB, "TPU v5 lite": 16 * GiB, "TPU v5": 95 * GiB, "TPU v6 lite": 32 * GiB}

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


# Triton's own ptxas invocation for sm_90a (triton/backends/nvidia/compiler.py, make_cubin), so that a rerun on a
# cached kernel reports the registers of the very cubin Triton built.
_PTXAS_FLAGS = ("-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a")


def _ptxas_log(ptx: str, workdir: str) -> str:
    """``ptxas -v`` on ``ptx`` with Triton's flags: the log (registers, spills, stack frame)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    src = os.path.join(workdir, "kernel.ptx")
    with open(src, "w") as f:
        f.write(ptx)
    out = subprocess.run(
        [ptxas, *_PTXAS_FLAGS, src, "-o", os.path.join(workdir, "kernel.cubin")],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout + out.stderr


def _parse_ptxas_log(log: str) -> tuple[int, int, int]:
    """(registers, spill bytes = stores + loads, stack frame bytes) from a ``ptxas -v`` log of one kernel."""
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
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    src = os.path.join(workdir, f"{kernel.name}.ttir")
    with open(src, "w") as f:
        f.write(kernel.ttir)
    log = io.StringIO()
    try:
        # Triton prints its own ptxas -v log when asked: no second ptxas run unless the kernel came from its cache.
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compiler.compile(
                src,
                target=GPUTarget(*_SM90A_TARGET),
                options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages),
            )
    except Exception as e:
        raise RuntimeError(f"Triton failed to compile pallas_call {kernel.name!r} for sm_90a: {e}") from e
    ptxas_log = log.getvalue()
    if "Used " not in ptxas_log:
        ptxas_log = _ptxas_log(compiled.asm["ptx"], workdir)
    registers, spill_bytes, stack_bytes = _parse_ptxas_log(ptxas_log)
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


def _sharded_args(mesh, args, in_specs):
    """``args`` as ShapeDtypeStructs carrying a NamedSharding of ``mesh`` from ``in_specs``, a pytree prefix of
    ``args`` of PartitionSpecs (None: replicated)."""
    specs = jax.sharding.PartitionSpec() if in_specs is None else in_specs
    if isinstance(specs, jax.sharding.PartitionSpec):
        specs = (specs,) * len(args)

    def shard(spec, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    return jax.tree.map(
        lambda spec, sub: jax.tree.map(functools.partial(shard, spec), sub),
        tuple(specs),
        args,
        is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec),
    )


# ------------------------------------------------------------------ the real TPU compiler (libtpu, compile-only)


@dataclasses.dataclass(frozen=True)
class TpuKernel:
    """One Mosaic kernel (``pallas_call``) of a program compiled for TPU: its name and the scoped VMEM the compiler
    reserved for it while it runs (its pipeline buffers and scratch), in bytes. Operands XLA itself placed in VMEM
    for the call are not in this figure (a kernel whose operands all sit there can report 0, as does a call the
    compiler reports no scoped memory for)."""

    name: str
    vmem_bytes: int


@dataclasses.dataclass(frozen=True)
class TpuCompiled:
    """What XLA:TPU says about one program compiled for ``chips`` chips of ``topology`` (figures per chip).

    argument / output / alias / temp / code bytes: ``compiled.memory_analysis()`` of one chip's SPMD partition
    (alias: outputs written into donated arguments); kernels: every Mosaic call, in program order; compile_seconds:
    wall time of ``.compile()`` alone (lowering excluded).
    """

    topology: str
    device_kind: str
    chips: int
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    kernels: tuple[TpuKernel, ...]

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs - aliased + temporaries + generated code: the HBM the program needs on one chip."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def hbm_bytes(self) -> int | None:
        return TPU_HBM_BYTES.get(self.device_kind)


def _check_libtpu() -> None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        found = version("libtpu")
    except PackageNotFoundError as e:
        raise RuntimeError(
            "compile_for_tpu needs the TPU compiler, libtpu==0.0.50.1 (the version jax[tpu] 0.12.0.x pins; it runs "
            "on a CPU-only machine): `make libtpu` installs it in .venv/libtpu; put that folder on PYTHONPATH"
        ) from e
    if not found.startswith(_TRIED_VERSIONS["libtpu"]):
        warnings.warn(
            f"pallas_kernels.cross_compile was tried with libtpu {_TRIED_VERSIONS['libtpu']}x, found {found}: "
            "the compiled HLO's VMEM fields it reads may have changed",
            stacklevel=3,
        )


@functools.cache
def tpu_devices(topology: str) -> tuple:
    """The compile-only devices of a TPU topology such as "v5e:2x4" or "v5p:2x2x2" (one per chip, megacore chips
    as one device), from libtpu without any TPU attached."""
    _check_libtpu()
    # Set before libtpu first loads in this process (here, unless something else already loaded it).
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        return tuple(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as e:  # noqa: BLE001 — libtpu raises its own runtime errors for unknown names
        raise ValueError(
            f"libtpu knows no TPU topology {topology!r} ({e}); use a name like 'v5e:2x4', 'v6e:2x2' or 'v5p:2x2x2' "
            "(generation:chips per dimension)"
        ) from e


def tpu_mesh(topology: str, mesh_axes: dict[str, int] | None = None) -> jax.sharding.Mesh:
    """A ``jax.sharding.Mesh`` of the compile-only chips of ``topology`` with ``{axis name: size}`` (its product
    must be the topology's chip count); ``None``: one chip of it, on a single axis "_cross_compile"."""
    devices = tpu_devices(topology)
    if mesh_axes is None:
        return jax.sharding.Mesh(np.array(devices[:1]), ("_cross_compile",))
    if not mesh_axes or any(not isinstance(n, int) or n < 1 for n in mesh_axes.values()):
        raise ValueError(f"mesh_axes must map axis names to positive sizes, got {mesh_axes!r}")
    if math.prod(mesh_axes.values()) != len(devices):
        raise ValueError(
            f"mesh {mesh_axes} has {math.prod(mesh_axes.values())} chips but topology {topology!r} has "
            f"{len(devices)}: make the axis sizes multiply to {len(devices)}"
        )
    return jax.sharding.Mesh(np.array(devices).reshape(tuple(mesh_axes.values())), tuple(mesh_axes))


_KERNEL_NAME = re.compile(r'op_name="[^"]*?(\w+)\)*/pallas_call')
# Splash's calls sit in its own "_splash_attention" scope, so their op_name does not end in the kernel's name; XLA
# names the instruction after it ("%splash_mha_fwd_segmented_residuals.1 = ...").
_SPLASH_NAME = re.compile(r"%\w*?(splash_mha_\w+?)_*(?:\.\d+)? =")
_USED_SCOPED = re.compile(r'"used_scoped_memory_configs":\[([^\]]*)\]')


def _mosaic_kernels(hlo: str) -> tuple[TpuKernel, ...]:
    """Each ``tpu_custom_call`` of compiled HLO text: its pallas_call name (from the op_name metadata; splash's from
    the instruction's name) and the VMEM (memory space 1) of its ``used_scoped_memory_configs``."""
    kernels = []
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        name = _SPLASH_NAME.search(line) or _KERNEL_NAME.search(line)
        used = _USED_SCOPED.search(line)
        # A call the compiler gave no scoped memory has no such field.
        configs = json.loads(f"[{used.group(1)}]") if used else []
        vmem = sum(int(c["size"]) for c in configs if str(c.get("memory_space")) == "1")
        kernels.append(TpuKernel(name=name.group(1) if name else "pallas_call", vmem_bytes=vmem))
    return tuple(kernels)


def compile_for_tpu(
    fn,
    *args,
    topology: str = "v5e:2x2",
    mesh_axes: dict[str, int] | None = None,
    in_specs=None,
    donate_argnums=(),
) -> TpuCompiled:
    """Compile ``jax.jit(fn)(*args)`` with the TPU compiler for ``topology`` and report on it (:class:`TpuCompiled`).

    ``args`` are arrays or ``jax.ShapeDtypeStruct``s. Without ``mesh_axes`` the program is compiled for one chip of
    ``topology``; with it, for every chip of the topology on a mesh of that shape (see :func:`tpu_mesh`), each
    argument carrying a ``NamedSharding`` from ``in_specs`` (a pytree prefix of ``args`` of PartitionSpecs; default
    replicated). The mesh is set (``jax.set_mesh``) while tracing and compiling, so ``fn`` reaches it through
    ``jax.sharding.get_abstract_mesh()`` (shard_map) and the kernels' ``auto`` dispatch sees a TPU. Raises what the
    compiler raises for a program it rejects (a kernel over its VMEM, a layout Mosaic cannot infer, ...).
    """
    if not jax.__version__.startswith(_TRIED_VERSIONS["jax"]):
        warnings.warn(
            f"compile_for_tpu was tried with jax {_TRIED_VERSIONS['jax']}x, found {jax.__version__}", stacklevel=2
        )
    mesh = tpu_mesh(topology, mesh_axes)
    if mesh_axes is None and in_specs is not None:
        raise ValueError("compile_for_tpu: in_specs needs mesh_axes (the mesh the specs refer to)")
    with jax.set_mesh(mesh):
        lowered = jax.jit(fn, donate_argnums=donate_argnums).trace(*_sharded_args(mesh, args, in_specs)).lower()
        start = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    return TpuCompiled(
        topology=topology,
        device_kind=mesh.devices.flat[0].device_kind,
        chips=mesh.size,
        compile_seconds=seconds,
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        temp_bytes=int(m.temp_size_in_bytes),
        code_bytes=int(m.generated_code_size_in_bytes),
        kernels=_mosaic_kernels(compiled.as_text()),
    )


def format_tpu_table(rows: list[tuple[str, TpuCompiled]]) -> str:
    """A Markdown table of (config, compiled) rows: chip, config, per-chip temporaries and peak, each kernel's
    VMEM, compile time."""
    mib = lambda n: f"{n / (1 << 20):,.1f}"  # noqa: E731
    lines = [
        "| chip(s) | config | temp MiB | peak MiB / chip | kernels: VMEM KiB | compile s |",
        "|---|---|---:|---:|---|---:|",
    ]
    for config, c in rows:
        kernels = ", ".join(f"{k.name} {k.vmem_bytes / 1024:,.0f}" for k in c.kernels) or "—"
        chips = f"{c.device_kind}" + (f" x{c.chips}" if c.chips > 1 else "")
        lines.append(
            f"| {chips} | {config} | {mib(c.temp_bytes)} | {mib(c.peak_bytes)} | {kernels} | {c.compile_seconds:.1f} |"
        )
    return "\n".join(lines)
