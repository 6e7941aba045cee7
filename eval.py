"""Evaluate HydraHead models and their teacher: long-context retrieval, perplexity, agreement, efficiency.

    python eval.py --model runs/x/final --model teacher:smollm2-135m \
        --suite niah,passkey,kv,ppl,agreement,efficiency --lengths 1k,2k,4k,8k,16k,32k --out runs/x/eval
    python eval.py --model runs/x/final --model teacher:smollm2-135m --suite demo --out runs/x/eval

Writes results.json, report.md and PNG plots under --out. See hydrahead_jax/evaluation/ for the details.
"""

import sys

from hydrahead_jax.evaluation.cli import main

if __name__ == "__main__":
    sys.exit(main())
