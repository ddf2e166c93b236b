"""The two pictures of ``attnzoo lra``: average test accuracy (y) against speed (x, log), bubble area = peak memory.

``lra.png``       speed and memory of the training cells themselves, at the tasks' own lengths (tokens per
                  second of a training step, peak resident memory of the training process);
``lra-long.png``  speed and memory of one attention layer's forward+backward at ``--long-length`` tokens,
                  measured by the kernel benchmark (:mod:`attnzoo.experiments.lra_speed`): the Long Range
                  Arena's picture, where the mechanisms differ.

``lra-curves.png`` the learning curves (validation metric against step, one panel per task, one line per
                  mechanism) of a preset that validates more than once, with the published figure for its
                  model (``lra.PUBLISHED``, dashed) and the trivial baseline (dotted).

Each says in its axis label and title which lengths it measures. Mechanisms missing an accuracy task, or a
long-length measurement, are left out and named below the title.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from ..bench.results import BASELINE  # noqa: E402
from .lra_speed import measured_on, training_lengths_text  # noqa: E402

Point = Tuple[str, float, float, float]  # mechanism, speed, accuracy %, memory MiB


def _accuracy_tasks(data: Dict[str, Any]) -> List[str]:
    return [t for t in data["tasks"] if data["metrics"][t] == "accuracy"]


def _bubbles(data: Dict[str, Any], points: Sequence[Point], path: Path, xlabel: str, title: str,
             missing: Sequence[str]) -> None:
    """One bubble per point, the trivial baselines' average as a dashed line."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    largest = max((memory for *_, memory in points), default=1.0) or 1.0
    for index, (name, speed, accuracy, memory) in enumerate(points):
        ax.scatter(speed, accuracy, s=60 + 1400 * (memory / largest), alpha=0.45,
                   color="black" if name == BASELINE else plt.get_cmap("tab20").colors[index % 20])
        ax.annotate(name, (speed, accuracy), textcoords="offset points", xytext=(6, 4), fontsize=8)
    tasks = _accuracy_tasks(data)
    if tasks:
        chance = sum(data["baselines"][t]["accuracy"] for t in tasks) / len(tasks)
        ax.axhline(100 * chance, color="grey", linestyle="--", linewidth=1, label="trivial baselines' average")
        ax.legend(loc="lower right", fontsize=8)
    if points:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"average test accuracy over {', '.join(tasks) or 'no task'} (%)")
    ax.set_title(title + (f"\nnot shown: {', '.join(missing)}" if missing else ""), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # long titles widen the image rather than being cut
    plt.close(fig)


def plot_training_length(data: Dict[str, Any], path: Path) -> None:
    """Training speed (tokens per second, the mean over the tasks' cells) against the average accuracy, bubble
    area = the training processes' largest peak memory: all at the tasks' own lengths."""
    entries = [e for e in data["summary"] if e["average_accuracy"] is not None and e["tokens_per_second"]]
    points = [(e["mechanism"], e["tokens_per_second"], 100 * e["average_accuracy"], e["peak_memory_mib"] or 1.0)
              for e in entries]
    lengths = training_lengths_text(data)
    _bubbles(data, points, path,
             f"training speed: tokens per second, mean over the tasks' cells (log)\nat the tasks' own lengths: "
             f"{lengths} tokens",
             f"attnzoo lra ({data['budget']} preset): accuracy, training speed and memory (bubble area: the "
             f"training process's peak)\nall at the tasks' own lengths: {lengths} tokens",
             [e["mechanism"] for e in data["summary"] if e not in entries])


def plot_long_length(data: Dict[str, Any], path: Path) -> None:
    """Forward+backward speed of one attention layer at the long length (tokens per second) against the average
    accuracy (trained at the tasks' own lengths), bubble area = that layer's peak memory at the long length."""
    long = data.get("long_length")
    if long is None:
        return
    rows = {row["mechanism"]: row for row in long["rows"]}
    points: List[Point] = []
    missing = []
    for entry in data["summary"]:
        row: Optional[Dict[str, Any]] = rows.get(entry["mechanism"])
        if entry["average_accuracy"] is None or row is None or not row["tokens_per_second"] \
                or row["peak_memory_mib"] is None:
            missing.append(entry["mechanism"] + (f" ({row['status']})" if row and row["status"] != "ok" else ""))
            continue
        points.append((entry["mechanism"], row["tokens_per_second"], 100 * entry["average_accuracy"],
                       row["peak_memory_mib"]))
    shape = (f"batch {long['batch']}, {long['heads']} heads of width {long['head_dim']} (model width {long['dim']}), "
             f"{measured_on(long)}")
    _bubbles(data, points, path,
             f"speed at N={long['length']}: tokens per second of one attention layer's forward+backward (log)",
             f"attnzoo lra ({data['budget']} preset): accuracy trained at the tasks' own lengths "
             f"({training_lengths_text(data)} tokens);\nspeed and peak memory (bubble area) of one attention "
             f"layer at N={long['length']} tokens\n{shape}",
             missing)


def plot_curves(data: Dict[str, Any], path: Path) -> None:
    """One panel per task: each mechanism's validation metric against the training step, at equal steps."""
    tasks = list(data["curves"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    most = max(len(curves) for curves in data["curves"].values())
    colors = plt.get_cmap("tab10" if most <= 10 else "tab20").colors  # tab20's pairs only when needed
    for ax, task in zip(axes[0], tasks):
        metric = data["metrics"][task]
        scale = 100 if metric == "accuracy" else 1
        for index, (mechanism, curve) in enumerate(data["curves"][task].items()):
            if curve:
                ax.plot([step for step, _ in curve], [scale * value for _, value in curve], marker="o",
                        markersize=3, label=mechanism, color=colors[index % len(colors)])
        baseline = data["baselines"][task][metric]
        ax.axhline(scale * baseline, color="grey", linestyle=":", linewidth=1,
                   label=f"majority class ({scale * baseline:.1f})" if metric == "accuracy" else "unigram")
        published = data.get("published", {}).get(task)
        if published:
            ax.axhline(100 * published["accuracy"], color="black", linestyle="--", linewidth=1,
                       label=f"published: {100 * published['accuracy']:.1f} ({published['source'].split(':')[0]}; "
                             f"its budget in lra.md)")
        ax.set_xlabel("training step")
        ax.set_ylabel(f"validation {'accuracy (%)' if metric == 'accuracy' else metric}")
        ax.set_title(f"{task}, {data['training_lengths'].get(task, '?')} tokens", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)  # below: lines stay clear
    fig.suptitle(f"attnzoo lra ({data['budget']} preset): learning curves at equal steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
