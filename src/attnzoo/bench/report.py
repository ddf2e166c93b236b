"""report.md: the figures of a comparison tied together with the exact command, machine and method."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from .results import BASELINE, busy_warning, describe_crossover
from .table import format_error


def _cell(value: Optional[float], digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _markdown_table(header: List[str], rows: List[List[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return lines


def _header(data: Dict[str, Any]) -> List[str]:
    """The command that reproduces the run, and the machine it ran on."""
    machine = data["machine"]
    interrupted = ["**Interrupted** (Ctrl-C): only the rows measured before are here; the others say "
                   "`interrupted`, and lengths or sweeps not reached are missing.", ""] if data.get("interrupted") else []
    return [
        "# attnzoo compare",
        "",
        *interrupted,
        "Reproduce with:",
        "",
        "```bash",
        data["command"],
        "```",
        "",
        "## Machine",
        "",
        f"- CPU: {machine['cpu']}, {machine['cores']} cores, {machine['threads']} torch threads"
        + (f", {machine['memory_gib']} GiB memory" if machine.get("memory_gib") else ""),
        f"- device: {machine['device']}" + (f" ({machine['gpu']}, CUDA {machine['cuda']})" if machine.get("gpu") else ""),
        f"- Python {machine['python']}, torch {machine['torch']}, {machine['platform']}",
        f"- run: {data['started']} to {data['finished']} ({data['duration_s']} s)"
        + (f", load average at the start {machine['load_average'][0]}" if machine.get("load_average") else "")
        + (f", cores busy with other processes at the start {machine['cores_busy_elsewhere']}"
           if machine.get("cores_busy_elsewhere") is not None else ""),
        *([f"- **warning**: {busy_warning(machine)}"] if busy_warning(machine) else []),
        "",
    ]


def _repeats_text(config: Dict[str, Any]) -> str:
    if config.get("timing_budget_s") is None:
        return f"Times are medians of {config['repeats']} repeats"
    return (f"Times are medians of up to {config['repeats']} repeats (as many as fit "
            f"{config['timing_budget_s']:g} s per length for all mechanisms together, at least 3 unless a row's "
            "note says why; each row's "
            "count is in results.json)")


def _setting(data: Dict[str, Any]) -> List[str]:
    """How the numbers were measured."""
    config = data["config"]
    lengths = sorted({row["length"] for row in data["rows"]})
    return [
        "## Setting",
        "",
        f"Batch {config['batch']}, {config['heads']} heads, head dim {config['head_dim']}, {config['dtype']}, "
        f"{'causal' if config['causal'] else 'non-causal'}, lengths {', '.join(map(str, lengths))}. "
        + _repeats_text(config) + " after a warm-up; the mechanisms are timed "
        "round-robin on the same inputs within one process per length, so machine drift affects them alike. "
        "Peak memory is measured in a fresh process per configuration "
        + ("(the CUDA allocator's peak above the inputs). " if config["device"].startswith("cuda") else
           "(the resident-set high-water mark above the resident size after inputs and a warm-up call, with "
           "glibc's mmap threshold fixed so freed tensors return to the system). ")
        + "Error is `||out - softmax|| / ||softmax||` on the same standard-normal q, k, v (exact softmax in "
          "float64). Each configuration has a budget of "
        f"{config['budget_s']:.0f} s; slower ones, and those out of memory, are reported and skipped at longer "
        "lengths.",
        "",
    ]


def _figures(data: Dict[str, Any], accuracy_path: Optional[str]) -> List[str]:
    return [
        "## Time", "", "![time against N](time.png)", "",
        "## Memory", "", "![peak memory against N](memory.png)", "",
        "## Approximation error", "", "![error against feature count](error.png)", "",
        "The error is `|output - softmax's output| / |softmax's output|` (Frobenius norms over the whole batch) on "
        "the benchmark's inputs: q, k and v drawn from a standard normal. The dotted line is uniform attention "
        "(every query averages the values): an approximation above it carries less information about q and k "
        "than a plain average.",
        "",
        "Why some approximations sit above that floor on these inputs: with standard-normal q and k at head dim "
        "d, the logits `q.k/sqrt(d)` have a spread of about 1 but `|q|^2/sqrt(d)` is about `sqrt(d)` (8 at d = "
        "64). Positive random features (Performer's FAVOR+) estimate `exp(q.k/sqrt(d))` with a variance that grows "
        "like `exp(|q|^2/sqrt(d) + |k|^2/sqrt(d))`, so a few hundred features give estimates far from the truth. "
        "Transformer-VQ's codebook is EMA-trained on keys during training; here it is its untrained initial "
        "codebook, so its error says what an untrained codebook costs, not what a trained one does. Trained "
        "models' queries and keys are neither isotropic nor that long: accuracy after training (`attnzoo lra`, "
        "`--accuracy`) is the measure of quality.",
        "",
        "The sweep is also measured on q and k scaled so that the logits spread less (logit std below 1: a "
        "flatter softmax, with shorter q and k), where the estimators are not swamped by their variance; the "
        "table below has both.",
        "",
        *_sweep_table(data),
        "## Speed, quality and memory", "", "![bubble chart](bubble.png)", "",
        ("Quality is the accuracy from `" + accuracy_path + "`." if accuracy_path else
         "Quality is the approximation error against softmax (no `--accuracy` file was given); for mechanisms "
         "that are not approximations of softmax it is a distance, not a quality."),
        "",
    ]


def _sweep_table(data: Dict[str, Any]) -> List[str]:
    """The error sweep's numbers: a row per mechanism and logit spread, a column per option value."""
    sweeps = [sweep for sweep in data.get("sweeps", []) if sweep.get("points")]
    if not sweeps:
        return []
    values = sorted({point["value"] for sweep in sweeps for point in sweep["points"]})
    rows = []
    for sweep in sorted(sweeps, key=lambda sweep: (-float(sweep.get("logit_std", 1.0)), sweep["mechanism"])):
        errors = {point["value"]: point.get("error") for point in sweep["points"]}
        rows.append([f"{sweep['mechanism']} ({sweep['option']})", f"{float(sweep.get('logit_std', 1.0)):g}",
                     *(_cell(errors.get(value), 3) for value in values), _cell(sweep.get("uniform_error"), 3)])
    return (["### The error sweep", "", f"Relative error against softmax at N={sweeps[0]['length']} as the "
             "option grows; `uniform` is uniform attention's error on the same inputs, the floor.", ""]
            + _markdown_table(["mechanism (option)", "logit std", *map(str, values), "uniform"], rows) + [""])


def _summary(data: Dict[str, Any]) -> List[str]:
    lines = [
        "## Summary",
        "",
        "Speed = softmax time / mechanism time (forward+backward, > 1 is faster); memory = mechanism peak / "
        "softmax peak (< 1 is leaner); crossover = the length from which the mechanism is faster than softmax.",
        "",
    ]
    summary_rows = []
    for item in data["summary"]:
        if item["mechanism"] == BASELINE:
            continue
        summary_rows.append([
            item["mechanism"], describe_crossover(item["crossover_forward_backward"]),
            describe_crossover(item["crossover_forward"]), str(item["longest_length"] or "-"),
            _cell(item["speed_vs_softmax"], 2, "x"), _cell(item["memory_vs_softmax"], 2, "x"), format_error(item),
            item["note"] or "",
        ])
    return lines + _markdown_table(["mechanism", "fwd+bwd crossover", "fwd crossover", "longest N", "speed",
                                    "memory", "error", "note"], summary_rows)


def _measurements(data: Dict[str, Any]) -> List[str]:
    lines = ["", "## All measurements", ""]
    detail_rows = []
    for row in sorted(data["rows"], key=lambda row: (row["length"], row["mechanism"] != BASELINE)):
        detail_rows.append([
            str(row["length"]), row["mechanism"], row["status"], _cell(row["forward_ms"]),
            _cell(row["forward_backward_ms"]), _cell(row["peak_memory_mib"]), _cell(row["speed_vs_softmax"], 2, "x"),
            _cell(row["memory_vs_softmax"], 2, "x"), format_error(row),
            "; ".join(text for text in (row.get("timing_note"), row["reason"]) if text),
        ])
    lines += _markdown_table(["N", "mechanism", "status", "fwd ms", "fwd+bwd ms", "peak MiB", "speed", "memory",
                              "error", "note"], detail_rows)
    if any(format_error(row).endswith("*") for row in data["rows"]):
        lines += ["", "\\* not an approximation of softmax (a different attention): distance from softmax, "
                      "not an error."]
    if data.get("missing_peers"):
        lines += ["", "Peers not installed (install with `scripts/install-peers.sh .venv/bin/python`): "
                  + ", ".join(peer["name"] for peer in data["missing_peers"]) + "."]
    return lines + ["", "Raw numbers: `results.json` (with the full configuration) and `results.csv`.", ""]


def render_report(data: Dict[str, Any], accuracy_path: Optional[str] = None) -> str:
    """report.md: the command and machine, the setting, the figures, the summary and every measurement."""
    return "\n".join(_header(data) + _setting(data) + _figures(data, accuracy_path) + _summary(data)
                     + _measurements(data))


def write_report(data: Dict[str, Any], output: Path, accuracy_path: Optional[str] = None) -> Path:
    path = output / "report.md"
    path.write_text(render_report(data, accuracy_path))
    return path
