#!/usr/bin/env bash
# How many pytest-xdist workers `make test` and `make test-all` start: one per core (pytest-xdist's `-n auto`),
# fewer when the memory available now would not hold that many workers at their peak.
set -euo pipefail

# A worker's peak memory in MiB: the largest resident set of a worker process together with the train.py, eval.py
# and bench subprocesses it runs at the time (provisional; measured in the next commit).
PEAK_MIB=3072

cores=$(nproc)
available_mib=$(awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo)
by_memory=$((available_mib / PEAK_MIB))
workers=$((by_memory < cores ? by_memory : cores))
echo $((workers > 0 ? workers : 1))
