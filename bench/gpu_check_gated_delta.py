"""Check and benchmark the Pallas gated delta rule kernel on a GPU (one part of bench/gpu_check.sh).

    python bench/gpu_check_gated_delta.py [--mode full|quick|dry-run] [--deadline UNIX_TIME] [--out DIR]

1. Correctness of ``chunk_gated_delta_rule(..., implementation="pallas")`` with an initial state, the final state
   and q/k L2 norm (as the model calls it): the output, the final state and the gradients of q, k, v, g, beta and
   the initial state against the token-by-token ``naive_gated_delta_rule`` (fp32 inputs, as in
   tests/test_gated_delta.py), in float32 and bfloat16, at K = V = 64 and 128 and lengths that are no chunk
   multiple. The error protocol and its limits are in bench/_gpu_check.py.
2. Speed, bf16, H = 16 heads, B·T = 32K tokens per row, T = 4K to 32K, K = V = 64 and 128, forward and
   forward+backward, beside the peers measured in the same process on the same inputs (copied bit for bit):
   flash-linear-attention's Triton kernel (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, torch) and this
   package's chunked XLA path (``implementation="xla"``). fla's output is first compared with the reference, so
   its timings are known to compute the same thing; its Triton autotuning runs inside the time budget, over at
   most ``FLA_MAX_CONFIGS`` configurations per kernel (`limit_autotuning`; the report says how many it kept).
   FLOPs of the chunked algorithm per chunk of C = 64 tokens and head (every matmul of its forward):
       A = (β⊙k)·kᵀ 2C²K,  (I + A)⁻¹ C³/3,  w = A⁻¹·(β⊙k⊙eᵍ) 2C²K,  u = A⁻¹·(β⊙v) 2C²V,
       u − w·h 2CKV,  h += kᵀ·(u − w·h) 2CKV,  q·h 2CKV,  q·kᵀ 2C²K,  (q·kᵀ ⊙ M)·(u − w·h) 2C²V
   = 6C²K + 4C²V + 6CKV + C³/3. The backward counts 2x the forward (each product A·B needs dA and dB;
   recomputation is not counted as work), so forward+backward is 3x.
   Beside each row, "prologue": the WY prologue alone (W, U and the cumulative decays of every chunk, which a
   bf16 run's forward and backward each compute once), our Pallas kernel (`pallas_gpu.prologue_call`) against
   the XLA prologue it replaces (`chunk_math._prepare`), counted as A, (I + A)⁻¹, W and U: 4C²K + 2C²V + C³/3.
Rows run most important first (K = V = 128 at 8K) and are skipped with a note once the time budget is spent.
Imports jax, numpy and this checkout's pallas_kernels; torch and fla only for the peer, when installed.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _gpu_check import Budget, Report, budgeted_rows, first_line, rel_err, run_script, time_variants  # noqa: E402

from pallas_kernels.gated_delta import (  # noqa: E402
    chunk_gated_delta_rule,
    chunk_math,
    naive_gated_delta_rule,
    pallas_gpu,
)

F32, BF16 = jnp.float32, jnp.bfloat16
NAMES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
CHUNK = 64
# fla vs the reference on the same bf16 inputs: bf16 outputs and bf16 dots give ~1e-2 at most; another scale, norm or
# decay convention gives O(1).
PEER_AGREEMENT = 5e-2

CASES = {  # (B, T, H, K, V)
    "full": [(2, 300, 4, 64, 64), (1, 1000, 2, 128, 128), (1, 4100, 2, 128, 128)],
    "quick": [(2, 300, 4, 64, 64), (1, 1000, 2, 128, 128)],
    "dry-run": [(1, 50, 2, 16, 16)],
}
ROWS = {  # (D = K = V, T), most important first: the budget drops the tail
    "full": [(128, 8192), (64, 8192), (128, 32768), (64, 32768), (128, 4096), (64, 4096), (128, 16384), (64, 16384)],
    "quick": [(128, 8192), (64, 8192), (128, 32768)],
    "dry-run": [(16, 50)],  # the check case's shape: the dry run reuses its compilations
}
TOKENS = {"full": 32768, "quick": 32768, "dry-run": 50}  # B·T per row
HEADS = {"full": 16, "quick": 16, "dry-run": 2}
REPEATS = {"full": 10, "quick": 5, "dry-run": 1}
SECONDS_PER_TIMING = {"full": 2.0, "quick": 1.0, "dry-run": 1.0}


def prologue_flops(b: int, t: int, h: int, k: int, v: int, c: int = CHUNK) -> float:
    """FLOPs of the WY prologue (A, its inverse, W and U; module docstring)."""
    return b * h * math.ceil(t / c) * (4 * c * c * k + 2 * c * c * v + c**3 / 3)


def prologue_calls(args, interpret: bool) -> dict[str, Callable[[], object]]:
    """The WY prologue of a bf16 run on ``args``: our kernel and the XLA prologue, each jitted, as the rule calls
    them (q/k L2 norm, no documents)."""
    q, k, v, g, beta, _ = args
    cfg = chunk_math.RuleConfig(
        scale=q.shape[-1] ** -0.5,
        use_qk_l2norm=True,
        chunk_size=CHUNK,
        key_dim_padded=chunk_math._round_up_pow2(q.shape[-1]),
        value_dim_padded=chunk_math._round_up_pow2(v.shape[-1]),
        operand_dtype=jnp.dtype(q.dtype),
        prec=chunk_math.default_precision(q.dtype),
    )
    kernel = jax.jit(lambda *x: pallas_gpu.prologue_call(cfg, *x, None, interpret=interpret))
    xla = jax.jit(lambda *x: chunk_math._prepare(cfg, *x))
    return {"pallas": partial(kernel, q, k, v, g, beta), "xla": partial(xla, q, k, v, g, beta)}


def gdn_flops_fwd(b: int, t: int, h: int, k: int, v: int, c: int = CHUNK) -> float:
    """Forward FLOPs of the chunked gated delta rule (the matmuls listed in the module docstring)."""
    per_chunk = 6 * c * c * k + 4 * c * c * v + 6 * c * k * v + c**3 / 3
    return b * h * math.ceil(t / c) * per_chunk


def make_inputs(b, t, h, k, v, seed=0):
    """fp32 (q, k, v, g, beta, h0) and cotangents (do, dstate); g = log decay ≤ 0, beta in (0, 1)."""
    ks = jax.random.split(jax.random.key(seed), 8)
    args = (
        jax.random.normal(ks[0], (b, t, h, k)),
        jax.random.normal(ks[1], (b, t, h, k)),
        jax.random.normal(ks[2], (b, t, h, v)),
        -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h)) - 1.0),
        jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))),
        0.5 * jax.random.normal(ks[5], (b, h, k, v)),
    )
    cot = (jax.random.normal(ks[6], (b, t, h, v)), jax.random.normal(ks[7], (b, h, k, v)))
    return args, cot


def gdn(impl):
    """(q, k, v, g, beta, h0) -> (o, final_state) as the model calls it: initial state, q/k L2 norm."""
    kw = dict(output_final_state=True, use_qk_l2norm=True)
    if impl == "reference":
        return lambda q, k, v, g, beta, h0: naive_gated_delta_rule(q, k, v, g, beta, initial_state=h0, **kw)
    return lambda q, k, v, g, beta, h0: chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, chunk_size=CHUNK, implementation=impl, **kw
    )


def _fwd_and_grads(fn, args, cot):
    out, vjp = jax.vjp(fn, *args)
    return (*out, *vjp(cot))


@cache
def jitted(impl):
    """(forward, forward+gradients) of ``impl``, jitted once so checks and benchmark rows share compilations."""
    return jax.jit(gdn(impl)), jax.jit(partial(_fwd_and_grads, gdn(impl)))


def _cast(args, cot, dtype):
    """Inputs in ``dtype`` except the fp32 initial state (the API keeps states in fp32); cotangents to match."""
    return tuple(a.astype(dtype) for a in args[:5]) + (args[5],), (cot[0].astype(dtype), cot[1])


# ---------------------------------------------------------------------------------------------- the fla peer
def load_fla(report: Report, on_gpu: bool):
    """flash-linear-attention's chunk_gated_delta_rule, or None with a note saying why it is skipped."""
    if not on_gpu:
        report.note("fla skipped: flash-linear-attention runs on a CUDA GPU only (this run's backend is cpu)")
        return None
    try:
        from importlib.metadata import version

        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        report.info.update(torch=torch.__version__, fla=version("fla-core"))
        kept, total = limit_autotuning(FLA_MAX_CONFIGS)
        if total:
            report.note(
                f"fla autotuned over at most {FLA_MAX_CONFIGS} configurations per kernel ({kept} of {total} in all, "
                "evenly spaced in its own lists) so that its tuning fits the time budget; its best configuration "
                "may be among those left out"
            )
        return fla_gdn
    except Exception as e:  # not installed (gpu_check.sh --no-install) or unusable: no ratio, say why
        report.note(f"fla skipped: {first_line(e)} (bench/gpu_check.sh installs fla-core with torch)")
        return None


FLA_MAX_CONFIGS = 4  # configurations fla's Triton autotuner may try per kernel (compiling each costs seconds)


def limit_autotuning(max_configs: int) -> tuple[int, int]:
    """Cut every Triton autotuner in fla's loaded modules to at most ``max_configs`` of its configurations, evenly
    spaced in its list → (configurations kept, configurations there were)."""
    import sys

    from triton.runtime.autotuner import Autotuner

    kept = total = 0
    seen = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in vars(module).values():
            for _ in range(4):  # an autotuner may sit under triton.heuristics wrappers (their .fn)
                if isinstance(obj, Autotuner) or obj is None:
                    break
                obj = getattr(obj, "fn", None)
            if not isinstance(obj, Autotuner) or id(obj) in seen:
                continue
            seen.add(id(obj))
            n = len(obj.configs)
            if n > max_configs:
                obj.configs = [obj.configs[round(i * (n - 1) / (max_configs - 1))] for i in range(max_configs)]
            kept, total = kept + len(obj.configs), total + n
    return kept, total


def to_torch(x, device="cuda"):
    """A JAX array as a torch tensor with the same bits (bf16 travels as uint16: torch.from_numpy has no bf16)."""
    import torch

    a = np.array(x)  # a writable, contiguous copy: torch.from_numpy shares its buffer
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


@dataclass
class TorchPeer:
    """The torch peer on one input set: ``fwd`` and ``fwd_bwd`` return once the device is done (for timing),
    ``values`` returns (o, final_state), ``leaves`` are the inputs whose ``.grad`` fwd_bwd fills."""

    fwd: Callable[[], None]
    fwd_bwd: Callable[[], None]
    values: Callable[[], tuple]
    leaves: list


def torch_peer(fla_gdn, args, cot, device="cuda") -> TorchPeer:
    """Wrap ``fla_gdn`` (fla's signature: q, k, v, g, beta [B,T,H,·], initial_state, ...) on copies of JAX inputs."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    leaves = [to_torch(a, device).requires_grad_(True) for a in args]
    do, dstate = (to_torch(c, device) for c in cot)
    call = partial(fla_gdn, *leaves[:5], initial_state=leaves[5], output_final_state=True, use_qk_l2norm_in_kernel=True)

    def fwd():
        with torch.no_grad():
            call()
        sync()

    def fwd_bwd():
        for leaf in leaves:
            leaf.grad = None
        o, state = call()
        torch.autograd.backward([o, state], [do, dstate])
        sync()

    def values():
        with torch.no_grad():
            return call()

    return TorchPeer(fwd, fwd_bwd, values, leaves)


def check_fla_agreement(report: Report, fla_gdn, case, device="cuda") -> bool:
    """fla's output and final state on bf16 inputs (the benchmark's dtype) vs the fp32 reference on the same rounded
    inputs: the peer must compute the same function for its timings to mean anything."""
    args, cot = _cast(*make_inputs(*case, seed=1), BF16)
    want = jax.jit(gdn("reference"))(*(a.astype(F32) for a in args))
    got = torch_peer(fla_gdn, args, cot, device).values()
    errs = [rel_err(g.float().cpu().numpy(), w) for g, w in zip(got, want)]
    verdict = "agrees" if max(errs) <= PEER_AGREEMENT else "DISAGREES (its timings compare different math)"
    report.note(f"fla {verdict} with the reference at (B,T,H,K,V)={case}, bf16: o {errs[0]:.1e}, state {errs[1]:.1e}")
    return max(errs) <= PEER_AGREEMENT


# ---------------------------------------------------------------------------------------------- steps
def run_checks(report: Report, budget: Budget, cases) -> None:
    reference, pallas = jitted("reference")[1], jitted("pallas")[1]
    for seed, (b, t, h, k, v) in enumerate(cases):
        case = f"B={b} T={t} H={h} K={k} V={v}"
        args, cot = make_inputs(b, t, h, k, v, seed=seed)
        oracle = None
        for dtype in (F32, BF16):
            name = jnp.dtype(dtype).name
            if not budget.allows(5):
                report.check_skipped(case, name, f"time budget spent ({budget.left():.0f} s left)")
                continue
            x, c = _cast(args, cot, dtype)
            try:
                oracle = reference(args, cot) if oracle is None else oracle  # fp32 inputs, as the tests do
                got = pallas(x, c)
                report.check(case, name, NAMES, got, oracle, reference(x, c) if dtype == BF16 else None)
            except Exception as e:  # lowering / Triton compile / runtime error: a failed check, the others go on
                report.check_error(case, name, e)


def run_bench(report: Report, budget: Budget, mode: str, fla_gdn, on_gpu: bool) -> None:
    heads = HEADS[mode]
    for d, t in budgeted_rows(report, budget, ROWS[mode], min_row_s=0 if mode == "dry-run" else 10):
        b = max(1, TOKENS[mode] // t)
        args, cot = _cast(*make_inputs(b, t, heads, d, d, seed=2), BF16)
        calls = {"fwd": {}, "fwd+bwd": {}}
        for impl in ("pallas", "xla"):
            fwd, fwd_bwd = jitted(impl)
            calls["fwd"][impl], calls["fwd+bwd"][impl] = partial(fwd, *args), partial(fwd_bwd, args, cot)
        if fla_gdn is not None:
            try:
                peer = torch_peer(fla_gdn, args, cot)
                calls["fwd"]["fla"], calls["fwd+bwd"]["fla"] = peer.fwd, peer.fwd_bwd
            except Exception as e:  # e.g. out of memory copying the inputs: this row has no fla column
                report.note(f"fla skipped at D={d} T={t}: {first_line(e)}")
        calls["prologue"] = prologue_calls(args, interpret=not on_gpu)
        flops_fwd = gdn_flops_fwd(b, t, heads, d, d)
        flops = {"fwd": flops_fwd, "fwd+bwd": 3 * flops_fwd, "prologue": prologue_flops(b, t, heads, d, d)}
        for direction in ("fwd", "fwd+bwd", "prologue"):
            row = dict(D=d, T=t, B=b, H=heads, direction=direction)
            time_variants(
                report,
                calls[direction],
                flops=flops[direction],
                row=row,
                repeats=REPEATS[mode],
                seconds=SECONDS_PER_TIMING[mode],
            )


def steps(report: Report, budget: Budget, mode: str, on_gpu: bool) -> None:
    report.info["chunk"] = CHUNK
    run_checks(report, budget, CASES[mode])
    fla_gdn = load_fla(report, on_gpu)
    if fla_gdn is not None:
        try:
            check_fla_agreement(report, fla_gdn, CASES[mode][0])
        except Exception as e:  # the peer failing is reported, never a failure of our kernel
            report.note(f"fla skipped: its agreement check raised {first_line(e)}")
            fla_gdn = None
    run_bench(report, budget, mode, fla_gdn, on_gpu)


def main(argv=None) -> int:
    return run_script("gated_delta", __doc__.splitlines()[0], argv, steps)


if __name__ == "__main__":
    sys.exit(main())
