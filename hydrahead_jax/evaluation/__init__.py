"""Evaluation: long-context retrieval, held-out perplexity, teacher agreement and efficiency, side by side.

Entry point: ``eval.py`` (``hydrahead_jax.evaluation.cli.main``). Library use::

    models = load_models(["teacher:smollm2-135m", "runs/x/final"])
    suite = Suite(models, Settings.demo()).run()
    write_outputs(suite, "runs/x/eval")
"""

from hydrahead_jax.evaluation.models import EvalModel, ModelSpecError, load_model, load_models
from hydrahead_jax.evaluation.report import aggregate, write_outputs
from hydrahead_jax.evaluation.runner import OutOfMemory, Runner
from hydrahead_jax.evaluation.scoring import exact_match, normalize_answer
from hydrahead_jax.evaluation.suite import PRESETS, SUITES, Settings, Suite, SuiteError, parse_lengths, parse_suite

__all__ = [
    "EvalModel",
    "ModelSpecError",
    "load_model",
    "load_models",
    "aggregate",
    "write_outputs",
    "OutOfMemory",
    "Runner",
    "exact_match",
    "normalize_answer",
    "PRESETS",
    "SUITES",
    "Settings",
    "Suite",
    "SuiteError",
    "parse_lengths",
    "parse_suite",
]
