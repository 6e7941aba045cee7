"""NVIDIA cuDNN's fused attention behind ``flash_attention`` (``implementation="cudnn"``; ``auto`` on a GPU).

cuDNN's flash attention, reached through ``jax.nn.dot_product_attention(..., implementation="cudnn")``, is
maintained by NVIDIA and tuned per architecture (on Hopper it uses the bulk tensor copies and warp-specialised
pipelines that our Triton kernel does not). Its layout is ours ([B, T, H, D], GQA with query head h reading KV
head h // G), so the adapter only maps the mask. Ours is

  visible(i, j) = j ≤ i + q_offset   (causal),   every j (not causal)

and cuDNN's causal mask is the top-left one (j ≤ i), so a call is covered when either
  * every key is visible to every query: not causal, or causal with q_offset ≥ S − 1 (a decode step, the last
    query of a chunk) → cuDNN without a mask;
  * or T == S and q_offset == 0 (self-attention over one sequence) → cuDNN's causal mask, whose diagonal is ours.

What cuDNN does not cover (:func:`cudnn_unsupported` names it; ``auto`` then takes our Triton kernel):
  * float32 inputs: cuDNN's fused attention takes bfloat16 / float16;
  * head dims that are not a multiple of 8, or above 256 (above 128 before Hopper);
  * packed documents (segment ids): cuDNN's packed layout takes each row's documents as contiguous runs given by
    offsets, where our ids may be any values in any order (and ``kv_segment_ids`` of their own can leave a query
    with no visible key, which cuDNN's softmax does not allow);
  * any other causal offset (T ≠ S with 0 < q_offset < S − 1: chunked prefill against a cache);
  * odd lengths T or S: JAX's cuDNN path refuses them once differentiated (it always hands cuDNN a bias operand,
    and the biased backward needs even lengths), and the dispatch cannot know whether a call will be;
  * a GPU without a cuDNN that JAX can use (cuDNN < 8.9, compute capability < 8.0, or no CUDA runtime).

Private API (this module is its one user; tried with jax 0.11.2 and 0.12.0.1): the runtime probes of
``jax._src.cudnn.fused_attention_stablehlo``, ``check_cudnn_version``, ``check_compute_capability`` and
``is_cuda_compute_capability_equal``, which ask the local GPU. :func:`assume_cuda_runtime` answers them while a
program is traced for a GPU this machine does not have (with ``dispatch.tracing_for("gpu")``, as the CPU tests
do); on a GPU they answer for themselves.
"""

from __future__ import annotations

import contextlib
import importlib

import jax
import jax.numpy as jnp

HALF_DTYPES = (jnp.bfloat16, jnp.float16)
MIN_CUDNN_VERSION = 8904  # cuDNN 8.9.4: the first with the flash attention JAX lowers to
MIN_COMPUTE_CAPABILITY = "8.0"  # Ampere: cuDNN's flash attention needs it
_PROBES = ("check_cudnn_version", "check_compute_capability", "is_cuda_compute_capability_equal")


def _fused_attention_module():
    """jax's private cuDNN attention module, or a RuntimeError naming what is missing."""
    try:
        module = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
    except ImportError as e:
        raise RuntimeError(f"jax {jax.__version__} has no jax._src.cudnn.fused_attention_stablehlo ({e})") from e
    missing = [name for name in _PROBES if not hasattr(module, name)]
    if missing:
        raise RuntimeError(
            f"jax {jax.__version__}: jax._src.cudnn.fused_attention_stablehlo lacks {', '.join(missing)} "
            "(pallas_kernels.flash_attention.cudnn was tried with jax 0.11.2 and 0.12.0.1)"
        )
    return module


def runtime_unsupported() -> str | None:
    """Why this process cannot run cuDNN's fused attention (a sentence), or None when it can."""
    try:
        probes = _fused_attention_module()
        version = int(probes.check_cudnn_version())
        capable = bool(probes.check_compute_capability(MIN_COMPUTE_CAPABILITY))
    except Exception as e:  # no CUDA runtime (a CPU, or tracing for a GPU without one): not covered, not an error
        return f"no cuDNN runtime ({type(e).__name__}: {str(e).strip()[:120]})"
    if version < MIN_CUDNN_VERSION:
        return f"cuDNN {version} is older than {MIN_CUDNN_VERSION} (update cuDNN, or use implementation='pallas')"
    if not capable:
        return f"the GPU's compute capability is below {MIN_COMPUTE_CAPABILITY} (use implementation='pallas')"
    return None


def _head_dim_limit() -> int:
    probes = _fused_attention_module()
    try:
        return 256 if probes.check_compute_capability("9.0") else 128
    except Exception:  # no runtime: runtime_unsupported reports it; the shape rule is Hopper's
        return 256


def cudnn_mask(causal: bool, q_offset: int, t: int, s: int) -> str | None:
    """cuDNN's mask for our visibility rule ("none" or "causal"), or None when cuDNN has no equal one."""
    if not causal or q_offset >= s - 1:
        return "none"
    if t == s and q_offset == 0:
        return "causal"
    return None


def cudnn_unsupported(q, k, *, causal: bool, q_offset: int, segments_given: bool) -> str | None:
    """Why cuDNN cannot compute this call (a sentence naming the fix), or None when it can."""
    t, s, d = q.shape[1], k.shape[1], q.shape[-1]
    if q.dtype not in HALF_DTYPES:
        return f"cuDNN's fused attention takes bfloat16/float16, not {q.dtype} (use implementation='pallas')"
    if segments_given:
        return "packed documents (segment ids) are not mapped onto cuDNN's offsets (use implementation='pallas')"
    if cudnn_mask(causal, q_offset, t, s) is None:
        return (
            f"cuDNN's causal mask is top-left: it equals ours only for T == S with q_offset 0 or q_offset >= S - 1 "
            f"(got T={t}, S={s}, q_offset={q_offset}; use implementation='pallas')"
        )
    if t % 2 or s % 2:
        return (
            f"lengths T={t}, S={s}: JAX's cuDNN backward needs even lengths (pad them, or use implementation='pallas')"
        )
    limit = _head_dim_limit()
    if d % 8 or d > limit:
        return f"head dim {d} is not a multiple of 8 at most {limit} (use implementation='pallas')"
    return runtime_unsupported()


def flash_attention_cudnn(q, k, v, *, causal: bool, scale: float, q_offset: int):
    """cuDNN's fused attention on [B, T, Hq, D] / [B, S, Hkv, D] inputs (checked by the caller, see
    :func:`cudnn_unsupported`). Returns [B, T, Hq, D] in q.dtype; differentiable (cuDNN's own backward)."""
    mask = cudnn_mask(causal, q_offset, q.shape[1], k.shape[1])
    if mask is None:
        raise ValueError(f"cuDNN has no mask for causal={causal}, q_offset={q_offset}, T={q.shape[1]}, S={k.shape[1]}")
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=mask == "causal", implementation="cudnn")


@contextlib.contextmanager
def assume_cuda_runtime(cudnn_version: int = 91000, compute_capability: str = "9.0"):
    """Answer cuDNN's runtime probes as a GPU with this cuDNN and compute capability would (default: an H200 with
    cuDNN 9.10), for tracing and lowering a program for a GPU on a machine without one. The probes are restored on
    exit. Lowering is all this enables: the program still needs the GPU to run."""
    probes = _fused_attention_module()
    target = tuple(int(x) for x in compute_capability.split("."))

    def at_least(capability: str) -> bool:
        return target >= tuple(int(x) for x in capability.split("."))

    def equal(capability: str) -> bool:
        return target == tuple(int(x) for x in capability.split("."))

    saved = {name: getattr(probes, name) for name in _PROBES}
    probes.check_cudnn_version = lambda: cudnn_version
    probes.check_compute_capability = at_least
    probes.is_cuda_compute_capability_equal = equal
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(probes, name, fn)
