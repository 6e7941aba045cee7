#!/usr/bin/env bash
# How many pytest-xdist workers `make test` and `make test-all` start: one per core (pytest-xdist's `-n auto`),
# fewer when the memory available now would not hold that many workers at their peak.
set -euo pipefail

# A worker's peak memory in MiB: the resident set of a worker process and the train.py, eval.py and bench subprocesses
# it runs at the time, summed. Measured 2026-12-07 on this 2-core box with two pytest processes (-n 0), each running
# about half of the suite's files as a worker does, the process tree sampled every 0.5 s and each test's ru_maxrss
# read: the peak, 6,239 MiB, is the process that had run 400 tests when it loaded the real SmolLM2 teacher
# (test_pretrained.py; its resident set grows with the programs it has compiled); the other (gated delta, training
# config, comparison, bench smoke runs, context parallelism, flash attention; 372 tests) peaked at 5,306 MiB with a
# subprocess.
PEAK_MIB=6239

cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
if [ ! -r /proc/meminfo ]; then  # not Linux: no MemAvailable to go by
  echo "$cores"
  exit 0
fi
available_mib=$(awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo)
by_memory=$((available_mib / PEAK_MIB))
workers=$((by_memory < cores ? by_memory : cores))
echo $((workers > 0 ? workers : 1))
