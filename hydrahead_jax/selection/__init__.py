"""Stage 0, head selection: probe the teacher (retrieval score, causal ablation), choose FA KV groups, write the
head map and a heatmap."""

from hydrahead_jax.selection.select import (
    METHODS,
    SelectionConfig,
    SelectionError,
    combine_scores,
    fa_count,
    rank_normalise,
    run_selection,
    select_fa_groups,
)

__all__ = [
    "METHODS",
    "SelectionConfig",
    "SelectionError",
    "combine_scores",
    "fa_count",
    "rank_normalise",
    "run_selection",
    "select_fa_groups",
]
