#!/usr/bin/env bash
# One prepared GPU check (DESIGN.md §5, issue 4): compile both Pallas kernels, check them against the references,
# then benchmark them beside the XLA paths. Needs jax >= 0.11.2 with a GPU backend; no network, no hydrahead_jax.
# Usage: bash bench/gpu_check.sh [--quick]   (--quick: tiny shapes in interpret mode, runs on a CPU too)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import jax; print("jax", jax.__version__, "devices:", jax.devices())'
status=0
"$PY" bench/gpu_check_flash_attention.py "$@" || status=1
"$PY" bench/gpu_check_gated_delta.py "$@" || status=1
exit $status
