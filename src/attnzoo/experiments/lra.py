"""``attnzoo lra``: every mechanism trained on every task at one fixed budget, as in the Long Range Arena.

Each cell (task x mechanism) is one ``attnzoo train`` run in a fresh process, in its own directory
``OUTPUT/cells/TASK/MECHANISM/`` (:mod:`attnzoo.experiments.cells`: a crash, a hang or an out-of-memory kill
is that cell's row, and the command that reproduces it is recorded). A cell that finished keeps its
``cell.json`` and is not run again; one that was interrupted resumes from its checkpoint. The same settings
go to every mechanism of a task: no mechanism is tuned on its own.

Outputs: ``lra.json`` (cells, table and the command; its rows are what ``attnzoo compare --accuracy`` reads),
``lra.md`` (accuracy per task, mechanisms as rows, the average last, the trivial baselines as a row; then speed
and memory at the long length) and two pictures of average accuracy against speed, bubble area = peak memory
(:mod:`attnzoo.experiments.lra_figures`): ``lra.png`` with the training cells' speed at the tasks' own lengths,
``lra-long.png`` with one attention layer's forward+backward at ``--long-length`` tokens (4,096 by default),
measured in the same run by the kernel benchmark (:mod:`attnzoo.experiments.lra_speed`), as the Long Range Arena
draws it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..bench.results import BASELINE
from ..mechanisms import available as mechanisms_available
from ..tasks import available as tasks_available, load as load_task
from ..training import TrainConfig, unsupported_reasons
from ..training.loop import training_device
from .cells import CELL_JSON, save_row, train_cells, validations
from .lra_speed import (
    DEFAULT_LONG_LENGTH,
    check_long_length,
    long_length_config,
    long_length_summary,
    measure_long_length,
    measured_on,
    training_lengths_text,
)
from .settings import check_cell_settings, check_mechanism_options, check_names, check_preset, keep_settings

LRA_JSON, LRA_MD, LRA_PNG, SETTINGS_JSON = "lra.json", "lra.md", "lra.png", "lra-settings.json"
LRA_LONG_PNG, LRA_CURVES_PNG = "lra-long.png", "lra-curves.png"

# One budget per task: the model, optimiser and data every mechanism gets. The quick budget is sized to run
# every registered mechanism on every task in under 45 minutes on 2 CPU cores (docs/lra.md): the fewest steps
# and examples at which softmax still clears each task's goal (ListOps at batch 16, Pathfinder at 200 steps;
# bytes and recall need their 300 and 600).
# Pathfinder and recall get what lets a small model leave chance within a quick budget (docs/lra.md shows the
# runs without it): rotary positions (relative offsets, which both tasks are about) and, on recall, the token
# shift that puts each value beside its key. The quick Pathfinder is 16 x 16 with three-segment curves: the
# default 32 x 32 images stayed at chance in every run that fits the budget. Its 200 steps were chosen on images
# whose markers' positions gave the label away; on the paired images drawn now no budget tried, up to ten times
# this one, takes softmax off chance (docs/lra.md), so the column is kept at this cost.
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
    # The Long Range Arena's own lengths at the Nystromformer paper's small configuration (2 layers, width 64,
    # 2 heads, feed-forward 128): ListOps of 500 to 2,000 tokens and 32 x 32 Pathfinder (1,024 pixels). Meant
    # for a GPU with every mechanism; on a CPU for a chosen few, with --cell-timeout (a cell out of time is a
    # row with its last validation, and the same command continues it).
    "long": {
        "listops": dict(task_options=dict(min_length=500, max_length=2000), dim=64, depth=2, heads=2, ff_dim=128,
                        batch_size=32, steps=5000, lr=1e-3),
        "pathfinder": dict(task_options={}, dim=64, depth=2, heads=2, ff_dim=128, positional="rotary",
                           batch_size=32, steps=5000, lr=1e-3),
    },
}
# Published test accuracies of a preset's model on its tasks, drawn beside its learning curves: task ->
# (accuracy, source with the budget it was trained at, which is the paper's, not the preset's: the Nystromformer
# code's lra_config.py trains on far more examples, with dropout 0.1 and lr 1e-4).
PUBLISHED: Dict[str, Dict[str, Tuple[float, str]]] = {
    "long": {"listops": (0.371, "Nystromformer, Table 3, softmax: 96,000 training examples, 5,000 steps of "
                                "batch 32"),
             "pathfinder": (0.742, "Nystromformer, Table 3, softmax: 62,400 steps of batch 256")},
}
# Validation passes per cell, evenly spaced (each also writes a checkpoint), and the batches each one reads
# (None: the whole split). The table reports the whole test split, so the quick budget validates once, at the
# end, on a few batches, and spends the time training; the full budget's five full passes give a learning curve
# and checkpoints to resume from.
EVALUATIONS = {"quick": 1, "full": 5, "long": 10}
VALIDATION_BATCHES = {"quick": 4, "full": None, "long": 8}
# A cell that runs past its timeout is a row that says so. The slowest quick cells now take 2-3 minutes
# (docs/lra.md); before the speed-ups one took 597 s. The 1200 s leave room for a slower machine.
CELL_TIMEOUT_S = {"quick": 1200.0, "full": 7200.0, "long": 7200.0}


@dataclass
class LraConfig:
    """What ``attnzoo lra`` runs: a preset (``BUDGETS``' key), the mechanisms (default all) and tasks (default
    all), options of particular mechanisms (``{name: {option: value}}``), and modules to import in every cell
    (``--import``: mechanisms of your own)."""

    preset: str = "quick"
    mechanisms: Optional[List[str]] = None
    tasks: Optional[List[str]] = None
    threads: Optional[int] = None
    jobs: int = 1
    cell_timeout_s: Optional[float] = None
    overrides: Dict[str, Any] = field(default_factory=dict)   # settings applied to every cell (e.g. steps)
    options: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    imports: List[str] = field(default_factory=list)
    long_length: int = DEFAULT_LONG_LENGTH   # where speed and memory are measured for lra-long.png
    device: Optional[str] = None   # where the cells train and the long length is measured (None: the CPU)

    def validate(self) -> None:
        check_preset(self.preset, BUDGETS)
        check_names("--mechanisms", self.mechanisms, mechanisms_available())
        check_names("--tasks", self.tasks, tasks_available())
        elsewhere = [t for t in self.tasks or [] if t not in BUDGETS[self.preset]
                     and any(t in budget for budget in BUDGETS.values())]
        if elsewhere:
            raise ValueError(f"--tasks: the {self.preset} preset has no budget for {', '.join(elsewhere)}; its "
                             f"tasks: {', '.join(BUDGETS[self.preset])}")
        check_cell_settings(self.jobs, self.threads, self.cell_timeout_s)
        try:
            self.recorded_device()  # a device that is not there fails now, not in every cell
        except ValueError as error:
            raise ValueError(f"--{error}") from None
        check_mechanism_options(self.options)
        for task in self.task_names:
            self.train_config(task, BASELINE)  # every override must make a valid config
        dim, heads = self.attention_shape()
        check_long_length(self.long_length, self.mechanism_names, self.options, heads, dim // heads)

    def attention_shape(self) -> Tuple[int, int]:
        """(width, heads) of the long-length measurement: the widest model among the run's tasks."""
        configs = [self.train_config(task, BASELINE) for task in self.task_names]
        widest = max(configs, key=lambda config: config.dim)
        return widest.dim, widest.heads

    @property
    def task_names(self) -> List[str]:
        return list(self.tasks or [t for t in tasks_available() if t in BUDGETS[self.preset]])

    @property
    def mechanism_names(self) -> List[str]:
        return list(self.mechanisms or mechanisms_available())

    def train_config(self, task: str, mechanism: str) -> TrainConfig:
        budget = BUDGETS[self.preset]
        settings = dict(budget.get(task, next(iter(budget.values()))))  # a task of your own: the first's
        settings.update(self.overrides)
        settings.setdefault("eval_interval", max(settings["steps"] // EVALUATIONS[self.preset], 1))
        settings.setdefault("eval_batches", VALIDATION_BATCHES[self.preset])
        if self.options.get(mechanism):
            settings["mechanism_options"] = dict(self.options[mechanism])
        return TrainConfig(task=task, mechanism=mechanism, **settings)

    def settings(self) -> Dict[str, Any]:
        """What must not change between an interrupted run and its continuation."""
        settings = {"budget": self.preset, "overrides": self.overrides,
                    "cells": {task: self.train_config(task, BASELINE).as_dict() for task in self.task_names}}
        if self.options:
            settings["options"] = self.options
        device = self.recorded_device()
        if device is not None:  # cells trained on another device would mix speeds in one table
            settings["device"] = device
        return settings

    def recorded_device(self) -> Optional[str]:
        """The device the cells train on, as the settings record it: None for the CPU, given or not, and a CUDA
        device with its index (``cuda`` is the current one), so that naming one device two ways is one run."""
        if self.device is None:
            return None
        device = training_device(self.device)
        return None if device.type == "cpu" else str(device)


def _unsupported_row(train_config: TrainConfig, task: Any) -> Optional[Dict[str, Any]]:
    """The row of a cell the mechanism cannot train (None when it can)."""
    try:
        reasons = unsupported_reasons(train_config, task)
    except Exception as error:  # noqa: BLE001 - a mechanism that cannot even be built is a row
        reasons = [f"cannot be built: {type(error).__name__}: {error}"]
    return {"status": "unsupported", "reason": "; ".join(reasons)} if reasons else None


def run_lra(config: LraConfig, output: Path, argv: Sequence[str],
            progress: Optional[Callable[[str], None]] = None,
            set_total: Optional[Callable[[int], None]] = None) -> Dict[str, Any]:
    """Run (or continue) every cell; returns the collected data and writes lra.json, lra.md and lra.png."""
    keep_settings(output / SETTINGS_JSON, config.settings(), "an lra run")
    tasks, mechanisms = config.task_names, config.mechanism_names
    if set_total is not None:
        set_total(len(tasks) * len(mechanisms) + 1)  # and the long-length measurement
    baselines: Dict[str, Dict[str, float]] = {}
    metrics: Dict[str, str] = {}
    lengths: Dict[str, int] = {}
    trainings = []
    for task_name in tasks:
        task = load_task(task_name, **config.train_config(task_name, BASELINE).task_options)
        baselines[task_name], metrics[task_name] = task.baseline(), task.metric
        lengths[task_name] = task.seq_len
        for mechanism in mechanisms:
            cell = output / "cells" / task_name / mechanism
            train_config = config.train_config(task_name, mechanism)
            if not (cell / CELL_JSON).exists():  # an unsupported cell is a row kept like a finished one
                unsupported = _unsupported_row(train_config, task)
                if unsupported is not None:
                    save_row(cell, unsupported)
            trainings.append(((task_name, mechanism), train_config, cell))

    def report(key: Any, row: Dict[str, Any], kept: bool) -> None:
        if progress is not None:
            progress(f"{key[0]} / {key[1]}: {row['status']}")

    timeout = config.cell_timeout_s or CELL_TIMEOUT_S[config.preset]
    rows = train_cells(trainings, timeout, config.threads, config.jobs, config.imports, report, config.device)
    cells = {task: {m: rows[(task, m)] for m in mechanisms} for task in tasks}  # in the order asked for
    dim, heads = config.attention_shape()
    measured = measure_long_length(
        long_length_config(config.long_length, mechanisms, config.options, heads, dim // heads, config.threads,
                           config.imports, config.device), output, argv)
    if progress is not None:
        progress(f"speed and memory at N={config.long_length}: measured")
    data = collect(config, tasks, mechanisms, cells, baselines, metrics, argv)
    data["curves"] = {task: {m: learning_curve(output / "cells" / task / m, metrics[task]) for m in mechanisms}
                      for task in tasks}
    data["published"] = {task: {"accuracy": value, "source": source}
                         for task, (value, source) in PUBLISHED.get(config.preset, {}).items() if task in tasks}
    data["training_lengths"] = lengths
    data["long_length"] = long_length_summary(measured, mechanisms, dim)
    write_lra(data, output)
    return data


def learning_curve(cell: Path, metric: str) -> List[List[float]]:
    """[step, validation metric] of every validation pass of a cell, in step order (a step validated again
    after a resume counts once, its latest row)."""
    by_step = {row["step"]: row[metric] for row in validations(cell) if metric in row}
    return [[step, by_step[step]] for step in sorted(by_step)]


def has_curves(data: Dict[str, Any]) -> bool:
    """Whether some cell validated more than once (the quick preset validates once, at the end)."""
    return any(len(curve) > 1 for task in data.get("curves", {}).values() for curve in task.values())


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
        memory = [cells[t][mechanism].get("peak_memory_mib") for t in tasks
                  if cells[t][mechanism].get("status") == "ok"]
        summary.append({
            "mechanism": mechanism, "scores": scores,
            "average_accuracy": sum(accuracies) / len(accuracies) if complete else None,
            "tokens_per_second": sum(speeds) / len(speeds) if speeds else None,
            "peak_memory_mib": max((m for m in memory if m is not None), default=None),
        })
    rows = [{"mechanism": m, "task": t, "accuracy": _score(cells[t][m], "accuracy")}
            for t in accuracy_tasks for m in mechanisms if _score(cells[t][m], "accuracy") is not None]
    return {"command": list(argv), "budget": config.preset, "tasks": tasks, "metrics": metrics,
            "baselines": baselines, "cells": cells, "summary": summary, "rows": rows,
            "settings": {t: config.train_config(t, BASELINE).as_dict() for t in tasks}}


def _metric_text(value: float, metric: str, unit: bool = False) -> str:
    """An accuracy as a percentage, bits per byte to 3 places (followed by " bpb" with ``unit``)."""
    return f"{100 * value:.1f}" if metric == "accuracy" else f"{value:.3f}" + (" bpb" if unit else "")


def _cell_text(row: Dict[str, Any], metric: str) -> str:
    if row.get("status") == "ok":
        value = row["test"][metric]
        return _metric_text(value, metric, unit=True)
    reached = row.get("last_validation") or {}
    if row.get("status") == "too slow" and reached.get(metric) is not None:
        value = reached[metric]
        shown = _metric_text(value, metric, unit=True)
        return f"out of time ({shown} validation at step {reached['step']})"
    return {"unsupported": "n/a", "failed": "failed", "too slow": "out of time"}.get(row.get("status"), "?")


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
        baseline_cells.append(_metric_text(value, metrics[t], unit=True))
    base_average = [data["baselines"][t]["accuracy"] for t in accuracy_tasks]
    lines.append("| baseline (majority class / unigram) | " + " | ".join(baseline_cells)
                 + f" | {100 * sum(base_average) / max(len(base_average), 1):.1f} |")
    notes = [f"- {t} / {m}: {row['status']}: {row.get('reason', '')}"
             for t in tasks for m, row in data["cells"][t].items() if row.get("status") != "ok"]
    text = [f"# attnzoo lra, preset {data['budget']}", "", f"Command: `{' '.join(data['command'])}`", ""]
    if data.get("training_lengths"):
        text += [f"Trained and tested at the tasks' own lengths ({training_lengths_text(data)} tokens).", ""]
    text += [*lines, ""]
    if notes:
        text += ["Missing cells:", "", *notes, ""]
    return "\n".join(text + render_curves(data) + render_long_length(data))


def render_curves(data: Dict[str, Any]) -> List[str]:
    """Per task, the validation metric of every mechanism at each validation step (lra-curves.png's lines), and
    the published figure at the preset's settings where there is one."""
    if not has_curves(data):
        return []
    lines = ["## Learning curves", "",
             "The validation metric at each validation step (the table above is the whole test split at the "
             "end), drawn in `lra-curves.png`; a cell that did not finish says why beside its name.", ""]
    for task, curves in data["curves"].items():
        metric = data["metrics"][task]
        batches = data["settings"][task].get("eval_batches")
        read = "the whole validation split" if batches is None else f"the first {batches} validation batches"
        unit = "accuracy %" if metric == "accuracy" else "bpb, lower is better"
        lines += [f"### {task} (validation {unit}, {read})", ""]
        steps = sorted({int(step) for curve in curves.values() for step, _ in curve})
        if not steps:
            lines += ["No cell has validated yet.", ""]
            continue
        lines += ["| mechanism | " + " | ".join(f"step {step}" for step in steps) + " |", "|---|" + "---|" * len(steps)]
        for mechanism, curve in curves.items():
            status = data["cells"][task][mechanism].get("status")
            name = mechanism if status == "ok" else f"{mechanism} ({_cell_text({'status': status}, metric)})"
            at = {int(step): value for step, value in curve}
            lines.append(f"| {name} | " + " | ".join(_metric_text(at[step], metric) if step in at else "-"
                                                     for step in steps) + " |")
        published = data.get("published", {}).get(task)
        if published:
            lines.append(f"| published ({published['source']}) | test accuracy "
                         f"{_metric_text(published['accuracy'], 'accuracy')} |" + " |" * (len(steps) - 1))
        lines.append("")
    return lines


def _number(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def render_long_length(data: Dict[str, Any]) -> List[str]:
    """The speed and memory table at the long length (lra-long.png's x axis and bubbles), one row per mechanism."""
    long = data.get("long_length")
    if long is None:
        return []
    lines = [f"## Speed and memory at N={long['length']}", "",
             f"One attention layer's forward+backward, batch {long['batch']}, {long['heads']} heads of width "
             f"{long['head_dim']} (the model's width {long['dim']}), {measured_on(long)}, "
             f"{long['repeats']} timed repeat(s); peak memory in a fresh process per mechanism. Measured by the "
             f"kernel benchmark (`{long['files']}`).", "",
             "| mechanism | forward+backward ms | tokens/s | peak memory MiB | speed vs softmax | memory vs softmax |"
             " status |", "|---|---|---|---|---|---|---|"]
    for row in long["rows"]:
        status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('reason') or ''}"
        lines.append(f"| {row['mechanism']} | {_number(row['forward_backward_ms'], 1)} | "
                     f"{_number(row['tokens_per_second'], 0)} | {_number(row['peak_memory_mib'], 1)} | "
                     f"{_number(row['speed_vs_softmax'], 2)} | {_number(row['memory_vs_softmax'], 2)} | {status} |")
    return lines + [""]


def write_lra(data: Dict[str, Any], output: Path) -> Dict[str, Path]:
    from .lra_figures import plot_curves, plot_long_length, plot_training_length

    paths = {"json": output / LRA_JSON, "markdown": output / LRA_MD, "plot": output / LRA_PNG}
    paths["json"].write_text(json.dumps(data, indent=2))
    paths["markdown"].write_text(render_markdown(data))
    plot_training_length(data, paths["plot"])
    if data.get("long_length") is not None:
        paths["long_plot"] = output / LRA_LONG_PNG
        plot_long_length(data, paths["long_plot"])
    if has_curves(data):
        paths["curves_plot"] = output / LRA_CURVES_PNG
        plot_curves(data, paths["curves_plot"])
    return paths
