"""Backend choice shared by every kernel: implementation names, the platform, and interpret mode.

Every op's public API takes ``implementation=`` with the same names and resolves it here, so the rule is written
once:

    "auto"        the Pallas kernel of the platform (GPU → "pallas_gpu", TPU → "pallas_tpu"), "xla" elsewhere
    "pallas"      this platform's Pallas kernel; on a CPU the GPU kernel in interpret mode (slow; for tests)
    "pallas_gpu"  the Triton kernel (interpret mode off a GPU; refused on a TPU)
    "pallas_tpu"  the Mosaic kernel (interpret mode off a TPU; refused on a GPU)
    "xla"         the blockwise / chunked pure-JAX path: every user's fallback, and the CPU's only fast path
    "reference"   the slow exact implementation the tests compare against
    "splash"      flash_attention only: Google's splash attention TPU kernel (interpret mode off a TPU; refused
                  on a GPU); the op's "auto" picks it on a TPU where it covers the call
    "cudnn"       flash_attention only: NVIDIA's cuDNN fused attention (GPU only: it has no interpret mode); the
                  op's "auto" picks it on a GPU where it covers the call

The platform is that of a concrete input array when there is one (a committed array decides where the op runs),
else the one named by :func:`tracing_for` (lowering for another machine: ``jit(f).trace(...).lower(
lowering_platforms=...)``), else that of the abstract mesh's device when tracing for another machine
(``jax.sharding.use_abstract_mesh``, as pallas_kernels.cross_compile does), else JAX's default backend (inside
``jit`` inputs are tracers without devices).
"""

from __future__ import annotations

import contextlib
import logging

import jax

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_gpu", "pallas_tpu", "reference")
# Names only some ops have, beyond IMPLEMENTATIONS.
_OP_EXTRAS = {"flash_attention": ("splash", "cudnn")}
BACKENDS = ("xla", "reference", "pallas_gpu", "pallas_tpu", "splash", "cudnn")
_NATIVE_PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu", "splash": "tpu", "cudnn": "gpu"}
_NO_INTERPRET = ("cudnn",)  # library kernels that run on their own platform only

_log = logging.getLogger(__name__)
_warned: set[str] = set()
_target_platform: list[str] = []  # the innermost tracing_for() platform last


@contextlib.contextmanager
def tracing_for(platform: str):
    """Resolve ``auto`` and ``pallas`` as on ``platform`` ("gpu" or "tpu") for what is traced inside, whatever
    this machine has: for ``jax.jit(f).trace(...)`` followed by ``.lower(lowering_platforms=...)`` of a program
    for another machine. Unlike ``use_abstract_mesh``, the traced program keeps no abstract mesh, so it may hold
    primitives that lower only with devices (cuDNN's fused attention)."""
    if platform not in ("gpu", "tpu"):
        raise ValueError(f"tracing_for: platform must be 'gpu' or 'tpu', got {platform!r}")
    _target_platform.append(platform)
    try:
        yield
    finally:
        _target_platform.pop()


# The jax versions whose Pallas-Triton lowering and private APIs the GPU kernels were tried with (setup.py pins them).
TRIED_JAX = "jax>=0.11.2,<0.12.1"


def pallas_triton():
    """``jax.experimental.pallas.triton``, or an ImportError in one line naming the fix: the Pallas-Triton lowering
    is deprecated in jax 0.12 and will leave a later jax, which would otherwise fail deep inside a kernel import."""
    try:
        from jax.experimental.pallas import triton
    except ImportError as e:
        raise ImportError(
            f"pallas_kernels: jax {jax.__version__} has no Pallas-Triton lowering ({e}); the GPU kernels need "
            f"{TRIED_JAX} (pip install '{TRIED_JAX.replace('jax', 'jax[cuda12]', 1)}'), or use "
            "implementation='cudnn' / 'xla'"
        ) from None
    return triton


def platform_of(x=None) -> str:
    """The platform ``x`` lives on ("cpu", "gpu", "tpu"); for tracers and ``None`` the one :func:`tracing_for`
    names, else that of the abstract device of the current abstract mesh when it names one (tracing for another
    machine, as under ``jax.sharding.use_abstract_mesh``), else the default backend."""
    if x is not None:
        try:
            return next(iter(x.devices())).platform
        except (AttributeError, TypeError, StopIteration, jax.errors.ConcretizationTypeError):
            pass
    if _target_platform:
        return _target_platform[-1]
    abstract_device = jax.sharding.get_abstract_mesh().abstract_device
    if abstract_device is not None:
        return "gpu" if abstract_device.platform in ("cuda", "rocm") else abstract_device.platform
    return jax.default_backend()


def implementations(op: str) -> tuple[str, ...]:
    """The ``implementation=`` names ``op`` accepts."""
    return IMPLEMENTATIONS + _OP_EXTRAS.get(op, ())


def check_implementation(op: str, implementation: str) -> None:
    """Raise a ValueError naming the valid choices when ``implementation`` is not one of them."""
    if implementation not in implementations(op):
        raise ValueError(f"{op}: unknown implementation {implementation!r}; valid: {', '.join(implementations(op))}")


def resolve(op: str, implementation: str, platform: str | None = None) -> tuple[str, bool]:
    """Map a user's ``implementation`` to (backend, interpret) for ``op`` on ``platform``.

    Returns one of ``BACKENDS`` and whether a Pallas kernel must run in interpret mode (no matching accelerator).
    Raises ValueError for an unknown name, for a Pallas kernel asked to run on the other accelerator (it would
    neither compile there nor be worth interpreting), or for a library kernel off its platform (it has no
    interpret mode).
    """
    check_implementation(op, implementation)
    platform = platform or jax.default_backend()
    if implementation == "auto":
        return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "xla"), False
    if implementation == "pallas":
        implementation = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
    if implementation in ("xla", "reference"):
        return implementation, False
    native = _NATIVE_PLATFORM[implementation]
    if platform == native:
        return implementation, False
    if implementation in _NO_INTERPRET:
        raise ValueError(
            f"{op}: implementation={implementation!r} runs on a {native} only (this call runs on a {platform}); "
            "use 'auto' or 'xla'"
        )
    if platform in ("gpu", "tpu"):
        raise ValueError(
            f"{op}: implementation={implementation!r} cannot run on a {platform}; "
            "use 'pallas' or 'auto' to pick this platform's kernel, or 'xla'"
        )
    if op not in _warned:
        _warned.add(op)
        _log.warning(
            "%s: implementation=%r on %s runs the Pallas kernel in interpret mode (correct but slow; meant for "
            "tests). Use implementation='xla' for speed.",
            op,
            implementation,
            platform,
        )
    return implementation, True
