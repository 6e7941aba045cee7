#!/usr/bin/env bash
# How many pytest-xdist workers `make test` and `make test-all` start: one per core (pytest-xdist's `-n auto`),
# fewer when the memory available now would not hold that many workers at their peak.
set -euo pipefail

# A worker's peak memory in MiB: the resident set of a worker process and the train.py, eval.py and bench subprocesses
# it runs at the time, summed. Measured 2026-12-07 on this 2-core box (the process tree sampled every 0.5 s while one
# pytest process ran, as one worker does, the suite's largest files: gated delta, training config, comparison, bench
# smoke runs, context parallelism, flash attention, head maps; 372 tests): 5,306 MiB at its peak (the pytest process
# alone 4,356 MiB, growing with the programs it has compiled); a second process over the other default-tier files
# peaked at 3,680 MiB.
PEAK_MIB=5306

cores=$(nproc)
available_mib=$(awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo)
by_memory=$((available_mib / PEAK_MIB))
workers=$((by_memory < cores ? by_memory : cores))
echo $((workers > 0 ? workers : 1))
