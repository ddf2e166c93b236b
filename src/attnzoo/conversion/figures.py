"""The figure of a conversion (matplotlib, Agg backend): ``loss.png``, the loss of each stage against the
training tokens seen, and each layer's held-out attention-transfer error with the layers kept in softmax."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


SMOOTHING = 10  # steps in the running mean drawn over each stage's losses


def _running_mean(values: Sequence[float], width: int) -> list:
    """The mean of each ``width`` consecutive values (len(values) - width + 1 of them)."""
    return [sum(values[i - width + 1 : i + 1]) / width for i in range(width - 1, len(values))]


def plot_history(history: Sequence[Dict[str, Any]], layer_errors: Sequence[float], kept: Sequence[int],
                 path: Path) -> None:
    """Write the three panels (stage 1 loss, stage 2 loss, per-layer error) to ``path``."""
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, stage, title in ((axes[0], "transfer", "stage 1: attention transfer"),
                               (axes[1], "finetune", "stage 2: low-rank fine-tune")):
        rows = [row for row in history if row["stage"] == stage]
        if rows:
            tokens, losses = [row["tokens"] for row in rows], [row["loss"] for row in rows]
            axis.plot(tokens, losses, lw=0.8, alpha=0.45, color="tab:blue", label="each step")
            if len(rows) >= SMOOTHING:  # the windows alternate prose and code: the steps zigzag
                axis.plot(tokens[SMOOTHING - 1:], _running_mean(losses, SMOOTHING), lw=1.8, color="tab:blue",
                          label=f"mean of the last {SMOOTHING}")
                axis.legend(fontsize=8)
            axis.set_yscale("log")
        else:
            axis.text(0.5, 0.5, "no steps", ha="center", va="center", transform=axis.transAxes)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("training tokens")
        axis.set_ylabel("relative output error" if stage == "transfer" else "loss")
        axis.grid(alpha=0.3)
    if layer_errors and max(layer_errors) > 0:
        colours = ["tab:red" if index in kept else "tab:blue" for index in range(len(layer_errors))]
        axes[2].bar(range(len(layer_errors)), layer_errors, color=colours)
        axes[2].set_yscale("log")
    elif layer_errors:  # e.g. the teacher fine-tuned alike (target softmax): nothing to transfer, nothing to draw
        axes[2].text(0.5, 0.5, "every layer's error is 0", ha="center", va="center", transform=axes[2].transAxes)
    axes[2].set_title("held-out transfer error per layer" + (" (red: kept softmax)" if kept else ""), fontsize=10)
    axes[2].set_xlabel("layer")
    axes[2].set_ylabel("relative output error")
    axes[2].grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
