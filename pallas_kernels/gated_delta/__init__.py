"""Gated delta rule (Gated DeltaNet linear attention): reference scan, chunked XLA, Pallas GPU/TPU kernels."""

from .api import IMPLEMENTATIONS, chunk_gated_delta_rule, gated_delta_rule_step
from .reference import naive_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_step", "naive_gated_delta_rule", "IMPLEMENTATIONS"]
