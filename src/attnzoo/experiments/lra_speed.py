"""The speed axis of ``attnzoo lra`` at the length it is about, as the Long Range Arena measures it.

The accuracy of each cell comes from training at the task's own length (256 tokens in the quick preset), where
softmax is among the fastest; the efficient mechanisms exist for long sequences. So ``attnzoo lra`` also measures
every mechanism's attention at a declared long length (``--long-length``, 4,096 tokens by default) with the
kernel benchmark of ``attnzoo compare`` (:func:`attnzoo.bench.compare.run_compare`: one worker process times
every mechanism's forward and forward+backward round-robin on the same inputs; a fresh process per mechanism,
forked from a server that has imported torch and attnzoo, measures its peak memory), at the model's heads and
head width, batch 1. The measurement is kept cheap, one timed forward+backward per mechanism after the benchmark's
warm-up, so that it adds a minute or two to a run (a single sample: its noise is the machine's).

Results: ``OUTPUT/long-length/results.json`` and ``results.csv`` (the kernel benchmark's own files, with the
command), reused by a rerun whose long-length settings are the same.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..bench.compare import CompareConfig, run_compare
from ..bench.results import BASELINE, write_results
from ..mechanisms import UnsupportedOptionError, build_mechanism, mechanism_class, shapes_only

DEFAULT_LONG_LENGTH = 4096
LONG_DIR = "long-length"
# One timed forward and forward+backward per mechanism (the benchmark first runs one forward to check the output
# and two forward+backward passes to warm up; the memory process one more of each): at 4,096 tokens every
# mechanism's measurement costs a few of its forward+backward passes, about a minute for all of them on 2 idle
# cores, so that the quick run stays within its 45 minutes. One whose forward+backward takes longer than
# LONG_BUDGET_S is a row saying it is too slow.
LONG_REPEATS = 1
LONG_BUDGET_S = 60.0


def check_long_length(long_length: Any, mechanisms: Sequence[str], options: Mapping[str, Mapping[str, Any]],
                      heads: int, head_dim: int) -> None:
    """``--long-length`` is a whole number of tokens >= 1 that every mechanism of the run takes (its
    ``max_length``, ``length_multiple``, a length option such as a rank) with its ``--set`` options; otherwise a
    ValueError naming the option, so that the run stops before any cell trains."""
    if isinstance(long_length, bool) or not isinstance(long_length, numbers.Real) \
            or not math.isfinite(long_length) or long_length != int(long_length) or long_length < 1:
        raise ValueError(f"--long-length must be a whole number of tokens >= 1, got {long_length!r}")
    length = int(long_length)
    for name in mechanisms:
        try:
            module = build_mechanism(name, heads, head_dim, **attention_options(name, options.get(name), length))
        except UnsupportedOptionError as error:
            raise ValueError(f"--long-length {length}: {name} cannot be built for it: {error}") from None
        reasons = module.unsupported_reasons(*shapes_only(1, heads, length, length, head_dim), causal=False)
        if reasons:
            raise ValueError(f"--long-length {length}: {'; '.join(reasons)} (choose another length, or leave "
                             f"{name} out of --mechanisms)")


def attention_options(name: str, options: Optional[Mapping[str, Any]], length: int) -> Dict[str, Any]:
    """A mechanism's options at ``length``: its length option (a learned table over positions) set to it unless
    given, as the kernel benchmark and the training model build it."""
    chosen = dict(options or {})
    length_option = mechanism_class(name).length_option
    if length_option is not None and length_option not in chosen:
        chosen[length_option] = length
    return chosen


def measured_on(long: Dict[str, Any]) -> str:
    """Where the long length was measured, for labels: "1 thread" on the CPU, else the device (and its name)."""
    device = long.get("device", "cpu")
    if device == "cpu":
        return f"{long['threads']} thread{'s' if long['threads'] != 1 else ''}"
    name = (long.get("machine") or {}).get("gpu")
    return f"{device} ({name})" if name else device


def long_length_config(long_length: int, mechanisms: Sequence[str], options: Mapping[str, Mapping[str, Any]],
                       heads: int, head_dim: int, threads: Optional[int], imports: Sequence[str],
                       device: Optional[str] = None) -> CompareConfig:
    """The kernel benchmark's settings: one length, batch 1, the model's heads and head width, one timed
    forward+backward per mechanism, no feature sweep, on ``device`` (None: the CPU). Softmax is measured too
    (every ratio refers to it)."""
    return CompareConfig.from_preset(
        "quick", lengths=[long_length], mechanisms=list(mechanisms), options={k: dict(v) for k, v in options.items()},
        batch=1, heads=heads, head_dim=head_dim, repeats=LONG_REPEATS, timing_budget_s=None, budget_s=LONG_BUDGET_S,
        min_sample_s=0.0, sweep=False, threads=threads or 1, imports=list(imports), device=device or "cpu")


def _same_settings(saved: Dict[str, Any], config: CompareConfig) -> bool:
    wanted = json.loads(json.dumps(long_length_config_dict(config)))
    return {key: saved.get("config", {}).get(key) for key in wanted} == wanted


def long_length_config_dict(config: CompareConfig) -> Dict[str, Any]:
    """The settings that decide what a long-length measurement measured (a rerun with other ones remeasures)."""
    keys = ("lengths", "mechanisms", "options", "batch", "heads", "head_dim", "repeats", "threads", "dtype", "device")
    return {key: getattr(config, key) for key in keys}


def measure_long_length(config: CompareConfig, output: Path, argv: Sequence[str]) -> Dict[str, Any]:
    """The kernel benchmark's results at the long length (``output/long-length/results.json``): read back when
    a run with the same settings saved them, else measured now and saved."""
    folder = output / LONG_DIR
    saved_path = folder / "results.json"
    if saved_path.exists():
        saved = json.loads(saved_path.read_text())
        if _same_settings(saved, config):
            return saved
    data = run_compare(config, argv).data  # its command: the lra command that measured it
    write_results(data, folder)
    return data


def long_length_summary(data: Dict[str, Any], mechanisms: Sequence[str], dim: int) -> Dict[str, Any]:
    """What lra.json keeps of the measurement: its settings and, per mechanism of the run, forward+backward time,
    tokens per second, peak memory, the ratios to softmax, and the status with its reason."""
    config = data["config"]
    length = config["lengths"][0]
    by_name = {row["mechanism"]: row for row in data["rows"] if row["length"] == length}
    rows: List[Dict[str, Any]] = []
    for name in dict.fromkeys([*mechanisms, BASELINE]):
        row = by_name.get(name)
        if row is None:
            continue
        milliseconds = row.get("forward_backward_ms")
        rows.append({
            "mechanism": name, "status": row["status"], "reason": row.get("reason"),
            "forward_backward_ms": milliseconds,
            "tokens_per_second": row["batch"] * length / (milliseconds / 1e3) if milliseconds else None,
            "peak_memory_mib": row.get("peak_memory_mib"),
            "speed_vs_softmax": row.get("speed_vs_softmax"), "memory_vs_softmax": row.get("memory_vs_softmax"),
        })
    return {"length": length, "batch": config["batch"], "heads": config["heads"], "head_dim": config["head_dim"],
            "dim": dim, "threads": config["threads"], "device": config.get("device", "cpu"),
            "repeats": config["repeats"], "command": data["command"],
            "machine": data.get("machine"), "files": f"{LONG_DIR}/results.json, {LONG_DIR}/results.csv",
            "rows": rows}


def training_lengths_text(data: Dict[str, Any]) -> str:
    """"listops 256, pathfinder 256, ...": the length each task trains at."""
    return ", ".join(f"{task} {length}" for task, length in data.get("training_lengths", {}).items())
