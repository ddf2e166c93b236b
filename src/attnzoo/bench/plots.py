"""The PNG figures of ``attnzoo compare`` (matplotlib, Agg backend: no display needed).

time.png    time against N, log-log, one line per mechanism (forward and forward+backward panels)
memory.png  peak memory against N, log-log
error.png   error against exact softmax as the feature count / rank grows, for approximate mechanisms
bubble.png  speed (x) against quality (y), bubble area = peak memory, as in the Long Range Arena paper
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib import ticker  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from ..mechanisms import APPROXIMATE, OWN  # noqa: E402
from .results import BASELINE  # noqa: E402

EXACT_FLOOR = 1e-3  # errors below this are rounding; plotted at this floor and labelled exact


def _subtitle(data: Dict[str, Any]) -> str:
    config, machine = data["config"], data["machine"]
    return (f"batch {config['batch']}, {config['heads']} heads, head dim {config['head_dim']}, {config['dtype']}, "
            f"{'causal' if config['causal'] else 'non-causal'}; {machine['cpu']}, {machine['threads']} threads, "
            f"torch {machine['torch']}")


def _styles(rows: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """One colour per attnzoo mechanism; a peer takes its counterpart's colour, hollow markers, dashed line."""
    palette = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    markers = "osD^v<>pPX*h"
    counterparts = {row["mechanism"]: row.get("counterpart") for row in rows}
    names = list(counterparts)
    own = [name for name in names if row_is_own(name)]
    styles: Dict[str, Dict[str, Any]] = {}
    for index, name in enumerate(own):
        styles[name] = dict(color="black" if name == BASELINE else palette[index % len(palette)],
                            marker=markers[index % len(markers)], linestyle="-",
                            linewidth=2.6 if name == BASELINE else 1.6)
    spare = len(own)
    for index, name in enumerate(n for n in names if not row_is_own(n)):
        twin = styles.get(counterparts[name] or "")
        if twin is not None:
            color = twin["color"]
        else:
            color, spare = palette[spare % len(palette)], spare + 1
        styles[name] = dict(color=color, marker=markers[(index + 3) % len(markers)], linestyle="--", linewidth=1.3,
                            markerfacecolor="white")
    return styles


def row_is_own(name: str) -> bool:
    return not name.startswith("peer:")


def _plain_log_ticks(axis: Any) -> None:
    """Log axis ticks as plain numbers (0.01, 1, 100) rather than powers of ten."""
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    low, high = sorted(abs(v) for v in axis.get_view_interval())
    decades = math.log10(high / low) if low > 0 else 10.0
    # Within about two decades 1-2-5 ticks keep the axis readable; wider ranges get one tick per decade.
    axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades < 2.5 else (1.0,)))
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(ticker.NullFormatter())


def _place_labels(fig: Any, ax: Any, items: Sequence[Tuple[str, float, float, float]]) -> None:
    """Label each bubble (text, x, y, radius in points) beside it, on the first side that covers neither an
    earlier label nor another bubble."""
    fig.canvas.draw()  # settles the layout, so positions measured now are final
    renderer = fig.canvas.get_renderer()
    pixels_per_point = fig.dpi / 72
    bubbles = []
    for _, x, y, radius in items:
        cx, cy = ax.transData.transform((x, y))
        r = radius * pixels_per_point
        bubbles.append(Bbox([[cx - r, cy - r], [cx + r, cy + r]]))
    taken: List[Any] = []
    for text, x, y, radius in items:
        gap = radius + 3
        best = None
        for dx, dy, ha, va in ((gap, 0, "left", "center"), (-gap, 0, "right", "center"),
                               (0, gap, "center", "bottom"), (0, -gap, "center", "top")):
            label = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                                fontsize=8)
            box = label.get_window_extent(renderer)
            collisions = sum(box.overlaps(other) for other in taken + bubbles)
            collisions += 0 if ax.bbox.containsx(box.x0) and ax.bbox.containsx(box.x1) else 2
            if best is None or collisions < best[0]:
                if best is not None:
                    best[1].remove()
                best = (collisions, label, box)
            else:
                label.remove()
            if collisions == 0:
                break
        assert best is not None
        taken.append(best[2])


def _series(rows: Sequence[Dict[str, Any]], column: str) -> Dict[str, Tuple[List[int], List[float]]]:
    series: Dict[str, Tuple[List[int], List[float]]] = {}
    for row in sorted(rows, key=lambda row: row["length"]):
        xs, ys = series.setdefault(row["mechanism"], ([], []))
        if row.get(column) is not None and row[column] > 0:
            xs.append(row["length"])
            ys.append(row[column])
    return series


def _stop_notes(rows: Sequence[Dict[str, Any]]) -> Dict[str, str]:
    """Mechanism -> why its line ends early ("oom at 4096"), for the legend."""
    notes: Dict[str, str] = {}
    for row in sorted(rows, key=lambda row: row["length"]):
        if row["status"] in ("oom", "timeout", "failed", "unsupported") and row["mechanism"] not in notes:
            kind = {"timeout": "too slow", "unsupported": "unsupported"}.get(row["status"], row["status"])
            notes[row["mechanism"]] = f"{kind} at N={row['length']}"
    return notes


def _lines_panel(ax: Any, data: Dict[str, Any], column: str, styles: Dict[str, Dict[str, Any]], ylabel: str,
                 title: str) -> None:
    notes = _stop_notes(data["rows"])
    for name, (xs, ys) in _series(data["rows"], column).items():
        label = f"{name} ({notes[name]})" if name in notes else name
        if xs:
            ax.plot(xs, ys, label=label, markersize=5, **styles[name])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    lengths = sorted({row["length"] for row in data["rows"]})
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])


def _legend_right(fig: Any, ax: Any, data: Dict[str, Any], column: str) -> None:
    """The legend beside the panels, and below them the mechanisms that have no point at all, and why."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.995, 0.5), fontsize=8, frameon=False)
    missing = []
    for name, (xs, _) in _series(data["rows"], column).items():
        if not xs:
            row = next(row for row in data["rows"] if row["mechanism"] == name)
            missing.append(f"{name}: {row['reason'] or row['status']}")
    if missing:
        fig.text(0.01, -0.02, "not shown: " + "; ".join(missing), fontsize=8, ha="left", va="top", wrap=True)


def plot_time(data: Dict[str, Any], path: Path) -> None:
    styles = _styles(data["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    _lines_panel(axes[0], data, "forward_ms", styles, "median time per call (ms)", "forward")
    _lines_panel(axes[1], data, "forward_backward_ms", styles, "median time per call (ms)", "forward + backward")
    fig.suptitle(f"Time against sequence length (lower is faster)\n{_subtitle(data)}", fontsize=10)
    _legend_right(fig, axes[1], data, "forward_backward_ms")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_memory(data: Dict[str, Any], path: Path) -> None:
    styles = _styles(data["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    _lines_panel(axes[0], data, "forward_peak_memory_mib", styles, "peak memory above inputs (MiB)",
                 "forward (inference, no autograd graph)")
    _lines_panel(axes[1], data, "peak_memory_mib", styles, "peak memory above inputs (MiB)",
                 "forward + backward (training)")
    method = "GPU allocator peak" if data["config"]["device"].startswith("cuda") else "resident-set peak"
    fig.suptitle(f"Peak memory against sequence length ({method}, each configuration in a fresh process)\n"
                 f"{_subtitle(data)}", fontsize=10)
    _legend_right(fig, axes[1], data, "peak_memory_mib")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _message_figure(path: Path, title: str, message: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, fontsize=11)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_error(data: Dict[str, Any], path: Path) -> None:
    """Error against the swept option (left) and, for approximate mechanisms, against N (right)."""
    sweeps = [sweep for sweep in data.get("sweeps", []) if any(p.get("error") for p in sweep["points"])]
    approximate_rows = [row for row in data["rows"] if row.get("kind") == APPROXIMATE and row.get("error")]
    if not sweeps and not approximate_rows:
        _message_figure(path, "Approximation error against exact softmax",
                        "No approximate mechanism was measured,\nso there is no approximation error to show.")
        return
    styles = _styles(data["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    ax = axes[0]
    uniform_levels = []
    for sweep in sweeps:
        points = [p for p in sweep["points"] if p.get("error")]
        style = dict(styles.get(sweep["mechanism"], {}), linestyle="-")
        ax.plot([p["value"] for p in points], [p["error"] for p in points], markersize=5,
                label=f"{sweep['mechanism']} ({sweep['option']})", **style)
        if sweep.get("uniform_error"):
            uniform_levels.append(sweep["uniform_error"])
    if uniform_levels:
        ax.axhline(uniform_levels[0], color="gray", linestyle=":", linewidth=1.5,
                   label="uniform attention (ignores q, k)")
    if sweeps:
        values = sorted({p["value"] for sweep in sweeps for p in sweep["points"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(values)
        ax.set_xticklabels([str(v) for v in values])
        ax.set_yscale("log")
        _plain_log_ticks(ax.yaxis)
        ax.legend(fontsize=8)
        ax.set_title(f"error against feature count / rank at N={sweeps[0]['length']}")
    else:
        ax.axis("off")
        ax.text(0.5, 0.5, "no approximate mechanism takes a\nfeature-count or rank option", ha="center",
                va="center")
    ax.set_xlabel("features / rank / landmarks (the mechanism's option)")
    ax.set_ylabel("relative error ||out - softmax|| / ||softmax||")
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[1]
    for name, (xs, ys) in _series(approximate_rows, "error").items():
        ax.plot(xs, ys, label=name, markersize=5, **styles[name])
    uniform = [(item["length"], item["error"]) for item in data.get("uniform_error", []) if item.get("error")]
    if uniform:
        ax.plot(*zip(*uniform), color="gray", linestyle=":", linewidth=1.5, label="uniform attention")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis)
    lengths = sorted({row["length"] for row in data["rows"]})
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])
    ax.set_xlabel("sequence length N (default options)")
    ax.set_ylabel("relative error against exact softmax")
    ax.set_title("error against sequence length")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.suptitle("Approximation error against exact softmax on the same random inputs (lower is better; "
                 "above the dotted line the output carries less about q, k than a plain average)\n"
                 + _subtitle(data), fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _bubble_length(data: Dict[str, Any]) -> Optional[int]:
    """The longest length at which softmax was measured: every ratio there has its baseline."""
    measured = [row["length"] for row in data["rows"] if row["mechanism"] == BASELINE and row["forward_backward_ms"]]
    return max(measured) if measured else None


def plot_bubble(data: Dict[str, Any], path: Path, accuracy: Optional[Dict[str, float]] = None) -> None:
    """Speed against quality with bubble area proportional to peak memory, at the longest softmax length."""
    length = _bubble_length(data)
    rows = [row for row in data["rows"] if row["length"] == length and row["forward_backward_ms"]
            and row["peak_memory_mib"] is not None]
    own = sorted({row["mechanism"] for row in rows if row.get("kind") == OWN})
    if accuracy:
        points = [(row, accuracy[row["mechanism"]]) for row in rows if row["mechanism"] in accuracy]
        ylabel, title_quality = "accuracy (from --accuracy; higher is better)", "accuracy"
    else:
        # An attention of its own has no approximation error: its distance from softmax is no quality measure.
        points = [(row, max(row["error"], EXACT_FLOOR)) for row in rows
                  if row.get("error") is not None and row.get("kind") != OWN]
        ylabel, title_quality = "relative error against exact softmax (log; better is up)", "approximation error"
    if not points:
        _message_figure(path, "Speed, quality and memory", "Nothing to plot: no mechanism has both a time and a "
                        "quality measurement." if length else "Softmax, the baseline, was not measured.")
        return
    tokens_per_s = [row["batch"] * row["length"] / (row["forward_backward_ms"] / 1e3) for row, _ in points]
    memory = [row["peak_memory_mib"] for row, _ in points]
    largest = max(max(memory), 1e-9)
    sizes = [60 + 2400 * m / largest for m in memory]  # area proportional to memory, smallest still visible
    styles = _styles(data["rows"])
    fig, ax = plt.subplots(figsize=(10, 6.5), constrained_layout=True)
    labels = []
    for (row, quality), x, size in zip(points, tokens_per_s, sizes):
        style = styles[row["mechanism"]]
        ax.scatter([x], [quality], s=size, color=style["color"], alpha=0.45, edgecolors="black", linewidths=0.8,
                   linestyle="--" if style["linestyle"] == "--" else "-")
        label = row["mechanism"] + (" (exact)" if not accuracy and row["error"] < EXACT_FLOOR else "")
        labels.append((label, x, quality, math.sqrt(size / math.pi)))  # radius in points of this area
    ax.set_xscale("log")
    ax.set_xlabel(f"speed: tokens per second, forward+backward at N={length} (log; faster to the right)")
    ax.set_ylabel(ylabel)
    if not accuracy:
        ax.set_yscale("log")
        ax.invert_yaxis()
        _plain_log_ticks(ax.yaxis)
        uniform = next((item["error"] for item in data.get("uniform_error", [])
                        if item["length"] == length and item.get("error")), None)
        if uniform:
            ax.axhline(uniform, color="gray", linestyle=":", linewidth=1.5)
            ax.annotate("uniform attention (ignores q, k)", (0.01, uniform), xycoords=("axes fraction", "data"),
                        xytext=(0, 3), textcoords="offset points", fontsize=8, color="dimgray")
    _plain_log_ticks(ax.xaxis)
    ax.grid(True, which="both", alpha=0.3)
    for reference in sorted({min(memory), largest}):
        ax.scatter([], [], s=60 + 2400 * reference / largest, color="gray", alpha=0.4, edgecolors="black",
                   label=f"{reference:.1f} MiB")
    ax.legend(title="peak memory (bubble area)", loc="best", fontsize=8, labelspacing=2.2, borderpad=1.2)
    ax.margins(0.15)
    _place_labels(fig, ax, labels)
    note = ("\nnot shown, as attentions of their own have no approximation error (give --accuracy to place them): "
            + ", ".join(own) if not accuracy and own else "")
    fig.suptitle(f"Speed against {title_quality}, bubble area = peak memory (N={length})\n{_subtitle(data)}"
                 + note, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_plots(data: Dict[str, Any], output: Path, accuracy: Optional[Dict[str, float]] = None) -> Dict[str, Path]:
    """All four figures in ``output``; returns their paths by name."""
    output.mkdir(parents=True, exist_ok=True)
    paths = {name: output / f"{name}.png" for name in ("time", "memory", "error", "bubble")}
    plot_time(data, paths["time"])
    plot_memory(data, paths["memory"])
    plot_error(data, paths["error"])
    plot_bubble(data, paths["bubble"], accuracy)
    return paths

