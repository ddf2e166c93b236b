"""bubble.png of ``attnzoo compare``: speed (x) against quality (y), bubble area proportional to peak memory, as
in the Long Range Arena paper.

Every mechanism with a quality value (an approximation error against softmax, or a task accuracy from
``--accuracy``) has a bubble, coloured by its kind, and a label placed beside it where it covers neither
another label nor a bubble (a leader line joins a label not right beside it); the figure says which mechanisms
have no value and why. Errors are drawn at their measured values, softmax's rounding error included, with
uniform attention's error as a labelled floor.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.transforms import Bbox  # noqa: E402

from ..mechanisms import APPROXIMATE, EXACT, OWN  # noqa: E402
from .plot_parts import (  # noqa: E402
    DPI,
    LABEL_SIZE,
    message_figure,
    plain_log_ticks,
    row_is_own,
    row_kind,
    subtitle,
)
from .results import BASELINE  # noqa: E402

ROUNDING = 1e-3  # an error below this is rounding: labelled exact, drawn at its measured value
KIND_COLORS = {EXACT: "black", APPROXIMATE: "tab:blue", OWN: "tab:orange"}
KIND_NAMES = {EXACT: "exact softmax", APPROXIMATE: "approximation of softmax", OWN: "attention of its own"}
OTHER_COLOR = "tab:gray"
KIND_ORDER = [EXACT, APPROXIMATE, OWN, None]  # the colour legend's order
SMALLEST, LARGEST = 40.0, 1600.0  # bubble areas (points squared) of no memory and of the most memory
UNIFORM_LABEL = "floor: uniform attention (ignores q, k)"
# Directions (degrees) a label may take from its bubble, the nearest first; then the same further out.
ANGLES = (0, 180, 90, 270, 30, 330, 150, 210, 60, 300, 120, 240)
Candidate = Tuple[Bbox, float, float, str, str, float]  # box, anchor x, y (pixels), ha, va, distance


def _bubble_length(data: Dict[str, Any]) -> Optional[int]:
    """The longest length at which softmax was measured: every ratio there has its baseline."""
    measured = [row["length"] for row in data["rows"] if row["mechanism"] == BASELINE and row["forward_backward_ms"]]
    return max(measured) if measured else None


def _wrapped(head: str, names: Sequence[str]) -> str:
    return textwrap.fill(f"{head}: {', '.join(names)}", 150)


def _choose(data: Dict[str, Any], accuracy: Optional[Dict[str, float]],
            length: Optional[int]) -> Tuple[List[Tuple[Dict[str, Any], float]], List[str]]:
    """The bubbles (row, quality) at ``length``, and the figure's notes on the mechanisms without one."""
    # results written before rows recorded their kind: the kind the mechanism declares
    at_length = [dict(row, kind=row_kind(row)) for row in data["rows"]
                 if row["length"] == length]
    timed = [row for row in at_length if row["forward_backward_ms"] and row["peak_memory_mib"] is not None]
    untimed = [f"{row['mechanism']} ({row['status']})" for row in at_length if row not in timed]
    notes = [_wrapped(f"no time or memory at N={length}", untimed)] if untimed else []
    if accuracy:
        points = [(row, accuracy[row["mechanism"]]) for row in timed if row["mechanism"] in accuracy]
        absent = [row["mechanism"] for row in timed if row["mechanism"] not in accuracy]
        if absent:
            notes.append(_wrapped(f"{len(absent)} not in the --accuracy file", absent))
        return points, notes
    # An attention of its own has no approximation error: its distance from softmax is no quality measure.
    points = [(row, row["error"]) for row in timed if row.get("error") is not None and row.get("kind") != OWN]
    own = [row["mechanism"] for row in timed if row.get("kind") == OWN]
    unmeasured = [row["mechanism"] for row in timed if row.get("error") is None and row.get("kind") != OWN]
    if own:
        notes.append(_wrapped(f"{len(own)} attentions of their own have no approximation error, so no bubble "
                              "(--accuracy places them)", own))
    if unmeasured:
        notes.append(_wrapped("no error measured", unmeasured))
    return points, notes


def _circle_overlaps(box: Bbox, circle: Tuple[float, float, float]) -> bool:
    x, y, radius = circle
    nearest_x, nearest_y = min(max(x, box.x0), box.x1), min(max(y, box.y0), box.y1)
    return (nearest_x - x) ** 2 + (nearest_y - y) ** 2 < radius ** 2


def _candidates(x: float, y: float, radius: float, width: float, height: float) -> Iterator[Candidate]:
    """Boxes of a label's size around a circle, each touching the circle of ``distance`` from the centre only
    at its anchor, in the order tried: right, left, above, below, the diagonals; then further out."""
    for ring in (0.0, 0.6, 1.3, 2.2, 3.5, 5.0, 7.0):
        distance = radius + 3 + ring * height
        for angle in ANGLES:
            ux, uy = math.cos(math.radians(angle)), math.sin(math.radians(angle))
            px, py = x + distance * ux, y + distance * uy
            ha = "left" if ux > 0.3 else "right" if ux < -0.3 else "center"
            va = "bottom" if uy > 0.3 else "top" if uy < -0.3 else "center"
            x0 = px if ha == "left" else px - width if ha == "right" else px - width / 2
            y0 = py if va == "bottom" else py - height if va == "top" else py - height / 2
            yield Bbox.from_bounds(x0, y0, width, height), px, py, ha, va, distance


def _cost(box: Bbox, own: int, circles: Sequence[Tuple[float, float, float]], taken: Sequence[Bbox],
          inside: Bbox, lines: Sequence[Bbox]) -> float:
    """How badly a label's box covers: its own bubble or another label (10 each), another bubble (2), a
    reference line (1), or leaves the axes (10)."""
    cost = 10.0 * sum(box.overlaps(other) for other in taken) + sum(box.overlaps(line) for line in lines)
    cost += sum(10.0 if index == own else 2.0
                for index, circle in enumerate(circles) if _circle_overlaps(box, circle))
    outside = box.x0 < inside.x0 or box.x1 > inside.x1 or box.y0 < inside.y0 or box.y1 > inside.y1
    return cost + (10.0 if outside else 0.0)


def place_labels(ax: Any, items: Sequence[Tuple[str, float, float, float]], taken: Optional[List[Bbox]] = None,
                 lines: Sequence[Bbox] = ()) -> List[Any]:
    """Label each bubble (text, x, y in data, radius in points) beside it: the nearest position that covers no
    other label (nor the boxes ``taken``), no bubble, no reference line (``lines``, boxes in pixels) and stays
    in the axes, else the one that covers least; the most crowded bubbles choose first. A label other than
    one right beside its bubble (left, right, above or below) gets a leader line. The axes' limits and place must be final.
    Returns the labels (annotations), in the order of ``items``."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    scale = fig.dpi / 72  # pixels per point
    circles = [(*ax.transData.transform((x, y)), radius * scale) for _, x, y, radius in items]
    taken = list(taken or [])
    crowding = [sum(math.hypot(a[0] - b[0], a[1] - b[1]) < a[2] + b[2] + 60 for b in circles) for a in circles]
    labels: List[Any] = [None] * len(items)
    for index in sorted(range(len(items)), key=lambda i: -crowding[i]):
        text, x, y, radius = items[index]
        probe = ax.text(0, 0, text, fontsize=LABEL_SIZE)
        size = probe.get_window_extent(renderer)
        probe.remove()
        best: Optional[Tuple[float, Candidate]] = None
        for candidate in _candidates(*circles[index], size.width + 2, size.height + 2):
            cost = _cost(candidate[0], index, circles, taken, ax.bbox, lines)
            if best is None or cost + candidate[5] / 1000 < best[0]:
                best = (cost + candidate[5] / 1000, candidate)
            if cost == 0:
                break
        assert best is not None
        box, px, py, ha, va, distance = best[1]
        taken.append(box)
        cx, cy, r = circles[index]
        leader = dict(arrowstyle="-", color="dimgray", linewidth=0.6, shrinkA=0, shrinkB=radius)
        labels[index] = ax.annotate(text, (x, y), xytext=((px - cx) / scale, (py - cy) / scale),
                                    textcoords="offset points", ha=ha, va=va, fontsize=LABEL_SIZE,
                                    arrowprops=None if "center" in (ha, va) and distance < r + 4 else leader)
    return labels


def _draw_floor(ax: Any, level: float) -> None:
    """Uniform attention's error as a dotted line, the errors beyond it shaded: the floor of quality."""
    ax.axhline(level, color="gray", linestyle=":", linewidth=1.5)
    ax.autoscale_view()
    low, high = sorted(ax.get_ylim())
    ax.axhspan(level, high, color="gray", alpha=0.1, linewidth=0)
    ax.set_ylim(high, low)  # errors grow downwards: better is up


def _floor_label(ax: Any, level: float, circles: Sequence[Tuple[float, float, float]]) -> Bbox:
    """The floor's label, at whichever end of its line, above or below it, covers fewest bubbles. Returns the
    label's box."""
    renderer = ax.figure.canvas.get_renderer()
    best = None
    for x, ha in ((0.01, "left"), (0.99, "right")):
        for dy, va in ((3, "bottom"), (-3, "top")):
            label = ax.annotate(UNIFORM_LABEL, (x, level), xycoords=("axes fraction", "data"), xytext=(0, dy),
                                textcoords="offset points", ha=ha, va=va, fontsize=LABEL_SIZE, color="dimgray")
            box = label.get_window_extent(renderer)
            covered = sum(_circle_overlaps(box, circle) for circle in circles)
            if best is None or covered < best[0]:
                if best is not None:
                    best[1].remove()
                best = (covered, label, box)
            else:
                label.remove()
    assert best is not None
    return best[2]


def _kind_place(kind: Optional[str]) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def _legends(ax: Any, kinds: Sequence[Optional[str]], peers: bool, memory: Sequence[float]) -> None:
    """Beside the axes: the kinds' colours, and the bubble area of the least, middle and most memory."""
    handles = [ax.scatter([], [], s=60, color=KIND_COLORS.get(kind, OTHER_COLOR), alpha=0.45, edgecolors="black",
                          label=KIND_NAMES.get(kind, "kind not recorded")) for kind in sorted(set(kinds), key=_kind_place)]
    if peers:
        handles.append(ax.scatter([], [], s=60, color="white", edgecolors="black", linestyle="--",
                                  label="peer library (dashed edge)"))
    legend = ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False,
                       title="colour", title_fontsize=8, alignment="left")
    ax.add_artist(legend)
    largest = max(max(memory), 1e-9)
    references = sorted({min(memory), sorted(memory)[len(memory) // 2], largest})
    sized = [ax.scatter([], [], s=SMALLEST + (LARGEST - SMALLEST) * m / largest, color="gray", alpha=0.4,
                        edgecolors="black", label=f"{m:.1f} MiB") for m in references]
    diameter = math.sqrt(LARGEST) / 8  # in font sizes (8 points)
    ax.legend(handles=sized, loc="upper left", bbox_to_anchor=(1.02, 0.62), fontsize=8, frameon=False,
              title="peak memory (bubble area)", title_fontsize=8, alignment="left", handlelength=diameter + 0.5,
              labelspacing=diameter * 0.8, borderpad=diameter * 0.3, handletextpad=0.6)


def draw_bubble(data: Dict[str, Any],
                accuracy: Optional[Dict[str, float]] = None) -> Optional[Tuple[Any, Dict[str, Any]]]:
    """bubble.png, unsaved: the figure and each bubble's label by mechanism, or None with nothing to draw."""
    length = _bubble_length(data)
    points, notes = _choose(data, accuracy, length)
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(10.5, 7.0), dpi=DPI)
    fig.subplots_adjust(left=0.09, right=0.76, top=0.89, bottom=0.1)
    speed = [row["batch"] * row["length"] / (row["forward_backward_ms"] / 1e3) for row, _ in points]
    memory = [row["peak_memory_mib"] for row, _ in points]
    largest = max(max(memory), 1e-9)
    sizes = [SMALLEST + (LARGEST - SMALLEST) * m / largest for m in memory]  # area proportional to memory
    for (row, quality), x, size in zip(points, speed, sizes):
        peer = not row_is_own(row["mechanism"])
        ax.scatter([x], [quality], s=size, color=KIND_COLORS.get(row.get("kind"), OTHER_COLOR), alpha=0.45,
                   edgecolors="black", linewidths=0.8, linestyle="--" if peer else "-", zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel(f"speed: tokens per second, forward+backward at N={length} (log; faster to the right)")
    if accuracy:
        ax.set_ylabel("accuracy (from --accuracy; higher is better)")
    else:
        ax.set_yscale("log")
        ax.set_ylabel("relative error against exact softmax (log, measured values; better is up)")
    ax.margins(0.08)
    uniform = None if accuracy else next((item["error"] for item in data.get("uniform_error", [])
                                          if item["length"] == length and item.get("error")), None)
    if uniform:
        _draw_floor(ax, uniform)
    elif not accuracy:
        ax.invert_yaxis()
    ax.grid(True, which="both", alpha=0.3)
    _legends(ax, [row.get("kind") for row, _ in points], any(not row_is_own(r["mechanism"]) for r, _ in points),
             memory)
    fig.canvas.draw()  # settles the limits: the labels are placed against them
    plain_log_ticks(ax.xaxis)
    if not accuracy:
        plain_log_ticks(ax.yaxis)
    circles = [(*ax.transData.transform((x, q)), math.sqrt(s) / 2 * fig.dpi / 72)
               for (_, q), x, s in zip(points, speed, sizes)]
    taken = [_floor_label(ax, uniform, circles)] if uniform else []
    lines = []
    if uniform:
        level = ax.transData.transform((1.0, uniform))[1]
        lines.append(Bbox([[ax.bbox.x0, level - 1], [ax.bbox.x1, level + 1]]))
    items = []
    for (row, quality), x, size in zip(points, speed, sizes):
        exact = not accuracy and quality < ROUNDING
        items.append((row["mechanism"] + (" (exact: rounding error)" if exact else ""), x, quality,
                      math.sqrt(size) / 2))
    labels = place_labels(ax, items, taken, lines)
    quality_name = "accuracy" if accuracy else "approximation error"
    fig.suptitle(f"Speed against {quality_name}, bubble area = peak memory (N={length})\n{subtitle(data)}",
                 fontsize=10)
    if notes:
        fig.text(0.09, 0.035, "Not shown: " + "\n".join(notes), fontsize=8, ha="left", va="top")
    return fig, {row["mechanism"]: label for (row, _), label in zip(points, labels)}


def plot_bubble(data: Dict[str, Any], path: Path, accuracy: Optional[Dict[str, float]] = None) -> None:
    """Speed against quality with bubble area proportional to peak memory, at the longest softmax length."""
    drawn = draw_bubble(data, accuracy)
    if drawn is None:
        message_figure(path, "Speed, quality and memory", "Nothing to plot: no mechanism has both a time and a "
                       "quality measurement." if _bubble_length(data) else "Softmax, the baseline, was not measured.")
        return
    fig, _ = drawn
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
