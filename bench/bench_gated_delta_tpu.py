"""The gated delta rule's Pallas TPU kernels compiled by the real TPU compiler (libtpu, compile only, no TPU needed;
`make libtpu` installs it, run with PYTHONPATH=.venv/libtpu):
grid steps, scoped VMEM and compiled memory per kernel configuration, forward + backward.

    python bench/bench_gated_delta_tpu.py                       # T = 8K, B = 1, H = 16, K = V = 128, bf16, v5e chip
    python bench/bench_gated_delta_tpu.py --chunks-per-step 8 16 --chip v6e
    python bench/bench_gated_delta_tpu.py --xla                 # and the XLA path compiled for the same chip
    python bench/bench_gated_delta_tpu.py --quick               # T = 1K, H = 2 (smoke run)

What it shows: the sequential kernels (state, dstate) run their grid steps one after another on a TensorCore, each
with a fixed cost, so their step count B·H·N/P (N chunks of 64 tokens, P chunks per step) is the figure the
``chunks_per_step`` setting exists to cut; the compiled program's temporaries and each kernel's scoped VMEM say what
the larger blocks cost. Not shown: time on a chip (none is attached). Run against another checkout of the kernels
(``PYTHONPATH=<checkout> python bench/bench_gated_delta_tpu.py``, which imports ``pallas_kernels`` from it; a
checkout without the setting reports one chunk per step) to compare before and after a change.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
if not any(Path(p, "pallas_kernels").is_dir() for p in sys.path[1:] if p):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import cross_compile  # noqa: E402
from pallas_kernels.gated_delta import chunk_gated_delta_rule, pallas_tpu  # noqa: E402

CHIPS = {"v5e": "v5e:2x4", "v6e": "v6e:2x4"}


def kernel_grids(fn, *args) -> dict[str, tuple[int, ...]]:
    """{pallas_call name: grid} of ``fn``'s jaxpr (abstract arguments)."""
    from jax.extend import core

    grids = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                grids[eqn.params["name"]] = tuple(eqn.params["grid_mapping"].grid)
            for sub in core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return grids


def value_and_grads(chunks_per_step, xla=False):
    """Forward + backward of the rule as the model calls it: our TPU kernels (``chunks_per_step`` None: the
    kernels' own setting) or, with ``xla``, the XLA path."""
    kw = {} if chunks_per_step is None else dict(chunks_per_step=chunks_per_step)

    def loss(q, k, v, g, beta, s0):
        common = dict(scale=q.shape[-1] ** -0.5, initial_state=s0, output_final_state=True, use_qk_l2norm=True)
        if xla:
            o, s = chunk_gated_delta_rule(q, k, v, g, beta, implementation="xla", **common)
        else:
            o, s = pallas_tpu.chunk_gated_delta_rule_pallas_tpu(q, k, v, g, beta, **common, **kw)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    return jax.value_and_grad(loss, argnums=range(6))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="key and value head dim")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--chip", default="v5e", choices=sorted(CHIPS))
    ap.add_argument("--chunks-per-step", type=int, nargs="+", default=None, help="default: the kernels' own")
    ap.add_argument("--xla", action="store_true", help="also compile the XLA path (implementation='xla')")
    ap.add_argument("--quick", action="store_true", help="T = 1K, H = 2")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = ap.parse_args(argv)
    if a.quick:
        a.seq, a.heads = 1024, 2
    supported = "chunks_per_step" in inspect.signature(pallas_tpu.chunk_gated_delta_rule_pallas_tpu).parameters
    settings = a.chunks_per_step or [getattr(pallas_tpu, "CHUNKS_PER_STEP", None)]
    if not supported:
        settings = [None]
    dtype = jnp.dtype(a.dtype)
    x = jax.ShapeDtypeStruct((a.batch, a.seq, a.heads, a.dim), dtype)
    gate = jax.ShapeDtypeStruct((a.batch, a.seq, a.heads), dtype)
    args = (x, x, x, gate, gate, jax.ShapeDtypeStruct((a.batch, a.heads, a.dim, a.dim), jnp.float32))
    print(f"kernels from {Path(pallas_tpu.__file__).resolve().parent}; jax {jax.__version__}")
    print(f"B={a.batch} T={a.seq} H={a.heads} K=V={a.dim} {a.dtype}, chunk 64, forward + backward, one {a.chip} chip")
    rows = []
    for p in settings + (["xla"] if a.xla else []):
        fn = value_and_grads(None, xla=True) if p == "xla" else value_and_grads(p)
        grids = kernel_grids(fn, *args)
        compiled = cross_compile.compile_for_tpu(fn, *args, topology=CHIPS[a.chip])
        vmem = {k.name: k.vmem_bytes for k in compiled.kernels}
        rows.append(
            dict(
                chunks_per_step=p if supported or p == "xla" else 1,
                grid_steps={name: math.prod(grid) for name, grid in grids.items()},
                vmem_kib={name: round(v / 1024) for name, v in vmem.items()},
                temp_mib=compiled.temp_bytes / 2**20,
                peak_mib=compiled.peak_bytes / 2**20,
                compile_s=compiled.compile_seconds,
            )
        )
    names = sorted({n for r in rows for n in r["grid_steps"]})
    print("\n| chunks per step | " + " | ".join(f"{n.removeprefix('gated_delta_')} steps" for n in names), end="")
    print(
        " | VMEM KiB ("
        + ", ".join(n.removeprefix("gated_delta_") for n in names)
        + ") | temp MiB | peak MiB | compile s |"
    )
    print("|---" * (len(names) + 5) + "|")
    for r in rows:
        steps = " | ".join(f"{r['grid_steps'][n]:,}" if n in r["grid_steps"] else "—" for n in names)
        vmem = ", ".join(str(r["vmem_kib"].get(n, "—")) for n in names)
        print(
            f"| {r['chunks_per_step']} | {steps} | {vmem} | {r['temp_mib']:.1f} | {r['peak_mib']:.1f} | {r['compile_s']:.1f} |"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
