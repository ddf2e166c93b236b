"""The results of a comparison: row schema, ratios against softmax, crossover lengths, summary, files.

Pure data handling on the row dicts that :mod:`attnzoo.bench.compare` assembles; nothing here measures.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

# 2: a peer's ratios to its attnzoo counterpart are attnzoo_time_over_peer and attnzoo_memory_over_peer (both
# attnzoo's figure over the peer's); 1 had speed_vs_counterpart and memory_vs_counterpart, which pointed in
# opposite directions.
SCHEMA = "attnzoo.compare/2"
BASELINE = "softmax"

# A row's status; its "reason" says why for every status but "ok".
#   ok           measured (a failed memory measurement leaves the timings and turns the status to its own)
#   unsupported  the mechanism does not do this configuration (e.g. causal), or a peer is not installed
#   oom          out of memory (an allocation failed, or the worker was killed by the system)
#   timeout      slower than the per-configuration budget, or the worker hung
#   failed       an error: a bug in the mechanism, an adapter or the benchmark
#   skipped      not run, because a shorter length already ran out of memory or time
STATUSES = ("ok", "unsupported", "oom", "timeout", "failed", "skipped")

CSV_COLUMNS = [
    "mechanism", "source", "counterpart", "kind", "length", "batch", "heads", "head_dim", "dtype",
    "causal", "device", "status", "reason", "forward_ms", "forward_backward_ms", "peak_memory_mib",
    "forward_peak_memory_mib", "error", "speed_vs_softmax", "forward_speed_vs_softmax", "memory_vs_softmax",
    "attnzoo_time_over_peer", "attnzoo_memory_over_peer", "repeats", "forward_spread", "forward_backward_spread",
    "timing_note",
]


def busy_warning(machine: Dict[str, Any]) -> Optional[str]:
    """A warning when other work was running: then timings, and even their ratios, are noisy.

    Reads ``cores_busy_elsewhere`` (measured at the start) where present, else the one-minute load average,
    which also counts work that ended in the last minute."""
    cores = machine.get("cores") or 1
    elsewhere = machine.get("cores_busy_elsewhere")
    if elsewhere is not None:
        if elsewhere > 0.25 * cores:
            return (f"the machine was busy (other processes kept {elsewhere:.1f} of {cores} cores busy at the "
                    "start): timings are noisy; rerun on an idle machine for stable numbers")
        return None
    load = machine.get("load_average")
    if load and load[0] > 0.5 * cores:
        return (f"the machine was busy (load average {load[0]:.1f} on {cores} cores at the start): timings are "
                "noisy; rerun on an idle machine for stable numbers")
    return None


def crossover_length(points: Sequence[Tuple[int, float, float]]) -> Dict[str, Any]:
    """Where a mechanism becomes faster than the baseline, from (length, time, baseline time) points.

    The crossover is the length from which on the mechanism stays faster at every measured length; between
    the last slower and the first faster measurement it is interpolated in log-log (times scale as powers
    of N). Returns ``{"kind": ..., "length": ..., "measured": [shortest, longest]}`` with kind
    "interpolated", "below_range" (faster already at the shortest length), "not_reached" (not faster at the
    longest length) or "unknown" (no data).
    """
    points = sorted((n, t, b) for n, t, b in points if t and b and t > 0 and b > 0)
    if not points:
        return {"kind": "unknown", "length": None, "measured": None}
    measured = [points[0][0], points[-1][0]]
    ratios = [(n, t / b) for n, t, b in points]
    if ratios[-1][1] >= 1.0:
        return {"kind": "not_reached", "length": None, "measured": measured}
    first_faster = len(ratios) - 1
    while first_faster > 0 and ratios[first_faster - 1][1] < 1.0:
        first_faster -= 1
    if first_faster == 0:
        return {"kind": "below_range", "length": ratios[0][0], "measured": measured}
    (n0, r0), (n1, r1) = ratios[first_faster - 1], ratios[first_faster]
    fraction = math.log(r0) / (math.log(r0) - math.log(r1))
    length = math.exp(math.log(n0) + fraction * (math.log(n1) - math.log(n0)))
    return {"kind": "interpolated", "length": round(length), "measured": measured}


def describe_crossover(crossover: Dict[str, Any]) -> str:
    """"~1500", "<= 256" (faster at every measured length), "> 4096" (never faster up to the longest)."""
    kind = crossover["kind"]
    if kind == "interpolated":
        return f"~{crossover['length']}"
    if kind == "below_range":
        return f"<= {crossover['measured'][0]}"
    if kind == "not_reached":
        return f"> {crossover['measured'][1]}"
    return "-"


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    if numerator is None or denominator is None or denominator <= 0 or numerator <= 0:
        return None
    return numerator / denominator


def load_accuracy(path: Path) -> Dict[str, float]:
    """Quality per mechanism from a training benchmark's results file.

    Accepted: ``{"mechanism": accuracy, ...}``, or rows ``[{"mechanism": ..., "accuracy": ...}, ...]``
    (also under a "rows" or "results" key; "test_accuracy", "score" or "acc" instead of "accuracy"). Several
    rows for one mechanism (several tasks) are averaged, as the Long Range Arena averages its tasks.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:  # ValueError: not JSON, or not UTF-8 text at all
        raise ValueError(f"--accuracy {path}: cannot read a JSON file ({error})") from error
    if isinstance(data, dict) and data and all(isinstance(v, (int, float)) for v in data.values()):
        return {str(k): float(v) for k, v in data.items()}
    rows = data.get("rows", data.get("results")) if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"--accuracy {path}: expected {{mechanism: accuracy}} or a list of rows")
    collected: Dict[str, List[float]] = {}
    for row in rows:
        if not isinstance(row, dict) or "mechanism" not in row:
            continue
        value = next((row[key] for key in ("accuracy", "test_accuracy", "score", "acc") if key in row), None)
        if isinstance(value, (int, float)) and math.isfinite(value):
            collected.setdefault(str(row["mechanism"]), []).append(float(value))
    if not collected:
        raise ValueError(f"--accuracy {path}: no row has a mechanism and an accuracy")
    return {name: sum(values) / len(values) for name, values in collected.items()}


def speed_ratio(reference: Dict[str, Any], row: Dict[str, Any], column: str) -> Optional[float]:
    """How many times faster ``row`` is than ``reference`` in ``column`` ("forward_ms" or "forward_backward_ms").

    Both were timed in the same rounds, so each round gives a ratio of two measurements taken moments
    apart; their median cancels the machine's drift better than a ratio of the two medians, which is the
    fallback when the per-round samples are missing.
    """
    ours, theirs = row.get(f"{column}_samples"), reference.get(f"{column}_samples")
    if ours and theirs:
        paired = [b / a for a, b in zip(ours, theirs) if a > 0 and b > 0]
        if paired:
            return statistics.median(paired)
    return _ratio(reference[column], row[column])


# A time at a shorter length above the same mechanism's at the next longer length by more than this factor is
# flagged (at short lengths fixed costs dominate, so nearly equal times are expected, not suspicious).
INVERTED_MARGIN = 1.1


def flag_timings(rows: List[Dict[str, Any]]) -> None:
    """Add to ``timing_note`` what makes a row's timing untrustworthy: a forward slower than its forward and
    backward, or a forward+backward more than :data:`INVERTED_MARGIN` times the same mechanism's at the next
    longer length (the machine was busier while it ran: its ratios are off too)."""
    def note(row: Dict[str, Any], text: str) -> None:
        row["timing_note"] = f"{row['timing_note']}; {text}" if row.get("timing_note") else text

    by_mechanism: Dict[Any, List[Dict[str, Any]]] = {}
    for row in rows:
        if row.get("forward_ms") is None or row.get("forward_backward_ms") is None:
            continue
        if row["forward_ms"] > row["forward_backward_ms"]:
            note(row, f"forward {row['forward_ms']:.3g} ms above forward+backward: timing unreliable")
        by_mechanism.setdefault((row["mechanism"], row["source"]), []).append(row)
    for own in by_mechanism.values():
        own.sort(key=lambda row: row["length"])
        for shorter, longer in zip(own, own[1:]):
            if shorter["forward_backward_ms"] > INVERTED_MARGIN * longer["forward_backward_ms"]:
                note(shorter, f"slower than at N={longer['length']}: timing unreliable")


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    """Speed and memory of every row against softmax at the same length (and a peer's against its twin).

    A peer row also gets ``attnzoo_time_over_peer`` (forward+backward) and ``attnzoo_memory_over_peer``
    (peak): the attnzoo counterpart's figure divided by the peer's, the same direction for both, so below 1
    means attnzoo takes less time or memory than the peer library.
    """
    by_key = {(row["mechanism"], row["length"]): row for row in rows}
    for row in rows:
        base = by_key.get((BASELINE, row["length"]))
        if base is not None:
            row["speed_vs_softmax"] = speed_ratio(base, row, "forward_backward_ms")
            row["forward_speed_vs_softmax"] = speed_ratio(base, row, "forward_ms")
            row["memory_vs_softmax"] = _ratio(row["peak_memory_mib"], base["peak_memory_mib"])
        twin = by_key.get((row["counterpart"], row["length"])) if row["counterpart"] else None
        if twin is not None:
            # speed_ratio(twin, row) is how many times faster the peer is: twin time over peer time.
            row["attnzoo_time_over_peer"] = speed_ratio(twin, row, "forward_backward_ms")
            row["attnzoo_memory_over_peer"] = _ratio(twin["peak_memory_mib"], row["peak_memory_mib"])


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per mechanism: crossover lengths against softmax and the figures at the longest measured length."""
    baseline = {row["length"]: row for row in rows if row["mechanism"] == BASELINE}
    summary = []
    for mechanism in dict.fromkeys(row["mechanism"] for row in rows):
        own = sorted((row for row in rows if row["mechanism"] == mechanism), key=lambda row: row["length"])
        crossovers = {}
        for column in ("forward_ms", "forward_backward_ms"):
            points = [(row["length"], row[column], baseline[row["length"]][column])
                      for row in own if row["length"] in baseline]
            crossovers[column] = crossover_length(points)
        measured = [row for row in own if row["forward_backward_ms"] is not None]
        last = measured[-1] if measured else own[-1]
        trouble = next((row for row in own if row["status"] != "ok"), None)
        summary.append({
            "mechanism": mechanism, "source": own[0]["source"], "counterpart": own[0]["counterpart"],
            "kind": own[0]["kind"],
            "crossover_forward": crossovers["forward_ms"],
            "crossover_forward_backward": crossovers["forward_backward_ms"],
            "longest_length": last["length"] if measured else None,
            "speed_vs_softmax": last["speed_vs_softmax"], "memory_vs_softmax": last["memory_vs_softmax"],
            "error": last["error"],
            "statuses": {row["length"]: row["status"] for row in own},
            "note": _summary_note(own, trouble),
        })
    return summary


def _summary_note(own: Sequence[Dict[str, Any]], trouble: Optional[Dict[str, Any]]) -> Optional[str]:
    """The first problem of a mechanism, with its length unless it happened at every length."""
    if trouble is None:
        return None
    reason = trouble["reason"] or trouble["status"]
    if all(row["reason"] == trouble["reason"] and row["status"] == trouble["status"] for row in own):
        return reason
    return f"N={trouble['length']}: {reason}"


def prepare_output(output: Path) -> None:
    """Create the directory ``output`` and check that files can be written in it, before anything is measured.

    Raises ValueError saying what is wrong (without the path, which the caller names), so that a run of
    minutes does not end in a traceback over its output directory. A probe file is written and removed:
    permissions alone do not tell (root, read-only file systems, full disks)."""
    if output.exists() and not output.is_dir():
        raise ValueError("exists and is not a directory")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"cannot create the directory ({error.strerror or error})") from None
    try:
        handle, probe = tempfile.mkstemp(dir=output, prefix=".attnzoo-write-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(f"cannot write files in it ({error.strerror or error})") from None


def write_results(data: Dict[str, Any], output: Path) -> Dict[str, Path]:
    """results.json and results.csv in ``output``; returns their paths."""
    output.mkdir(parents=True, exist_ok=True)
    paths = {"json": output / "results.json", "csv": output / "results.csv"}
    paths["json"].write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in data["rows"]:
            writer.writerow({key: ("" if value is None else value) for key, value in row.items()})
    return paths
