"""Running the local lm-eval tasks (tests/lm_eval_tasks/) and reading their per-request results, for the tests
that compare a backend with lm-eval's own ``hf`` (test_lm_eval_harness.py, test_export_hf.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ["hh_choice", "hh_rolling", "hh_generate"]
MAX_LENGTH = 64  # for both backends: the rolling task spans several windows, long prompts are left-truncated


def lm_eval_run(lm, tasks=TASKS, **kwargs) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True, bootstrap_iters=0, **kwargs)


def responses(results: dict) -> dict[str, list]:
    """{task: every document's filtered responses, in document order}."""
    return {
        task: [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
        for task, samples in results["samples"].items()
    }


def loglik_values(results: dict) -> np.ndarray:
    """Every log-likelihood the run computed (choices and rolling documents), flattened in a fixed order."""
    out = []
    for task, docs in sorted(responses(results).items()):
        for resp in docs:
            if task == "hh_generate":
                continue
            out.extend(r[0] if isinstance(r, (tuple, list)) else r for r in resp)
    return np.asarray(out, np.float64)
