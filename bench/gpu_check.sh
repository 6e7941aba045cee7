#!/usr/bin/env bash
# GPU check of the Pallas kernels on a fresh NVIDIA machine (made for one H200): installs what it needs, checks the
# values and gradients of flash_attention and chunk_gated_delta_rule (implementation="pallas") against the pure-JAX
# references, then prints TFLOP/s and ratios against cuDNN attention, XLA and flash-linear-attention (fla-core)
# measured in the same run; then end to end: the tiny recipe's three stages (and, in the full run, the reproduction
# teacher's conversion) trained on the GPU with the Pallas kernels and cuDNN attention, each stage's per-step losses
# checked against the same steps on the CPU's XLA path, with tokens/s and MFU per stage. Needs only this checkout and
# the package registry (PyPI): uv builds the venv with its own Python 3.12 when the machine has none. A machine
# without the registry runs it with --no-install on its own JAX (with the wheels of --fetch-wheels carried along).
#
#   bash bench/gpu_check.sh                       # full run, at most 9.5 minutes (4 of them end to end)
#   bash bench/gpu_check.sh --quick               # fewer cases, rows and models, at most 5 minutes
#   bash bench/gpu_check.sh --dry-run             # on a CPU: interpret mode, tiny shapes, no install, peers skipped
#   bash bench/gpu_check.sh --print-install-plan  # what would be installed and how; changes nothing
#   make gpu-check                                # the full run
#
# Options:
#   --cuda 12|13        CUDA wheels to install (default: from the driver's CUDA version that nvidia-smi reports, and
#                       a stop naming this option when nvidia-smi cannot tell;
#                       13: jax[cuda13] + torch 2.13, which share one CUDA 13 stack; 12: jax[cuda12] + torch 2.10,
#                       the newest torch on PyPI built for CUDA 12)
#   --no-install        use $PYTHON (default python3) as it is; peers that are not importable are skipped, except
#                       what the wheels in .venv-gpu/wheels (--fetch-wheels) give: fla, and the training pipeline's
#                       grain and ml-collections, which a GPU machine's own Python may lack
#   --fetch-wheels      keep those wheels in .venv-gpu/wheels (for Python 3.12) for a machine without the registry
#   --budget SECONDS    wall-clock budget of the whole run including the install (default 570, --quick 300;
#                       --dry-run 600, a limit for a loaded CI box: it takes about 2 minutes on an idle 2-core CPU);
#                       the end-to-end part is given the last 240 s (--quick 120, --dry-run 300) and the kernels
#                       share the rest; what is left when it is spent is skipped with a printed note
#   --out DIR           results folder (default $OUT if set, else bench/results/gpu)
# Environment: PYTHON (the interpreter, or a version such as 3.12, uv builds the venv from; default 3.12, found or
#   downloaded by uv), GPU_CHECK_DIR (default .venv-gpu: the venv env/, reused while the pinned requirements are
#   unchanged, uv itself when it is not on PATH, uv's download cache and JAX's compilation cache).
# Output: DIR/gpu_check.md (paste into bench/RESULTS.md), DIR/gpu_check.json, and per part <part>.md/.json
#   (flash_attention, gated_delta, end_to_end): 8 files.
# Exit status: 0 all checks passed; 1 a check failed or a script crashed (the first line of the summary says
#   which); 2 nothing failed but checks were skipped for time; 64 bad usage; 69 the environment cannot be set up.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
START=$(date +%s)

# Pinned top-level versions (the resolver picks the CUDA libraries they need; both sets were resolved on PyPI).
JAX_VERSION=0.12.0.1
FLA_VERSION=0.6.0
TORCH_FOR_CUDA13=2.13.0
TORCH_FOR_CUDA12=2.10.0
UV_VERSION=0.13.8

mode=full dry=0 cuda="" install=1 plan_only=0 fetch_wheels=0 budget="" out="${OUT:-$ROOT/bench/results/gpu}"
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "gpu_check: $1" >&2; exit "${2:-69}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) mode=quick ;;
    --dry-run) dry=1 ;;
    --no-install) install=0 ;;
    --print-install-plan) plan_only=1 ;;
    --fetch-wheels) fetch_wheels=1 ;;
    --cuda) [ $# -ge 2 ] || die "--cuda needs 12 or 13" 64; cuda=$2; shift ;;
    --cuda=*) cuda=${1#*=} ;;
    --budget) [ $# -ge 2 ] || die "--budget needs a number of seconds" 64; budget=$2; shift ;;
    --budget=*) budget=${1#*=} ;;
    --out) [ $# -ge 2 ] || die "--out needs a folder" 64; out=$2; shift ;;
    --out=*) out=${1#*=} ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument '$1' (see the usage above)" 64 ;;
  esac
  shift
done
[ "$dry" = 1 ] && mode=dry-run install=0  # whatever else was asked: --dry-run never installs or needs a GPU
case "$cuda" in ""|12|13) ;; *) die "--cuda takes 12 or 13, got '$cuda'" 64 ;; esac
: "${budget:=$(case $mode in full) echo 570 ;; quick) echo 300 ;; dry-run) echo 600 ;; esac)}"
case "$budget" in ''|*[!0-9]*) die "--budget takes whole seconds, got '$budget'" 64 ;; esac
DEADLINE=$((START + budget))

# ------------------------------------------------------------------------------------------ which wheels
# The driver's CUDA version (nvidia-smi's header) decides: CUDA 13 wheels need a driver that supports CUDA 13.
driver_cuda() { nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\..*/\1/p' | head -n 1; }
if [ -z "$cuda" ] && [ "$mode" != dry-run ] && [ "$fetch_wheels" = 0 ]; then  # fetching wheels needs no GPU
  detected=$(driver_cuda || true)
  if [ -n "$detected" ] && [ "$detected" -ge 13 ]; then cuda=13
  elif [ -n "$detected" ] && [ "$detected" -eq 12 ]; then cuda=12
  elif [ -n "$detected" ]; then die "the NVIDIA driver supports CUDA $detected; JAX $JAX_VERSION needs CUDA 12 or 13 (update the driver)"
  elif [ "$install" = 1 ] && [ "$plan_only" = 0 ]; then
    die "cannot tell the driver's CUDA version (nvidia-smi is missing or printed none): pass --cuda 13 for a driver \
that supports CUDA 13 (R580 or newer), else --cuda 12; or --no-install to use a Python that already has JAX with CUDA" 64
  fi
fi
if [ "$cuda" = 12 ]; then TORCH_VERSION=$TORCH_FOR_CUDA12; else TORCH_VERSION=$TORCH_FOR_CUDA13; fi
# The end-to-end part imports the training pipeline: these are setup.py's CORE requirements that it needs.
PIPELINE=("flax>=0.12" "optax>=0.2.5" "orbax-checkpoint>=0.11" "grain>=0.2.12" "tensorstore>=0.1.70" "ml-collections>=1.0"
  "absl-py" "etils[epath]" "tqdm" "tokenizers>=0.21" "safetensors>=0.5" "filelock")
REQUIREMENTS=("jax[cuda${cuda:-13}]==$JAX_VERSION" "torch==$TORCH_VERSION" "fla-core==$FLA_VERSION" "numpy" "${PIPELINE[@]}")
# Installed afterwards with --no-deps, over an exact pin of torch's: JAX's CUDA plugin refuses to start when a CUDA
# library is older (major.minor) than the one it was built with, and torch 2.10 pins cuFFT 11.3 while jax-cuda12
# 0.12.0.1 was built with cuFFT 11.4 (cuFFT keeps its ABI within a major version; fla does not use it anyway).
# jax-cuda13 0.12.0.1 was built with CUDA 13.0 libraries, all at or below torch 2.13's pins.
AFTER=()
[ "$cuda" = 12 ] && AFTER=("nvidia-cufft-cu12==11.4.1.4")
GPU_DIR=${GPU_CHECK_DIR:-$ROOT/.venv-gpu}  # env/ (the venv), uv-cache/ and jax-cache/ survive a failed install
VENV=$GPU_DIR/env
STAMP="$VENV/.gpu-check-requirements"
WHEELS=$GPU_DIR/wheels

stamp_matches() { [ -f "$STAMP" ] && cmp -s "$STAMP" <(printf '%s\n' "${REQUIREMENTS[@]}" "${AFTER[@]}"); }

# uv on PATH, else the one kept in $GPU_DIR/uv, else fetched there by pip (any python3 with pip will do, whatever
# its version: uv is a standalone binary). uv then builds the venv with a Python 3.12 it finds or downloads itself.
UV_HOME=$GPU_DIR/uv
find_uv() {
  local py
  command -v uv && return 0
  [ -x "$UV_HOME/bin/uv" ] && { echo "$UV_HOME/bin/uv"; return 0; }
  py=$(command -v python3 || command -v python) || { echo "gpu_check: no uv on PATH and no python3 to fetch it with" >&2; return 1; }
  "$py" -m pip install -q --retries 1 --timeout 20 --target "$UV_HOME" "uv==$UV_VERSION" >&2 \
    || { echo "gpu_check: could not fetch uv==$UV_VERSION with $py -m pip (is the package registry reachable?)" >&2; return 1; }
  echo "$UV_HOME/bin/uv"
}

if [ "$plan_only" = 1 ]; then
  echo "gpu_check install plan (nothing is changed)"
  echo "  mode:          $mode, budget ${budget} s, results in $out"
  detected=$(driver_cuda || true)
  echo "  driver CUDA:   ${detected:-none found (nvidia-smi missing or silent)}; $([ -n "$cuda" ] && echo "wheels for CUDA $cuda" || echo "a run stops and asks for --cuda 12 or 13")"
  echo "  python:        ${PYTHON:-3.12} (uv venv --python: a matching Python of this machine, else one uv downloads)"
  echo "  venv:          $VENV$(stamp_matches && echo ' (up to date: reused)')"
  echo "  installer:     $(command -v uv || echo "uv==$UV_VERSION, fetched by pip into $UV_HOME"); the venv's pip if uv's install fails"
  echo "  requirements:  ${REQUIREMENTS[*]}"
  [ ${#AFTER[@]} -gt 0 ] && echo "  then, --no-deps: ${AFTER[*]}"
  echo "  not installed: the rest of the repository's dependencies and its test extras (the kernel checks import"
  echo "                 only jax, numpy, pallas_kernels and torch + fla; the end-to-end part the training pipeline)"
  echo "  offline:       $(compgen -G "$WHEELS/*.whl" >/dev/null && echo "wheels in $WHEELS" || echo "none kept (bash bench/gpu_check.sh --fetch-wheels)") (fla, and grain and ml-collections for the pipeline)"
  [ "$mode" = dry-run ] && echo "  (--dry-run installs nothing: it runs on the current Python in interpret mode)"
  exit 0
fi

# ------------------------------------------------------------------------------------------ environment
mkdir -p "$out" || die "cannot create the results folder $out"
out=$(cd "$out" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch (the fla peer) shares the GPU with JAX in one process
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}

# uv downloads and unpacks in parallel (3.1 GB of wheels for CUDA 13, 4.4 GB for CUDA 12); pip is the fallback when
# uv's install fails. uv comes from the registry too: when even it cannot be fetched (with few, short retries, so an
# unreachable registry costs seconds, not minutes) the install gives up. uv does not read pip's configuration, so an
# index-url set for pip on this machine (a registry mirror) is handed to it.
install_venv() {
  local uv index t0; t0=$(date +%s)
  mkdir -p "$GPU_DIR" && echo '*' > "$GPU_DIR/.gitignore"
  uv=$(find_uv) || return 1
  index=$({ command -v python3 >/dev/null && python3 -m pip config get global.index-url; } 2>/dev/null || true)
  export UV_CACHE_DIR=${UV_CACHE_DIR:-$GPU_DIR/uv-cache} UV_DEFAULT_INDEX=${UV_DEFAULT_INDEX:-${PIP_INDEX_URL:-$index}}
  export UV_PYTHON_INSTALL_DIR=${UV_PYTHON_INSTALL_DIR:-$GPU_DIR/uv-python}
  [ -n "$UV_DEFAULT_INDEX" ] || unset UV_DEFAULT_INDEX
  echo "== installing into $VENV (Python ${PYTHON:-3.12} by uv): ${REQUIREMENTS[*]}${AFTER[*]:+ ${AFTER[*]}}"
  rm -rf "$VENV"
  "$uv" venv --seed --python "${PYTHON:-3.12}" "$VENV" || {
    echo "gpu_check: uv could not find or download Python ${PYTHON:-3.12} for $VENV (set PYTHON to an interpreter)" >&2
    return 1; }
  if ! "$uv" pip install --python "$VENV/bin/python" "${REQUIREMENTS[@]}"; then
    echo "== uv's install failed: trying pip (slower)"
    "$VENV/bin/python" -m pip install -q "${REQUIREMENTS[@]}" || return 1
  fi
  [ ${#AFTER[@]} -eq 0 ] || "$VENV/bin/python" -m pip install -q --no-deps "${AFTER[@]}" || return 1
  printf '%s\n' "${REQUIREMENTS[@]}" "${AFTER[@]}" > "$STAMP"
  echo "== installed in $(( $(date +%s) - t0 )) s: $(du -sh "$VENV" 2>/dev/null | cut -f1) in $VENV"
}

# A GPU machine without the registry (a lent device box reaches nothing outside) still gets the fla peer and the
# training pipeline's imports its Python lacks (the lent machines' image has jax, flax, optax, orbax, tensorstore,
# torch and triton, not grain or ml-collections): the wheels are kept in $WHEELS by --fetch-wheels on a machine that
# has the registry (built for Python 3.12, the image's), carried with the checkout (5 MB), and installed with
# --no-index into a folder on PYTHONPATH. Pinned to the versions the tests ran with.
WHEELS_PINNED=("fla-core==$FLA_VERSION" "einops" "grain==0.2.18" "array-record==0.8.6" "portpicker==1.6.0"
  "ml-collections==1.1.0")
OFFLINE_MODULES=(fla grain array_record portpicker ml_collections)  # what those wheels give, by import name
fetch_wheels() {
  local base; base=$(command -v "${PYTHON:-python3}") || die "no ${PYTHON:-python3} to run pip with (or set PYTHON)"
  mkdir -p "$WHEELS" && echo '*' > "$GPU_DIR/.gitignore"
  "$base" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$WHEELS" "${WHEELS_PINNED[@]}" \
    || die "could not download ${WHEELS_PINNED[*]} (is the package registry reachable?)"
  echo "== kept in $WHEELS: $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')"
}
add_offline_wheels() {  # python: when it cannot import one of OFFLINE_MODULES, unpack the kept wheels onto PYTHONPATH
  local py=$1 site="$GPU_DIR/peer-site" missing=() m
  for m in "${OFFLINE_MODULES[@]}"; do "$py" -c "import $m" 2>/dev/null || missing+=("$m"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  compgen -G "$WHEELS/*.whl" >/dev/null || { echo "== not importable, and no wheels kept in $WHEELS: ${missing[*]}"; return 0; }
  if [ ! -f "$site/.unpacked" ] || [ -n "$(find "$WHEELS" -name '*.whl' -newer "$site/.unpacked")" ]; then
    rm -rf "$site"
    "$py" -m pip install -q --no-index --no-deps --target "$site" "$WHEELS"/*.whl \
      || { echo "== could not unpack the wheels in $WHEELS; what needs ${missing[*]} is skipped"; return 0; }
    touch "$site/.unpacked"
  fi
  export PYTHONPATH="$PYTHONPATH:$site"
  echo "== ${missing[*]} added from $WHEELS ($site on PYTHONPATH)"
}

has_gpu_jax() { "$1" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' >/dev/null 2>&1; }
[ "$fetch_wheels" = 1 ] && { fetch_wheels; exit 0; }

if [ "$mode" = dry-run ]; then
  PY=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}
  export JAX_PLATFORMS=cpu
  echo "== dry run on the CPU with $PY: Pallas in interpret mode, tiny shapes, no install, GPU peers skipped"
elif [ "$install" = 0 ]; then
  PY=${PYTHON:-python3}
  echo "== --no-install: using $PY as it is"
  add_offline_wheels "$PY"
else
  PY="$VENV/bin/python"
  if [ -x "$PY" ] && stamp_matches && "$PY" -c 'import jax, torch, fla' 2>/dev/null; then
    echo "== reusing $VENV (${REQUIREMENTS[*]}${AFTER[*]:+ ${AFTER[*]}})"
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$GPU_DIR/jax-cache}  # a rerun skips compiles
  elif install_venv; then
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$GPU_DIR/jax-cache}
  elif has_gpu_jax "${PYTHON:-python3}"; then
    PY=${PYTHON:-python3}
    echo "== the install failed; $PY already has JAX with a GPU: using it as it is (a peer it lacks is skipped)"
    add_offline_wheels "$PY"
  else
    die "installing ${REQUIREMENTS[*]} into $VENV failed (see above: is the package registry reachable?); on a machine
without it, install JAX with CUDA yourself and run with --no-install"
  fi
fi
"$PY" -c 'import jax, numpy' 2>/dev/null || die "$PY cannot import jax and numpy (run without --no-install to install them)"
if [ "$mode" != dry-run ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/== GPU: /' || true
  has_gpu_jax "$PY" || die "JAX in $PY sees no GPU ($("$PY" -c 'import jax; print(jax.devices())' 2>&1 | tail -n 1)).
On a GPU machine: check nvidia-smi, or pass --cuda 12 for a driver older than CUDA 13 (with --no-install: install
jax[cuda12] or jax[cuda13]). Without a GPU: --dry-run"
fi

# ------------------------------------------------------------------------------------------ the checks
# Each part runs in its own process (a crash or a hung compile in one cannot take the others with it) under a hard
# timeout a little past its deadline: the end-to-end part is kept the last E2E_S seconds, flash attention gets half
# of what is left before them, gated delta the rest. The correctness checks come first in each script; a part is
# given at least MIN_KERNEL_S even when the install used up the budget, since a run that checks nothing is worth
# nothing.
run_kernel() {  # name script deadline
  local rc=0 deadline=$3 now; now=$(date +%s)
  if [ "$deadline" -lt $((now + MIN_KERNEL_S)) ]; then
    echo "== note: the budget is spent; $1 still gets ${MIN_KERNEL_S} s for its checks"
    deadline=$((now + MIN_KERNEL_S))
  fi
  echo "== $1 (until $(date -d "@$deadline" +%T 2>/dev/null || echo "$deadline"))"
  timeout --kill-after=10 $((deadline - now + 60)) "$PY" "bench/$2" --mode "$mode" --deadline "$deadline" --out "$out" || rc=$?
  status+=(--status "$1=$rc")
}
status=()
now=$(date +%s)
SUMMARY_RESERVE=10
MIN_KERNEL_S=$([ "$mode" = full ] && echo 60 || echo 30)
E2E_S=$(case $mode in full) echo 240 ;; quick) echo 120 ;; dry-run) echo 300 ;; esac)
KERNELS_END=$(( DEADLINE - SUMMARY_RESERVE - E2E_S ))
run_kernel flash_attention gpu_check_flash_attention.py $(( now + (KERNELS_END - now) / 2 ))
run_kernel gated_delta gpu_check_gated_delta.py $KERNELS_END
run_kernel end_to_end gpu_check_end_to_end.py $(( DEADLINE - SUMMARY_RESERVE ))
echo "== finished in $(( $(date +%s) - START )) s (budget $budget s)"
exec "$PY" bench/_gpu_check.py summarize --out "$out" "${status[@]}"
