"""The picture of ``attnzoo mqar`` (``mqar.png``): Zoology's two views of recall, one line per schedule.

Left: test accuracy (the best learning rate's, chosen on validation) against the model's width. Right: the
same accuracy against the decoding state in bytes per sequence (log scale), each point labelled with its
width: softmax's KV cache grows with the sequence, a linear-time mechanism's state with the width alone, and
MQAR asks how much recall each byte of state buys. Chance (one value among the vocabulary's values) is the
dotted line. Schedules with no state to count (no recurrent step) are left out of the right panel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib import ticker  # noqa: E402

MARKERS = ("o", "s", "^", "D", "v", "P", "X")
DASHES = ("-", "--", "-.", ":")


def _lines(data: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    """Each schedule's finished entries of the table, by width."""
    lines: Dict[str, List[Dict[str, Any]]] = {}
    for entry in data["table"]:
        if entry["test_accuracy"] is not None:
            lines.setdefault(entry["schedule"], []).append(entry)
    return lines


def plot_mqar(data: Dict[str, Any], path: Path) -> None:
    """Draw ``mqar.png`` from mqar.json's ``data`` (:func:`attnzoo.experiments.mqar.collect`)."""
    fig, (by_width, by_state) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.get_cmap("tab10").colors
    lines = _lines(data)
    for index, (schedule, entries) in enumerate(lines.items()):
        # Schedules often coincide (every one that recalls everything sits at 100%): each later line is drawn
        # thinner, with a marker and dashes of its own, over the earlier ones, so every line stays visible.
        later = len(lines) - 1 - index
        style = dict(color=colors[index % 10], marker=MARKERS[index % len(MARKERS)],
                     linestyle=DASHES[index % len(DASHES)], linewidth=1.2 + 0.9 * later, markersize=4 + 1.5 * later,
                     label=schedule)
        by_width.plot([e["width"] for e in entries], [100 * e["test_accuracy"] for e in entries], **style)
        stated = [e for e in entries if e["state_bytes"] is not None]
        by_state.plot([e["state_bytes"] for e in stated], [100 * e["test_accuracy"] for e in stated], **style)
        for entry in stated:
            by_state.annotate(f"d{entry['width']}", (entry["state_bytes"], 100 * entry["test_accuracy"]),
                              textcoords="offset points", xytext=(4, 4), fontsize=7)
    options = data["task_options"]
    for ax, label in ((by_width, "model width"), (by_state, "decoding state, bytes per sequence (float32)")):
        ax.axhline(100 * data["chance"], color="grey", linestyle=":", linewidth=1, label="chance")
        ax.set_xscale("log", base=2 if ax is by_width else 10)
        ax.set_xlabel(label)
        ax.set_ylabel("test accuracy (%), best learning rate")
        ax.set_ylim(-2, 102)
        ax.grid(True, which="both", alpha=0.3)
    # Within a decade or two, log axes label their minor ticks too, and the labels run into each other: label
    # 1, 2 and 5 times each power of ten only.
    by_state.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    by_state.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:,.0f}"))
    by_state.xaxis.set_minor_formatter(ticker.NullFormatter())
    widths = sorted({entry["width"] for entry in data["table"]})
    by_width.set_xticks(widths, [str(width) for width in widths])
    by_width.minorticks_off()
    by_width.legend(fontsize=8, loc="best")
    fig.suptitle(f"MQAR, preset {data['preset']}: {options['num_pairs']} pairs in {options['seq_len']} tokens, "
                 f"vocabulary {options['vocab_size']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
