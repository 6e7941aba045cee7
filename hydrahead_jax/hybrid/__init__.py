"""HydraHead students: the HydraHead attention block, head maps, Gated DeltaNet heads, fusion calibration,
building and cache sizes."""

from hydrahead_jax.hybrid.attention import HydraHeadAttention, ScaleFusion
from hydrahead_jax.hybrid.build import build_model, build_student, new_param_filter
from hydrahead_jax.hybrid.cache import cache_bytes
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.hybrid.fusion import calibrate_fusion, teacher_head_rms
from hydrahead_jax.hybrid.head_map import HeadMap, HeadMapError, fa_budget, parse_ratio

__all__ = [
    "HydraHeadAttention",
    "ScaleFusion",
    "HybridConfig",
    "HeadMap",
    "HeadMapError",
    "parse_ratio",
    "fa_budget",
    "build_student",
    "build_model",
    "new_param_filter",
    "calibrate_fusion",
    "teacher_head_rms",
    "cache_bytes",
]
