"""The terminal tables of ``attnzoo compare``: one block per length, then crossovers per mechanism."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..mechanisms import OWN
from .results import BASELINE, busy_warning, describe_crossover

# Wide enough for a whole peer comparison ("attnzoo X's time is 0.53x some-peer-library's, ...").
NOTE_WIDTH = 90

NOISY_SPREAD = 0.25  # interquartile range over median above which a row's timing is flagged

EXACT_BELOW = 1e-3  # relative errors under this are float rounding: the mechanism computes softmax


def format_error(row: Dict[str, Any]) -> str:
    """Relative error against softmax; "exact" for rounding-level errors, a star for non-approximations."""
    error = row.get("error")
    if error is None:
        return "-"
    if error < EXACT_BELOW:
        return "exact"
    # An attention of its own (e.g. a gated recurrence) is a different model: its distance from softmax
    # is shown, starred, but it is not an approximation error.
    return f"{error:.3g}*" if row.get("kind") == OWN else f"{error:.3g}"


def _number(value: Optional[float]) -> str:
    """One decimal for readable magnitudes, three significant digits below 10 (tiny runs stay informative)."""
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def counterpart_note(row: Dict[str, Any]) -> Optional[str]:
    """How a peer row compares with its attnzoo counterpart, worded so that it cannot be read backwards.

    "attnzoo X's time is 0.41x X-library's, memory 0.92x": both are attnzoo's figure over the
    peer's, so below 1 means attnzoo needs less. None for rows without a measured counterpart."""
    time, memory = row.get("attnzoo_time_over_peer"), row.get("attnzoo_memory_over_peer")
    if not row.get("counterpart") or (time is None and memory is None):
        return None
    source = row["source"] + ("'" if row["source"].endswith("s") else "'s")
    return f"attnzoo {row['counterpart']}'s time is {_ratio(time)} {source}, memory {_ratio(memory)}"


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> List[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = []
    for index, row in enumerate([list(header), ["-" * width for width in widths], *rows]):
        cells = [str(cell).rjust(width) if right[i] and index != 1 else str(cell).ljust(width)
                 for i, (cell, width) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


ERROR_LEGEND = ("error = |output - softmax's| / |softmax's| (Frobenius, the whole batch) on standard-normal q, k, v; "
                "0 is exact, uniform attention (every query averages the values) is the floor to beat")


def results_table(data: Dict[str, Any]) -> str:
    """The per-length blocks and the crossover summary, as plain text."""
    config = data["config"]
    lengths = sorted({row["length"] for row in data["rows"]})
    lines = [
        f"attnzoo compare: batch {config['batch']}, {config['heads']} heads, head dim {config['head_dim']}, "
        f"{config['dtype']}, {'causal' if config['causal'] else 'non-causal'}, {config['device']}, "
        f"{data['machine']['threads']} thread{'s' if data['machine']['threads'] != 1 else ''} "
        f"({data['machine']['cpu']})",
        *(["INTERRUPTED: only the rows measured before Ctrl-C"] if data.get("interrupted") else []),
        "speed = softmax time / mechanism time (forward+backward; >1 is faster); "
        "memory = mechanism peak / softmax peak (<1 is leaner)",
        ERROR_LEGEND,
    ]
    header = ["mechanism", "fwd ms", "fwd+bwd ms", "peak MiB", "speed", "memory", "error", "note"]
    right = [False, True, True, True, True, True, True, False]
    uniform = {item["length"]: item["error"] for item in data.get("uniform_error", [])}
    starred = False
    for length in lengths:
        rows = [row for row in data["rows"] if row["length"] == length]
        body = []
        for row in rows:
            note = "" if row["status"] == "ok" and not row["reason"] else (row["reason"] or row["status"])
            if row.get("timing_note"):
                note = row["timing_note"] + (f"; {note}" if note else "")
            spread = row.get("forward_backward_spread")
            if spread is not None and spread > NOISY_SPREAD:
                note = f"noisy timing (spread {100 * spread:.0f}%)" + (f"; {note}" if note else "")
            peer = counterpart_note(row)
            if peer:
                note = peer + (f"; {note}" if note else "")
            error = format_error(row)
            starred = starred or error.endswith("*")
            body.append([row["mechanism"], _number(row["forward_ms"]), _number(row["forward_backward_ms"]),
                         _number(row["peak_memory_mib"]), _ratio(row["speed_vs_softmax"]),
                         _ratio(row["memory_vs_softmax"]), error, _shorten(note, NOTE_WIDTH)])
        floor = f"; uniform attention's error here: {uniform[length]:.3g}" if uniform.get(length) else ""
        lines += ["", f"N = {length}{floor}"] + render_table(header, body, right)
    lines += ["", "crossover: the length from which a mechanism is faster than softmax (log-log interpolation)"]
    header = ["mechanism", "fwd+bwd crossover", "fwd crossover", "longest N", "speed", "memory", "error", "note"]
    body = []
    for item in data["summary"]:
        if item["mechanism"] == BASELINE:
            continue
        body.append([item["mechanism"], describe_crossover(item["crossover_forward_backward"]),
                     describe_crossover(item["crossover_forward"]), str(item["longest_length"] or "-"),
                     _ratio(item["speed_vs_softmax"]), _ratio(item["memory_vs_softmax"]), format_error(item),
                     _shorten(item["note"] or "", 60)])
    lines += render_table(header, body, [False, True, True, True, True, True, True, False])
    if starred:
        lines.append("* an attention of its own, not an approximation of softmax: distance from softmax, not an error")
    warning = busy_warning(data["machine"])
    if warning:
        lines.append("warning: " + warning)
    if data.get("missing_peers"):
        lines.append("peers not installed: " + ", ".join(peer["name"] for peer in data["missing_peers"])
                     + " (scripts/install-peers.sh)")
    return "\n".join(lines)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
