#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 interpreter, or explains how to get one and exits 1.
# Checks PATH first, then pyenv's versions folder (pyenv shims can exist for versions that are not active).
set -u
candidates=()
for name in python3.14 python3.13 python3.12 python3 python; do
  p=$(command -v "$name" 2>/dev/null) && candidates+=("$p")
done
for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
  [ -x "$p" ] && candidates+=("$p")
done
for p in "${candidates[@]}"; do
  if "$p" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
    echo "$p"
    exit 0
  fi
done
echo "hydrahead-jax needs Python >= 3.12 (JAX/Flax 0.12 do not support older ones) and none was found." >&2
echo "Install one (e.g. 'apt-get install python3.12 python3.12-venv', 'pyenv install 3.12', or 'uv python install 3.12')," >&2
echo "or point the Makefile at it: make demo PYTHON=/path/to/python3.12" >&2
exit 1
