"""Run every benchmark of this folder in turn (``make bench``); each appends its section to bench/RESULTS.md.

    python bench/run_all.py                  # full settings (tens of minutes on a 2-core CPU)
    python bench/run_all.py --quick          # smoke settings of every script (nothing recorded)
    python bench/run_all.py --only decode gated_delta

Each script runs in its own process (fresh JAX runtime and memory); extra arguments after ``--`` go to every
script. Exits non-zero if any script failed (an error, not a missed goal: goals are printed, never enforced).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {
    "attention": "bench_attention.py",
    "gated_delta": "bench_gated_delta.py",
    "decode": "bench_decode.py",
    "train_step": "bench_train_step.py",
    "segments": "bench_segments.py",
    "context_parallel": "bench_context_parallel.py",
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--only", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS))
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- extra arguments for every script")
    args = ap.parse_args(argv)
    extra = [a for a in args.rest if a != "--"]
    extra += ["--quick"] * args.quick + ["--no-record"] * args.no_record
    failed = []
    for name in args.only:
        cmd = [sys.executable, str(HERE / SCRIPTS[name])] + extra
        print(f"=== {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)
        print(f"=== {name}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
