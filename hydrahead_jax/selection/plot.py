"""Heatmaps of head-selection scores with the chosen FA groups marked (PNG, matplotlib Agg backend)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from hydrahead_jax.storage import run_path


def plot_scores(
    scores: dict[str, np.ndarray],
    fa_groups: Sequence[Sequence[int]],
    path: str | os.PathLike,
    *,
    head_scores: np.ndarray | None = None,
    title: str = "",
) -> str:
    """One panel per score matrix [layers × KV groups] (FA groups outlined), plus per-query-head retrieval
    scores [layers × query heads] when given (the heads of FA groups outlined). Writes ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if not scores:
        raise ValueError("plot_scores needs at least one score matrix.")
    panels = [(name, np.asarray(m, np.float64), 1) for name, m in scores.items()]
    if head_scores is not None:
        num_groups = panels[0][1].shape[1]
        panels.append(
            (
                "retrieval per query head",
                np.asarray(head_scores, np.float64),
                np.asarray(head_scores).shape[1] // num_groups,
            )
        )
    num_layers = panels[0][1].shape[0]
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(
            2.2 + 1.6 * len(panels) + 0.25 * sum(m.shape[1] for _, m, _ in panels),
            max(3.0, 0.22 * num_layers + 1.2),
        ),
        squeeze=False,
    )
    for ax, (name, matrix, per_group) in zip(axes[0], panels):
        if matrix.shape[0] != len(fa_groups):
            raise ValueError(f"score matrix {name!r} has {matrix.shape[0]} layers, the head map {len(fa_groups)}.")
        image = ax.imshow(matrix, aspect="auto", cmap="viridis", interpolation="nearest")
        fig.colorbar(image, ax=ax, fraction=0.08, pad=0.03)
        for layer, groups in enumerate(fa_groups):
            for g in groups:  # outline the group's column span (its query heads in the per-head panel)
                ax.add_patch(
                    Rectangle(
                        (g * per_group - 0.5, layer - 0.5), per_group, 1.0, fill=False, edgecolor="red", linewidth=1.6
                    )
                )
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("query head" if per_group > 1 else "KV group")
        ax.set_ylabel("layer")
        ax.set_xticks(range(matrix.shape[1]))
        ax.tick_params(labelsize=6)
    fig.suptitle((title + "  (red: FA groups)").strip(), fontsize=10)
    fig.tight_layout()
    path = run_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:  # a file object: matplotlib cannot open a gs:// name itself
        fig.savefig(out, dpi=110, format="png")
    plt.close(fig)
    return os.fspath(path)
