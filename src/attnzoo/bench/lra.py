"""``attnzoo lra``: every mechanism trained on every task at one fixed budget, as in the Long Range Arena.

Each cell (task x mechanism) is one ``attnzoo train`` run in a fresh process, in its own directory
``OUTPUT/cells/TASK/MECHANISM/`` (so a crash, a hang or an out-of-memory kill is that cell's row, and the
command that reproduces it is recorded). A cell that finished keeps its ``cell.json`` and is not run again; one
that was interrupted resumes from its checkpoint. The same settings go to every mechanism of a task: no
mechanism is tuned on its own.

Outputs: ``lra.json`` (cells, table and the command; its rows are what ``attnzoo compare --accuracy`` reads),
``lra.md`` (accuracy per task, mechanisms as rows, the average last, the trivial baselines as a row) and
``lra.png`` (speed against average accuracy, bubble area = peak memory).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..mechanisms import available as mechanisms_available
from ..tasks import available as tasks_available, load as load_task
from ..training import TrainConfig, unsupported_reasons

LRA_JSON, LRA_MD, LRA_PNG, SETTINGS_JSON = "lra.json", "lra.md", "lra.png", "lra-settings.json"
CELL_JSON = "cell.json"

# One budget per task: the model, optimiser and data every mechanism gets. The quick budget is sized to run
# every registered mechanism on every task in under 45 minutes on 2 CPU cores (docs/lra.md): the fewest steps
# and examples at which softmax still clears each task's goal (ListOps at batch 16, Pathfinder at 200 steps;
# bytes and recall need their 300 and 600).
# Pathfinder and recall get what lets a small model leave chance within a quick budget (docs/lra.md shows the
# runs without it): rotary positions (relative offsets, which both tasks are about) and, on recall, the token
# shift that puts each value beside its key. The quick Pathfinder is 16 x 16 with three-segment curves: the
# default 32 x 32 images stayed at chance in every run that fits the budget.
PATHFINDER_QUICK = dict(size=16, contour_length=3, segment_length=2, num_distractors=4)
BUDGETS: Dict[str, Dict[str, Dict[str, Any]]] = {
    "quick": {
        "listops": dict(task_options={}, dim=64, depth=2, heads=4, batch_size=16, steps=300, lr=2e-3),
        "pathfinder": dict(task_options=PATHFINDER_QUICK, dim=64, depth=2, heads=4, positional="rotary",
                           batch_size=32, steps=200, lr=2e-3),
        "bytes": dict(task_options={}, dim=64, depth=2, heads=4, batch_size=16, steps=300, lr=2e-3),
        "recall": dict(task_options={}, dim=64, depth=2, heads=4, positional="rotary", token_shift=True,
                       batch_size=32, steps=600, lr=2e-3),
    },
    "full": {
        "listops": dict(task_options={}, dim=128, depth=4, heads=4, batch_size=32, steps=3000, lr=1e-3),
        "pathfinder": dict(task_options={}, dim=64, depth=4, heads=4, positional="rotary", batch_size=32,
                           steps=3000, lr=1e-3),
        "bytes": dict(task_options={}, dim=128, depth=4, heads=4, batch_size=16, steps=3000, lr=1e-3),
        "recall": dict(task_options={}, dim=128, depth=2, heads=4, positional="rotary", token_shift=True,
                       batch_size=32, steps=2000, lr=1e-3),
    },
}
# Validation passes per cell, evenly spaced (each also writes a checkpoint), and the batches each one reads
# (None: the whole split). The table reports the whole test split, so the quick budget validates once, at the
# end, on a few batches, and spends the time training; the full budget's five full passes give a learning curve
# and checkpoints to resume from.
EVALUATIONS = {"quick": 1, "full": 5}
VALIDATION_BATCHES = {"quick": 4, "full": None}
# A cell that runs past its timeout is a row that says so. The slowest quick cells now take 2-3 minutes (vq and
# reformer, docs/lra.md); before the speed-ups one took 597 s. The 1200 s leave room for a slower machine.
CELL_TIMEOUT_S = {"quick": 1200.0, "full": 7200.0}


def check_cell_settings(jobs: Any, threads: Any, cell_timeout_s: Any) -> None:
    """How cells are run: ``--jobs`` at once, ``--threads`` each (None: the default), ``--cell-timeout`` seconds
    at most (None: the budget's); a bad value is an error naming the option."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs must be an integer >= 1, got {jobs!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads must be an integer >= 1, got {threads!r}")
    if cell_timeout_s is not None and not (cell_timeout_s > 0 and math.isfinite(cell_timeout_s)):
        raise ValueError(f"--cell-timeout must be a positive number of seconds, got {cell_timeout_s!r}")


@dataclass
class LraConfig:
    """What ``attnzoo lra`` runs: a budget, the mechanisms (default all) and tasks (default all)."""

    budget: str = "quick"
    mechanisms: Optional[List[str]] = None
    tasks: Optional[List[str]] = None
    threads: Optional[int] = None
    jobs: int = 1
    cell_timeout_s: Optional[float] = None
    overrides: Dict[str, Any] = field(default_factory=dict)   # settings applied to every cell (e.g. steps)

    def validate(self) -> None:
        if self.budget not in BUDGETS:
            raise ValueError(f"--budget must be one of {', '.join(BUDGETS)}, got {self.budget!r}")
        for label, chosen, valid in (("--mechanisms", self.mechanisms, mechanisms_available()),
                                     ("--tasks", self.tasks, tasks_available())):
            unknown = [name for name in chosen or [] if name not in valid]
            if unknown:
                raise ValueError(f"{label}: unknown {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
        check_cell_settings(self.jobs, self.threads, self.cell_timeout_s)
        for task in self.task_names:
            self.train_config(task, "softmax")  # every override must make a valid config

    @property
    def task_names(self) -> List[str]:
        return list(self.tasks or [t for t in tasks_available() if t in BUDGETS[self.budget]])

    @property
    def mechanism_names(self) -> List[str]:
        return list(self.mechanisms or mechanisms_available())

    def train_config(self, task: str, mechanism: str) -> TrainConfig:
        settings = dict(BUDGETS[self.budget].get(task, BUDGETS[self.budget]["listops"]))
        settings.update(self.overrides)
        settings.setdefault("eval_interval", max(settings["steps"] // EVALUATIONS[self.budget], 1))
        settings.setdefault("eval_batches", VALIDATION_BATCHES[self.budget])
        return TrainConfig(task=task, mechanism=mechanism, **settings)

    def settings(self) -> Dict[str, Any]:
        """What must not change between an interrupted run and its continuation."""
        return {"budget": self.budget, "overrides": self.overrides,
                "cells": {task: self.train_config(task, "softmax").as_dict() for task in self.task_names}}


def _train_command(config: TrainConfig, cell: Path, resume: bool, threads: Optional[int]) -> List[str]:
    command = [sys.executable, "-m", "attnzoo.cli", "train"]
    if resume:
        command += ["--resume", str(cell)]
    else:
        defaults = TrainConfig(task=config.task)
        command += [config.task, "--mechanism", config.mechanism, "--output", str(cell)]
        if config.task_options:
            command += ["--task-options", json.dumps(config.task_options)]
        if config.mechanism_options:
            command += ["--mechanism-options", json.dumps(config.mechanism_options)]
        for key, value in config.as_dict().items():
            if key in ("task", "mechanism", "task_options", "mechanism_options") or value == getattr(defaults, key):
                continue
            if isinstance(value, bool):  # a yes/no field is a flag (--copy-mechanism), given only when True
                command += ["--" + key.replace("_", "-")] if value else []
                continue
            command += ["--" + key.replace("_", "-"), str(value)]
    if threads:
        command += ["--threads", str(threads)]
    return command + ["--quiet"]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


def run_cell(config: TrainConfig, cell: Path, timeout_s: float, threads: Optional[int]) -> Dict[str, Any]:
    """Train one cell in a fresh process (resuming its checkpoint if it has one); its row as a dict."""
    resume = (cell / "checkpoints" / "LATEST").exists()
    command = _train_command(config, cell, resume, threads)
    cell.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {"status": "too slow", "reason": f"not finished in {timeout_s:.0f} s (its checkpoint is kept)",
                "command": command}
    seconds = time.perf_counter() - began
    if done.returncode != 0 or not (cell / "results.json").exists():
        return {"status": "failed", "reason": _last_line(done.stderr) or f"exit code {done.returncode}",
                "command": command, "seconds": round(seconds, 1)}
    result = json.loads((cell / "results.json").read_text())
    return {"status": "ok", "command": result.get("command") or command, "seconds": round(seconds, 1),
            "test": result["test"], "validation": result["validation"], "baseline": result["baseline"],
            "tokens_per_second": result["tokens_per_second"], "peak_memory_mib": result.get("peak_memory_mib"),
            "parameters": result["parameters"], "train_seconds": result["train_seconds"]}


def run_cells(trainings: Sequence[Tuple[Any, TrainConfig, Path]], timeout_s: float, threads: Optional[int],
              jobs: int) -> Iterator[Tuple[Any, Path, Dict[str, Any]]]:
    """Train ``(key, config, cell directory)`` runs ``jobs`` at a time, each by :func:`run_cell` in its own
    process; yields ``(key, cell directory, row)`` as each finishes. Every process gets ``threads`` torch
    threads (1 by default when several run together: small models gain more from a core each than from two
    threads sharing both)."""
    threads = threads or (1 if jobs > 1 else None)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_cell, config, cell, timeout_s, threads): (key, cell)
                   for key, config, cell in trainings}
        for future in as_completed(futures):
            key, cell = futures[future]
            yield key, cell, future.result()


def run_lra(config: LraConfig, output: Path, argv: Sequence[str],
            progress: Optional[Callable[[str], None]] = None,
            set_total: Optional[Callable[[int], None]] = None) -> Dict[str, Any]:
    """Run (or continue) every cell; returns the collected data and writes lra.json, lra.md and lra.png."""
    output.mkdir(parents=True, exist_ok=True)
    settings_path = output / SETTINGS_JSON
    settings = config.settings()
    if settings_path.exists():
        previous = json.loads(settings_path.read_text())
        if previous != json.loads(json.dumps(settings)):
            raise ValueError(f"--output {output} holds an lra run with other settings (budget or overrides); "
                             "continue it with the same ones, or choose another --output")
    else:
        settings_path.write_text(json.dumps(settings, indent=2))
    timeout = config.cell_timeout_s or CELL_TIMEOUT_S[config.budget]
    tasks, mechanisms = config.task_names, config.mechanism_names
    if set_total is not None:
        set_total(len(tasks) * len(mechanisms))
    cells: Dict[str, Dict[str, Dict[str, Any]]] = {task: {} for task in tasks}
    baselines: Dict[str, Dict[str, float]] = {}
    metrics: Dict[str, str] = {}
    pending = []
    for task_name in tasks:
        task = load_task(task_name, **config.train_config(task_name, "softmax").task_options)
        baselines[task_name], metrics[task_name] = task.baseline(), task.metric
        for mechanism in mechanisms:
            saved = output / "cells" / task_name / mechanism / CELL_JSON
            if saved.exists():  # finished before: kept as it is
                cells[task_name][mechanism] = json.loads(saved.read_text())
            else:
                train_config = config.train_config(task_name, mechanism)
                try:
                    reasons = unsupported_reasons(train_config, task)
                except Exception as error:  # noqa: BLE001 - a mechanism that cannot even be built is a row
                    reasons = [f"cannot be built: {type(error).__name__}: {error}"]
                if reasons:
                    _finish(cells, saved, task_name, mechanism, {"status": "unsupported", "reason": "; ".join(reasons)})
                else:
                    pending.append((task_name, mechanism, train_config, saved.parent))
                    continue
            if progress is not None:
                progress(f"{task_name} / {mechanism}: {cells[task_name][mechanism]['status']}")
    trainings = [((task_name, mechanism), train_config, cell_dir)
                 for task_name, mechanism, train_config, cell_dir in pending]
    for (task_name, mechanism), cell_dir, row in run_cells(trainings, timeout, config.threads, config.jobs):
        _finish(cells, cell_dir / CELL_JSON, task_name, mechanism, row)
        if progress is not None:
            progress(f"{task_name} / {mechanism}: {cells[task_name][mechanism]['status']}")
    cells = {task: {m: cells[task][m] for m in mechanisms} for task in tasks}  # in the order asked for
    data = collect(config, tasks, mechanisms, cells, baselines, metrics, argv)
    write_lra(data, output)
    return data


def _finish(cells: Dict[str, Dict[str, Dict[str, Any]]], saved: Path, task: str, mechanism: str,
            row: Dict[str, Any]) -> None:
    """Record a cell's row; finished and unsupported rows are kept on disk (failures are tried again next run)."""
    cells[task][mechanism] = row
    if row["status"] in ("ok", "unsupported"):
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(row, indent=2))


def _score(row: Dict[str, Any], metric: str) -> Optional[float]:
    if row.get("status") != "ok":
        return None
    return row["test"].get(metric)


def collect(config: LraConfig, tasks: List[str], mechanisms: List[str], cells: Dict[str, Dict[str, Dict[str, Any]]],
            baselines: Dict[str, Dict[str, float]], metrics: Dict[str, str], argv: Sequence[str]) -> Dict[str, Any]:
    """lra.json's content: per-cell rows, per-mechanism averages, baselines."""
    accuracy_tasks = [t for t in tasks if metrics[t] == "accuracy"]
    summary = []
    for mechanism in mechanisms:
        scores = {t: _score(cells[t][mechanism], metrics[t]) for t in tasks}
        accuracies = [scores[t] for t in accuracy_tasks]
        complete = bool(accuracies) and all(a is not None for a in accuracies)
        speeds = [cells[t][mechanism]["tokens_per_second"] for t in tasks if cells[t][mechanism].get("status") == "ok"]
        memory = [cells[t][mechanism].get("peak_memory_mib") for t in tasks if cells[t][mechanism].get("status") == "ok"]
        summary.append({
            "mechanism": mechanism, "scores": scores,
            "average_accuracy": sum(accuracies) / len(accuracies) if complete else None,
            "tokens_per_second": sum(speeds) / len(speeds) if speeds else None,
            "peak_memory_mib": max((m for m in memory if m is not None), default=None),
        })
    rows = [{"mechanism": m, "task": t, "accuracy": _score(cells[t][m], "accuracy")}
            for t in accuracy_tasks for m in mechanisms if _score(cells[t][m], "accuracy") is not None]
    return {"command": list(argv), "budget": config.budget, "tasks": tasks, "metrics": metrics,
            "baselines": baselines, "cells": cells, "summary": summary, "rows": rows,
            "settings": {t: config.train_config(t, "softmax").as_dict() for t in tasks}}


def _cell_text(row: Dict[str, Any], metric: str) -> str:
    if row.get("status") == "ok":
        value = row["test"][metric]
        return f"{100 * value:.1f}" if metric == "accuracy" else f"{value:.3f} bpb"
    return {"unsupported": "n/a", "failed": "failed", "too slow": "too slow"}.get(row.get("status"), "?")


def render_markdown(data: Dict[str, Any]) -> str:
    """LRA's Table 1 layout: tasks as columns (accuracy %, bits per byte for bytes), the average of the
    accuracy tasks last, the trivial baselines as the last row, and why each missing cell is missing."""
    tasks, metrics = data["tasks"], data["metrics"]
    accuracy_tasks = [t for t in tasks if metrics[t] == "accuracy"]
    header = ["mechanism", *[f"{t} ({'acc %' if metrics[t] == 'accuracy' else 'bpb, lower is better'})"
                             for t in tasks], "average acc %"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for entry in data["summary"]:
        name = entry["mechanism"]
        average = entry["average_accuracy"]
        cells = [_cell_text(data["cells"][t][name], metrics[t]) for t in tasks]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'-' if average is None else f'{100 * average:.1f}'} |")
    baseline_cells = []
    for t in tasks:
        value = data["baselines"][t][metrics[t]]
        baseline_cells.append(f"{100 * value:.1f}" if metrics[t] == "accuracy" else f"{value:.3f} bpb")
    base_average = [data["baselines"][t]["accuracy"] for t in accuracy_tasks]
    lines.append("| baseline (majority class / unigram) | " + " | ".join(baseline_cells)
                 + f" | {100 * sum(base_average) / max(len(base_average), 1):.1f} |")
    notes = [f"- {t} / {m}: {row['status']}: {row.get('reason', '')}"
             for t in tasks for m, row in data["cells"][t].items() if row.get("status") != "ok"]
    text = [f"# attnzoo lra, budget {data['budget']}", "", f"Command: `{' '.join(data['command'])}`", "",
            *lines, ""]
    if notes:
        text += ["Missing cells:", "", *notes, ""]
    return "\n".join(text)


def write_lra(data: Dict[str, Any], output: Path) -> Dict[str, Path]:
    from .plots import plot_lra_bubble

    paths = {"json": output / LRA_JSON, "markdown": output / LRA_MD, "plot": output / LRA_PNG}
    paths["json"].write_text(json.dumps(data, indent=2))
    paths["markdown"].write_text(render_markdown(data))
    plot_lra_bubble(data, paths["plot"])
    return paths
