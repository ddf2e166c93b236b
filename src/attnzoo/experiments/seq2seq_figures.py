"""The PNG figures of ``attnzoo seq2seq-report`` (matplotlib, Agg backend: no display needed).

guide-loss-over-steps.png  the validation guide loss (how far the cross-attention is from the diagonal)
                           against the training step, one line per run, the threshold dashed
cross-attention-maps.png   one test example's cross-attention (target x source), one panel per run
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def plot_guide_curves(curves: Dict[str, Sequence[Tuple[int, float]]], threshold: float, path: Path,
                      title: str) -> None:
    """``curves``: label -> [(step, guide loss), ...]; a label without points is left out of the plot."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, points in curves.items():
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=label)
    ax.axhline(threshold, color="grey", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation guide loss (0 = diagonal)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_attention_maps(maps: List[Tuple[str, Dict[str, Any]]], path: Path) -> None:
    """One heat map per (label, :func:`attnzoo.experiments.seq2seq_eval.cross_attention_map` result), side by side;
    rows are target tokens (what each decoder step predicts), columns source tokens."""
    if not maps:  # no model could be measured: say so rather than leave an old figure in place
        fig, ax = plt.subplots(figsize=(5.0, 2.0))
        ax.axis("off")
        ax.text(0.5, 0.5, "no cross-attention map: the g2p runs did not finish (see the report)", ha="center")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    fig, axes = plt.subplots(1, len(maps), figsize=(4.6 * len(maps), 4.6), squeeze=False)
    for column, (ax, (label, attention)) in enumerate(zip(axes[0], maps)):
        image = ax.imshow(attention["weights"], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(attention["source"])), attention["source"], fontsize=8)
        ax.set_yticks(range(len(attention["target"])), attention["target"], fontsize=8)
        ax.set_xlabel("source (letters)")
        if column == 0:  # the rows are the same tokens in every panel
            ax.set_ylabel("target (the phoneme each step predicts)")
        ax.set_title(label, fontsize=9)
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="weight (mean over heads and layers)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
