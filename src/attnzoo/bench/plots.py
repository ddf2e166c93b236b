"""The PNG figures of ``attnzoo compare`` (matplotlib, Agg backend: no display needed).

time.png    time against N, log-log: a row of panels per family of mechanisms (forward, forward+backward),
            softmax in every panel as the reference, each line named at its end
memory.png  peak memory against N, log-log, panelled as time.png (inference, training)
error.png   error against exact softmax as the feature count / rank grows (at each logit spread swept), and
            against N, for approximate mechanisms; uniform attention's error drawn as the floor; a caption
            saying what the error is and why some approximations sit above that floor
bubble.png  speed (x) against quality (y), bubble area = peak memory, as in the Long Range Arena paper
            (:mod:`attnzoo.bench.bubble`)
"""

from __future__ import annotations

import multiprocessing
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from ..mechanisms import APPROXIMATE  # noqa: E402
from .bubble import plot_bubble  # noqa: E402
from .plot_parts import (  # noqa: E402
    DPI,
    baseline_style,
    end_label,
    label_line_ends,
    message_figure,
    panel_styles,
    panels,
    plain_log_ticks,
    row_is_own,
    row_kind,
    subtitle,
)
from .results import BASELINE  # noqa: E402

__all__ = ["plot_bubble", "plot_error", "plot_memory", "plot_time", "write_plots"]

PANEL_HEIGHT = 2.9  # inches per row of panels
FIGURE_WIDTH = 13.0  # inches: two panels, each with its lines' names in the margin to its right
UNIFORM_COLOR = "gray"
UNIFORM_LABEL = "uniform attention (floor)"
Columns = Sequence[Tuple[str, str]]  # (column of results.json, the panel's heading)
TIME_COLUMNS = (("forward_ms", "forward"), ("forward_backward_ms", "forward + backward"))
MEMORY_COLUMNS = (("forward_peak_memory_mib", "forward (inference)"),
                  ("peak_memory_mib", "forward + backward (training)"))


def _series(rows: Sequence[Dict[str, Any]], column: str) -> Dict[str, Tuple[List[int], List[float]]]:
    series: Dict[str, Tuple[List[int], List[float]]] = {}
    for row in sorted(rows, key=lambda row: row["length"]):
        xs, ys = series.setdefault(row["mechanism"], ([], []))
        if row.get(column) is not None and row[column] > 0:
            xs.append(row["length"])
            ys.append(row[column])
    return series


def _stop_notes(rows: Sequence[Dict[str, Any]]) -> Dict[str, str]:
    """Mechanism -> why its line ends early ("oom at 4096"), for its label."""
    notes: Dict[str, str] = {}
    for row in sorted(rows, key=lambda row: row["length"]):
        if row["status"] in ("oom", "timeout", "failed", "unsupported") and row["mechanism"] not in notes:
            kind = {"timeout": "too slow", "unsupported": "unsupported"}.get(row["status"], row["status"])
            notes[row["mechanism"]] = f"{kind} at N={row['length']}"
    return notes


def _length_axis(ax: Any, lengths: Sequence[int]) -> None:
    """A log axis with a tick at each length, the last near the right edge where the lines' names begin."""
    ax.set_xscale("log", base=2)
    ax.set_xlim(lengths[0] / (1.12 if len(lengths) > 1 else 2.0), lengths[-1] * 1.12)
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths])
    ax.grid(True, which="both", alpha=0.3)


def _draw_panel(ax: Any, series: Dict[str, Tuple[List[int], List[float]]], units: Sequence[Sequence[str]],
                notes: Dict[str, str]) -> List[Tuple[str, float, float, Any]]:
    """Softmax and each unit's lines; returns the line ends to label."""
    styles = panel_styles(units)
    ends = []
    for name in [BASELINE] + [name for unit in units for name in unit]:
        xs, ys = series.get(name, ([], []))
        if xs:
            ax.plot(xs, ys, markersize=4, **styles[name])
            ends.append((end_label(name, notes.get(name)), xs[-1], ys[-1], styles[name]["color"]))
    return ends


def _missing_note(rows: Sequence[Dict[str, Any]], columns: Columns) -> str:
    """The mechanisms with no point at all in a column, and why."""
    parts = []
    for column, heading in columns:
        series = _series(rows, column)
        missing = []
        for name, (xs, _) in series.items():
            if not xs:
                row = next(row for row in rows if row["mechanism"] == name)
                missing.append(f"{name} ({row['reason'] or row['status']})")
        if missing:
            parts.append(f"no {heading} measurement: " + "; ".join(missing))
    return "\n".join(textwrap.fill(part, 190) for part in parts)


def draw_lines(data: Dict[str, Any], columns: Columns, ylabel: str, title: str) -> Tuple[Any, Dict[Any, List[Any]]]:
    """time.png or memory.png, unsaved: a row of panels per family (:func:`~attnzoo.bench.plot_parts.panels`),
    a column per measure. Returns the figure and each panel's line labels, by (row, column)."""
    rows = data["rows"]
    groups = panels(rows) or [("softmax alone", [])]
    height = PANEL_HEIGHT * len(groups) + 1.5
    fig, axes = plt.subplots(len(groups), len(columns), figsize=(FIGURE_WIDTH, height), sharex=True,
                             sharey=True, squeeze=False, dpi=DPI)
    fig.subplots_adjust(left=0.065, right=0.865, top=1 - 1.15 / height, bottom=0.55 / height, wspace=0.62,
                        hspace=0.55)
    notes = _stop_notes(rows)
    lengths = sorted({row["length"] for row in rows})
    ends = {}
    for index, (column, heading) in enumerate(columns):
        series = _series(rows, column)
        for place, (group, units) in enumerate(groups):
            ax = axes[place][index]
            ends[place, index] = _draw_panel(ax, series, units, notes)
            ax.set_title(heading, fontsize=9, loc="left", pad=3)
            ax.set_yscale("log")
            _length_axis(ax, lengths)
            ax.tick_params(labelbottom=True, labelleft=True, labelsize=8)
            if index == 0:  # the family over its row of panels, the measure's name beside it
                ax.annotate(group, (0, 1), xycoords="axes fraction", xytext=(0, 17), textcoords="offset points",
                            fontsize=10, fontweight="bold", ha="left", va="bottom")
                ax.set_ylabel(ylabel, fontsize=9)
        axes[-1][index].set_xlabel("sequence length N")
    plain_log_ticks(axes[0][0].yaxis)
    for ax in axes.flat:  # settles the limits (autoscaling runs on this first read): the labels are placed
        ax.get_xlim(), ax.get_ylim()  # against them; cheaper than drawing the figure one more time
    labels = {key: label_line_ends(axes[key[0]][key[1]], found) for key, found in ends.items()}
    key = "softmax (black) in every panel as the reference"
    if any(not row_is_own(row["mechanism"]) for row in rows):
        key += "; dashed with hollow markers: a peer library, in its attnzoo counterpart's colour"
    fig.suptitle(f"{title}\n{key}\n{subtitle(data)}", fontsize=10, y=1 - 0.1 / height, va="top")
    note = _missing_note(rows, columns)
    if note:
        fig.text(0.065, 0.05 / height, note, fontsize=8, ha="left", va="top")
    return fig, labels


def _any_point(data: Dict[str, Any], columns: Columns) -> bool:
    return any(xs for column, _ in columns for xs, _ in _series(data["rows"], column).values())


def plot_time(data: Dict[str, Any], path: Path) -> None:
    if not _any_point(data, TIME_COLUMNS):
        message_figure(path, "Time against sequence length", "No configuration was timed.")
        return
    fig, _ = draw_lines(data, TIME_COLUMNS, "median time per call (ms)",
                        "Time against sequence length (lower is faster)")
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


def plot_memory(data: Dict[str, Any], path: Path) -> None:
    if not _any_point(data, MEMORY_COLUMNS):
        message_figure(path, "Peak memory against sequence length", "No configuration had its memory measured.")
        return
    method = "GPU allocator peak" if data["config"]["device"].startswith("cuda") else "resident-set peak"
    fig, _ = draw_lines(data, MEMORY_COLUMNS, "peak memory above inputs (MiB)",
                        f"Peak memory against sequence length ({method}, each configuration in a fresh process)")
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


def _floor(ax: Any, xs: Sequence[float], ys: Sequence[float]) -> Tuple[str, float, float, Any]:
    """Uniform attention's error (the output of attention that ignores q and k) as a dotted line, the region
    above it shaded: no better than that floor. Returns its line end, to label with the lines."""
    xlim = ax.get_xlim()
    across, levels = [xlim[0], *xs, xlim[1]], [ys[0], *ys, ys[-1]]  # from edge to edge
    ax.plot(across, levels, color=UNIFORM_COLOR, linestyle=":", linewidth=1.6)
    ylim = ax.get_ylim()
    ax.fill_between(across, levels, max(ylim[1], max(ys) * 1.5), color=UNIFORM_COLOR, alpha=0.12, linewidth=0)
    ax.set_xlim(xlim)
    ax.set_ylim(ylim[0], max(ylim[1], max(ys) * 1.5))
    return UNIFORM_LABEL, xs[-1], ys[-1], UNIFORM_COLOR


def _logit_std(sweep: Dict[str, Any]) -> float:
    """The logit spread a sweep was measured at (results written before it was recorded: 1, the timing inputs')."""
    return float(sweep.get("logit_std", 1.0))


def _sweep_name(sweep: Dict[str, Any]) -> str:
    return f"{sweep['mechanism']} ({sweep['option']})"


def _sweep_panel(ax: Any, sweeps: Sequence[Dict[str, Any]], styles: Dict[str, Dict[str, Any]],
                 logit_std: float) -> List[Tuple[str, float, float, Any]]:
    """Error against each sweep's option (features, rank, landmarks) at one logit spread; returns the line
    ends to label."""
    ends = []
    for sweep in sweeps:
        name, style = _sweep_name(sweep), styles[sweep["mechanism"]]
        points = [p for p in sweep["points"] if p.get("error")]
        xs, ys = [p["value"] for p in points], [p["error"] for p in points]
        ax.plot(xs, ys, markersize=5, **style)
        ends.append((name, xs[-1], ys[-1], style["color"]))
    values = sorted({p["value"] for sweep in sweeps for p in sweep["points"]})
    _length_axis(ax, values)
    ax.set_yscale("log")
    uniform = next((sweep["uniform_error"] for sweep in sweeps if sweep.get("uniform_error")), None)
    if uniform:
        ends.append(_floor(ax, [values[0], values[-1]], [uniform, uniform]))
    plain_log_ticks(ax.yaxis)
    inputs = "the timing inputs" if logit_std == 1.0 else "q, k scaled down: a flatter softmax"
    ax.set_title(f"against feature count / rank, N={sweeps[0]['length']}, logit std {logit_std:g} ({inputs})",
                 fontsize=10)
    ax.set_xlabel("features / rank / landmarks (the mechanism's option)")
    ax.set_ylabel("relative error ||out - softmax|| / ||softmax||")
    return ends


def _length_panel(ax: Any, data: Dict[str, Any], rows: Sequence[Dict[str, Any]],
                  styles: Dict[str, Dict[str, Any]]) -> List[Tuple[str, float, float, Any]]:
    """Error against N at default options; returns the line ends to label."""
    series = _series(rows, "error")
    ends = []
    for name, (xs, ys) in series.items():
        if xs:
            ax.plot(xs, ys, markersize=5, **styles.get(name, baseline_style()))
            ends.append((name, xs[-1], ys[-1], styles.get(name, baseline_style())["color"]))
    _length_axis(ax, sorted({row["length"] for row in data["rows"]}))
    ax.set_yscale("log")
    uniform = sorted((item["length"], item["error"]) for item in data.get("uniform_error", []) if item.get("error"))
    if uniform:
        ends.append(_floor(ax, [n for n, _ in uniform], [e for _, e in uniform]))
    plain_log_ticks(ax.yaxis)
    ax.set_xlabel("sequence length N (default options)")
    ax.set_ylabel("relative error against exact softmax")
    ax.set_title("against sequence length, logit std 1 (the timing inputs)", fontsize=10)
    return ends


ERROR_CAPTION = (
    "error = |output - softmax's output| / |softmax's output| (Frobenius norms over the batch; exact softmax in "
    "float64) on the same random q, k, v. Dotted, shaded above: uniform attention, which ignores q and k; an "
    "approximation above it tells less about q and k than a plain average.\n\n"
    "Why some sit above that floor at logit std 1: standard-normal q and k at head dim d have |q|^2/sqrt(d) "
    "near sqrt(d) (8 at d = 64), and positive random features (Performer's FAVOR+) estimate exp(q.k/sqrt(d)) "
    "with a variance growing like exp(|q|^2/sqrt(d) + |k|^2/sqrt(d)), so a few hundred features are far off. "
    "With q and k scaled so that the logits spread 0.25, softmax is flatter and the estimates close in as "
    "features grow. Transformer-VQ's codebook is its untrained initial one here. Trained models' q and k are "
    "neither isotropic nor that long: accuracy after training (attnzoo lra, --accuracy) measures quality."
)


def draw_error(data: Dict[str, Any]) -> Optional[Tuple[Any, List[Any]]]:
    """error.png, unsaved: the figure and its line labels, or None when no approximate mechanism has an error.

    One panel per logit spread of the sweeps (error against the feature count / rank; none when the run swept
    nothing), one of error against N at default options, and the caption saying what the error is and why some
    approximations sit above the floor; two panels a row."""
    sweeps = [sweep for sweep in data.get("sweeps", []) if any(p.get("error") for p in sweep["points"])]
    rows = [row for row in data["rows"] if row_kind(row) == APPROXIMATE and row.get("error")]
    if not sweeps and not rows:
        return None
    stds = sorted({_logit_std(sweep) for sweep in sweeps}, reverse=True)  # none: the run swept nothing
    # One style per mechanism in every panel; a peer library takes its counterpart's, hollow.
    units = [unit for _, units in panels(rows) for unit in units]
    units += [[name] for name in dict.fromkeys(sweep["mechanism"] for sweep in sweeps)
              if not any(name in unit for unit in units)]
    styles = panel_styles(units)
    rows_of_panels = (len(stds) + 3) // 2  # the sweeps, the length panel and the caption, two a row
    fig, axes = plt.subplots(rows_of_panels, 2, figsize=(FIGURE_WIDTH, 4.6 * rows_of_panels + 0.6), dpi=DPI,
                             squeeze=False)
    fig.subplots_adjust(left=0.07, right=0.86, top=1 - 0.75 / (4.6 * rows_of_panels + 0.6), bottom=0.07,
                        wspace=0.62, hspace=0.42)
    cells = list(axes.flat)
    ends = [_sweep_panel(ax, [s for s in sweeps if _logit_std(s) == std], styles, std)
            for ax, std in zip(cells, stds)]
    length_ax = cells[len(stds)]
    ends.append(_length_panel(length_ax, data, rows, styles))
    for ax in cells[len(stds) + 1:]:
        ax.axis("off")
    caption = cells[-1]
    caption.text(0.0, 1.0, "\n".join(textwrap.fill(part, 62) for part in ERROR_CAPTION.split("\n")),
                 transform=caption.transAxes, va="top", ha="left", fontsize=8.5)
    for ax in axes.flat:  # settles the limits (autoscaling runs on this first read): the labels are placed
        ax.get_xlim(), ax.get_ylim()  # against them; cheaper than drawing the figure one more time
    drawn = cells[:len(stds) + 1]
    labels = [label for ax, found in zip(drawn, ends) for label in label_line_ends(ax, found)]
    fig.suptitle("Approximation error against exact softmax on the same random inputs (lower is better; shaded: "
                 "no better than the floor, uniform attention)\n" + subtitle(data), fontsize=10)
    return fig, labels


def plot_error(data: Dict[str, Any], path: Path) -> None:
    """Error against the swept option (left) and, for approximate mechanisms, against N (right)."""
    drawn = draw_error(data)
    if drawn is None:
        message_figure(path, "Approximation error against exact softmax",
                       "No approximate mechanism was measured,\nso there is no approximation error to show.")
        return
    fig, _ = drawn
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


def write_plots(data: Dict[str, Any], output: Path, accuracy: Optional[Dict[str, float]] = None) -> Dict[str, Path]:
    """All four figures in ``output``; returns their paths by name."""
    output.mkdir(parents=True, exist_ok=True)
    paths = {name: output / f"{name}.png" for name in ("time", "memory", "error", "bubble")}
    # memory.png is drawn in a forked child meanwhile where the platform forks: the two tall figures take
    # most of the seconds, and the cores are idle once the measurements are done.
    child = _start_child(plot_memory, data, paths["memory"])
    plot_time(data, paths["time"])
    plot_error(data, paths["error"])
    plot_bubble(data, paths["bubble"], accuracy)
    if child is None or not _child_succeeded(child):
        plot_memory(data, paths["memory"])  # no fork, or the child failed: drawn here, its error raised here
    return paths


def _start_child(plot: Any, data: Dict[str, Any], path: Path) -> Optional[Any]:
    if "fork" not in multiprocessing.get_all_start_methods():
        return None
    child = multiprocessing.get_context("fork").Process(target=plot, args=(data, path), daemon=True)
    child.start()
    return child


def _child_succeeded(child: Any) -> bool:
    child.join()
    return child.exitcode == 0
