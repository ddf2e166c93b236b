"""``attnzoo mqar``: Zoology's MQAR sweep: which mechanisms recall many pairs, at which model width and state size.

Each cell is one ``attnzoo train mqar`` run (a schedule of layers x a model width x a learning rate) in a fresh
process, in its own directory ``OUTPUT/cells/SCHEDULE/dWIDTH/lrLR/`` (:mod:`attnzoo.experiments.cells`: a
finished cell is kept, an interrupted one resumes from its checkpoint, a crash or a timeout is a row saying
why). Per (schedule, width) the learning rate with the best validation accuracy is chosen, and its test
accuracy reported, beside the model's decoding state in bytes per sequence after ``seq_len`` tokens
(:func:`state_bytes`: what each layer's mechanism declares in its ``state_layout``, a KV cache counted at
``seq_len`` positions).

Outputs: ``mqar.json`` (every cell's row, the table, the settings and the command), ``mqar.csv`` (the table: one
row per schedule and width), ``mqar.md`` and ``mqar.png`` (test accuracy against width, and against state size,
one line per schedule; :mod:`attnzoo.experiments.mqar_figures`). The presets are
:mod:`attnzoo.experiments.mqar_presets`.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..mechanisms import Mechanism
from ..models.config import BLOCKS
from ..models.mamba2 import Mamba2Block
from ..models.schedule import format_schedule, parse_schedule
from ..tasks import Task, load as load_task
from ..training import TrainConfig, build_model, unsupported_reasons
from ..training.loop import training_device
from .cells import train_cells
from .mqar_presets import CELL_TIMEOUT_S, MODEL, PRESETS
from .settings import check_cell_settings, check_preset, keep_settings

TASK = "mqar"
MQAR_JSON, MQAR_CSV, MQAR_MD, MQAR_PNG, SETTINGS_JSON = "mqar.json", "mqar.csv", "mqar.md", "mqar.png", \
    "mqar-settings.json"
Key = Tuple[str, int, float]  # schedule, width, learning rate


@dataclass
class MqarConfig:
    """What ``attnzoo mqar`` runs: a preset (:data:`~attnzoo.experiments.mqar_presets.PRESETS`' key) and, in
    place of its own, the ``schedules`` (``--layers`` texts), model ``widths``, learning rates ``lrs`` and
    ``steps``; how cells run (``jobs``, ``threads``, ``cell_timeout_s``, ``device``) and modules to import in
    every cell (``--import``: mechanisms of your own)."""

    preset: str = "quick"
    schedules: Optional[List[str]] = None
    widths: Optional[List[int]] = None
    lrs: Optional[List[float]] = None
    steps: Optional[int] = None
    threads: Optional[int] = None
    jobs: int = 1
    cell_timeout_s: Optional[float] = None
    imports: List[str] = field(default_factory=list)
    device: Optional[str] = None

    def validate(self) -> None:
        """Every setting checked before any cell runs: an error names the command-line option."""
        check_preset(self.preset, PRESETS)
        check_cell_settings(self.jobs, self.threads, self.cell_timeout_s)
        _check_list("--widths", self.widths, lambda w: isinstance(w, int) and not isinstance(w, bool) and w >= 1
                    and w % MODEL["heads"] == 0, f"a whole multiple of the {MODEL['heads']} heads")
        _check_list("--lrs", self.lrs, lambda lr: isinstance(lr, (int, float)) and not isinstance(lr, bool)
                    and math.isfinite(lr) and lr > 0, "a positive number")
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps < 1):
            raise ValueError(f"--steps must be an integer >= 1, got {self.steps!r}")
        try:
            self.recorded_device()  # a device that is not there fails now, not in every cell
        except ValueError as error:
            raise ValueError(f"--{error}") from None
        self._check_schedules()

    def _check_schedules(self) -> None:
        if self.schedules is not None and not self.schedules:
            raise ValueError("--schedule: give at least one")
        folders: Dict[str, str] = {}
        task = self.small_task()
        for text in self.schedules or []:
            schedule = _spelled(text)
            try:  # the items' options are checked with the model's shape
                reasons = unsupported_reasons(self.train_config(schedule, self.width_list[0], self.lr_list[0]), task)
            except (TypeError, ValueError) as error:
                raise ValueError(f"--schedule {text!r}: {error}") from None
            if reasons:
                raise ValueError(f"--schedule {text!r} cannot train on {TASK}: " + "; ".join(reasons))
            folder = schedule_folder(schedule)
            if folder in folders:
                raise ValueError(f"--schedule {text!r} is {folders[folder]!r} again (both write cells/{folder})")
            folders[folder] = text

    # -- what the preset gives, or what was given in its place -------------------------------------------------
    @property
    def schedule_list(self) -> List[str]:
        """The schedules in the one spelling a run records (``gated_delta(conv_size=4),softmax``)."""
        return [_spelled(text) for text in self.schedules or PRESETS[self.preset]["schedules"]]

    @property
    def width_list(self) -> List[int]:
        return list(self.widths or PRESETS[self.preset]["widths"])

    @property
    def lr_list(self) -> List[float]:
        return [float(lr) for lr in self.lrs or PRESETS[self.preset]["lrs"]]

    @property
    def task_options(self) -> Dict[str, Any]:
        return dict(PRESETS[self.preset]["task_options"])

    def small_task(self) -> Task:
        """The task at the preset's sequences, one example per split: what the model checks and builds need."""
        return load_task(TASK, **{**self.task_options, "train_size": 1, "validation_size": 1, "test_size": 1})

    def train_config(self, schedule: str, width: int, lr: float) -> TrainConfig:
        """One cell's settings: the preset's model and budget, this schedule, width and learning rate."""
        budget = dict(PRESETS[self.preset]["train"])
        if self.steps is not None:
            budget["steps"] = self.steps
        return TrainConfig(task=TASK, task_options=self.task_options, layers=schedule, dim=width, lr=lr,
                           eval_interval=budget["steps"], **MODEL, **budget)

    def cells(self, output: Path) -> List[Tuple[Key, TrainConfig, Path]]:
        """Every (key, config, directory) of the sweep, schedules outermost."""
        return [((schedule, width, lr), self.train_config(schedule, width, lr),
                 output / "cells" / schedule_folder(schedule) / f"d{width}" / f"lr{lr:g}")
                for schedule in self.schedule_list for width in self.width_list for lr in self.lr_list]

    def settings(self) -> Dict[str, Any]:
        """What must not change between an interrupted run and its continuation."""
        settings: Dict[str, Any] = {"preset": self.preset, "schedules": self.schedule_list,
                                    "widths": self.width_list, "lrs": self.lr_list,
                                    "cell": self.train_config(self.schedule_list[0], self.width_list[0],
                                                              self.lr_list[0]).as_dict()}
        device = self.recorded_device()
        if device is not None:  # cells trained on another device would mix speeds in one table
            settings["device"] = device
        return settings

    def recorded_device(self) -> Optional[str]:
        """None for the CPU, else the CUDA device with its index (as ``attnzoo lra`` records it)."""
        if self.device is None:
            return None
        device = training_device(self.device)
        return None if device.type == "cpu" else str(device)


def _check_list(option: str, values: Optional[Sequence[Any]], good: Callable[[Any], bool], wanted: str) -> None:
    if values is None:
        return
    if not values:
        raise ValueError(f"{option}: give at least one value")
    bad = [value for value in values if not good(value)]
    if bad:
        raise ValueError(f"{option}: each must be {wanted}, got {bad[0]!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{option}: a value is given twice ({', '.join(map(str, values))})")


def _spelled(text: str) -> str:
    """A schedule in the one spelling a run records; a bad one is an error naming ``--schedule``."""
    if not isinstance(text, str):
        raise TypeError(f"--schedule must be a --layers text, got {text!r}")
    return format_schedule(parse_schedule(text, BLOCKS, "--schedule"))


def schedule_folder(schedule: str) -> str:
    """The folder name of a schedule's cells: its text with every run of other characters than letters,
    digits, ``_``, ``.`` and ``=`` as one ``+`` (``gated_delta(conv_size=4),softmax`` ->
    ``gated_delta+conv_size=4+softmax``)."""
    return re.sub(r"[^A-Za-z0-9_.=]+", "+", schedule).strip("+")


# -- the state a model decodes with ---------------------------------------------------------------------------
def state_bytes(model: nn.Module, seq_len: int) -> Optional[int]:
    """Bytes per sequence of ``model``'s decoding state after ``seq_len`` tokens, in float32: every tensor each
    mechanism's ``state_layout`` declares (a size that grows with the positions, a KV cache's, counted at
    ``seq_len``), and a Mamba-2 block's convolution window and SSM state. None when some mechanism has no
    recurrent step (no state to count). The token shift's one previous embedding is not counted."""
    total = 0
    for module in model.modules():
        if isinstance(module, Mechanism):
            if not module.capabilities.recurrent_step:
                return None
            for shape, dtype in module.state_layout(torch.float32).values():
                total += math.prod(seq_len if size is None else size for size in shape) * dtype.itemsize
        elif isinstance(module, Mamba2Block):
            state = module.empty_state(torch.zeros(1, 1, module.config.dim))
            total += sum(t.numel() * t.element_size() for t in (state.conv, state.ssm))
    return total


def model_facts(config: MqarConfig) -> Dict[Tuple[str, int], Dict[str, Any]]:
    """Per (schedule, width): the state in bytes per sequence and the parameters, from the model built once."""
    task = config.small_task()
    facts = {}
    for schedule in config.schedule_list:
        for width in config.width_list:
            torch.manual_seed(0)
            model = build_model(config.train_config(schedule, width, config.lr_list[0]), task)
            facts[(schedule, width)] = {"state_bytes": state_bytes(model, task.seq_len),
                                        "parameters": sum(p.numel() for p in model.parameters())}
    return facts


# -- the run ------------------------------------------------------------------------------------------------
def run_mqar(config: MqarConfig, output: Path, argv: Sequence[str],
             progress: Optional[Callable[[str], None]] = None,
             set_total: Optional[Callable[[int], None]] = None) -> Dict[str, Any]:
    """Run (or continue) every cell; returns the collected data and writes mqar.json, .csv, .md and .png."""
    keep_settings(output / SETTINGS_JSON, config.settings(), "an mqar run")
    cells = config.cells(output)
    if set_total is not None:
        set_total(len(cells))

    def report(key: Any, row: Dict[str, Any], kept: bool) -> None:
        if progress is not None:
            schedule, width, lr = key
            reason = "" if row["status"] == "ok" else f" ({row.get('reason', '')})"
            progress(f"{schedule} width {width} lr {lr:.2g}: {_row_text(row)}{reason}" + (" (kept)" if kept else ""))

    timeout = config.cell_timeout_s or CELL_TIMEOUT_S[config.preset]
    rows = train_cells(cells, timeout, config.threads, config.jobs, config.imports, report, config.device)
    test = load_task(TASK, **config.task_options)
    data = collect(config, rows, model_facts(config), test.baseline()["accuracy"], argv)
    write_mqar(data, output)
    return data


def _row_text(row: Dict[str, Any]) -> str:
    if row.get("status") == "ok":
        return f"test accuracy {100 * row['test']['accuracy']:.1f}%, {row.get('seconds', 0):.0f} s"
    return str(row.get("status"))


def _accuracy(row: Dict[str, Any], split: str) -> Optional[float]:
    return row[split].get("accuracy") if row.get("status") == "ok" else None


def best_of(rows: Dict[float, Dict[str, Any]]) -> Optional[float]:
    """The learning rate whose cell has the best validation accuracy (the first of equals; None if none
    finished): chosen on validation, so that the test accuracy reported is not itself the choice."""
    finished = [(lr, _accuracy(row, "validation")) for lr, row in rows.items() if _accuracy(row, "validation")
                is not None]
    return max(finished, key=lambda item: item[1])[0] if finished else None


def collect(config: MqarConfig, rows: Dict[Key, Dict[str, Any]], facts: Dict[Tuple[str, int], Dict[str, Any]],
            baseline: float, argv: Sequence[str]) -> Dict[str, Any]:
    """mqar.json's content: the table (one entry per schedule and width), every cell and the settings."""
    table = []
    for schedule in config.schedule_list:
        for width in config.width_list:
            by_lr = {lr: rows[(schedule, width, lr)] for lr in config.lr_list}
            best = best_of(by_lr)
            table.append({
                "schedule": schedule, "width": width, **facts[(schedule, width)], "best_lr": best,
                "validation_accuracy": None if best is None else _accuracy(by_lr[best], "validation"),
                "test_accuracy": None if best is None else _accuracy(by_lr[best], "test"),
                "test_accuracy_by_lr": {f"{lr:g}": _accuracy(row, "test") for lr, row in by_lr.items()},
                "seconds": sum(row.get("seconds") or 0 for row in by_lr.values()),
            })
    cells = [{"schedule": s, "width": w, "lr": lr, **row} for (s, w, lr), row in rows.items()]
    options = config.task_options
    return {"command": list(argv), "preset": config.preset, "task_options": options, "baseline": baseline,
            "chance": 1 / (options["vocab_size"] - options["vocab_size"] // 2), "lrs": config.lr_list,
            "table": table, "cells": cells, "settings": config.settings()["cell"]}


# -- the outputs --------------------------------------------------------------------------------------------
def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def render_markdown(data: Dict[str, Any]) -> str:
    """The table: one row per schedule and width, the state size, the best learning rate's test accuracy,
    and the test accuracy at every learning rate; why each missing cell is missing."""
    options, lrs = data["task_options"], data["lrs"]
    settings = data["settings"]
    lines = [f"# attnzoo mqar, preset {data['preset']}", "", f"Command: `{' '.join(data['command'])}`", "",
             f"{options['num_pairs']} key-value pairs in {options['seq_len']} tokens, vocabulary "
             f"{options['vocab_size']} ({options['train_size']:,} training sequences); {settings['depth']} layers, "
             f"{settings['heads']} heads, {settings['steps']} steps of batch {settings['batch_size']}. The learning "
             f"rate is chosen on validation; accuracy is on the test split's {options['test_size']:,} sequences. "
             f"Chance {100 * data['chance']:.1f}% (one value of {round(1 / data['chance'])}).", "",
             "| schedule | width | state bytes/sequence | parameters | best lr | test acc % | "
             + " | ".join(f"acc % at lr {lr:.2g}" for lr in lrs) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(lrs)]
    for entry in data["table"]:
        state = "-" if entry["state_bytes"] is None else f"{entry['state_bytes']:,}"
        best = "-" if entry["best_lr"] is None else f"{entry['best_lr']:.2g}"
        each = " | ".join(_percent(entry["test_accuracy_by_lr"][f"{lr:g}"]) for lr in lrs)
        lines.append(f"| {entry['schedule']} | {entry['width']} | {state} | {entry['parameters']:,} | {best} | "
                     f"{_percent(entry['test_accuracy'])} | {each} |")
    notes = [f"- {cell['schedule']} width {cell['width']} lr {cell['lr']:.2g}: {cell['status']}: "
             f"{cell.get('reason', '')}" for cell in data["cells"] if cell.get("status") != "ok"]
    return "\n".join(lines + ([""] + ["Missing cells:", "", *notes] if notes else []) + [""])


CSV_FIELDS = ("schedule", "width", "state_bytes", "parameters", "best_lr", "validation_accuracy", "test_accuracy",
              "seconds")


def write_csv(data: Dict[str, Any], path: Path) -> None:
    """The table as CSV: one row per schedule and width, then the test accuracy at each learning rate."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*CSV_FIELDS, *(f"test_accuracy_lr_{lr:g}" for lr in data["lrs"])])
        for entry in data["table"]:
            writer.writerow([*("" if entry[name] is None else entry[name] for name in CSV_FIELDS),
                             *("" if entry["test_accuracy_by_lr"][f"{lr:g}"] is None
                               else entry["test_accuracy_by_lr"][f"{lr:g}"] for lr in data["lrs"])])


def write_mqar(data: Dict[str, Any], output: Path) -> Dict[str, Path]:
    from .mqar_figures import plot_mqar

    paths = {"json": output / MQAR_JSON, "csv": output / MQAR_CSV, "markdown": output / MQAR_MD,
             "plot": output / MQAR_PNG}
    paths["json"].write_text(json.dumps(data, indent=2))
    write_csv(data, paths["csv"])
    paths["markdown"].write_text(render_markdown(data))
    plot_mqar(data, paths["plot"])
    return paths
