"""``attnzoo seq2seq-report``: the sequence-to-sequence comparisons of docs/seq2seq.md, trained at one fixed
budget and measured by one command.

Each training run is a cell, one ``attnzoo train`` run in a fresh process in ``OUTPUT/cells/NAME/`` (as
``attnzoo lra``: a finished cell keeps its ``cell.json`` and is not run again, an interrupted one resumes from
its checkpoint, a failed one is a row saying why and is tried again next time). Within a task every cell has
the same model size, steps, batch, learning rate and seed; only the setting compared differs. Then the runs
are measured in this process (:mod:`attnzoo.experiments.seq2seq_eval`) and the report is written:

* ``seq2seq-report.md``: the tables (AT vs NAT; teacher forcing vs scheduled sampling; the copy mechanism;
  the guide loss; greedy vs beam and monotonic inference), the command and the machine;
* ``seq2seq-report.json``: everything the tables are made of;
* ``guide-loss-over-steps.png`` and ``cross-attention-maps.png`` (:mod:`attnzoo.experiments.seq2seq_figures`).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..bench.results import BASELINE
from ..mechanisms import available as mechanisms_available
from ..training import TrainConfig
from .cells import train_cells
from .settings import check_cell_settings, check_mechanism_options, check_names, check_preset, keep_settings

REPORT_JSON, REPORT_MD, SETTINGS_JSON = "seq2seq-report.json", "seq2seq-report.md", "seq2seq-report-settings.json"
GUIDE_CURVES_PNG, ATTENTION_PNG = "guide-loss-over-steps.png", "cross-attention-maps.png"
# The guide loss (width 0.2, in [0, 1)) under which the cross-attention counts as diagonal: the guided g2p
# model of docs/seq2seq.md ended at 0.05, the unguided one at 0.13.
GUIDE_THRESHOLD = 0.1

_SMALL_SPLITS = {"validation_size": 500, "test_size": 500}
# One budget per task: what every cell of that task trains with.
BUDGETS: Dict[str, Dict[str, Dict[str, Any]]] = {
    "quick": {
        "reverse": dict(task_options=dict(_SMALL_SPLITS), dim=64, depth=2, heads=4, batch_size=32, steps=1000,
                        lr=2e-3, eval_interval=200, eval_batches=4),
        "g2p": dict(task_options=dict(_SMALL_SPLITS), dim=64, depth=2, heads=4, batch_size=64, steps=1000,
                    lr=2e-3, eval_interval=100, eval_batches=4),
        "copy-names": dict(task_options=dict(_SMALL_SPLITS), dim=64, depth=2, heads=4, batch_size=32, steps=500,
                           lr=1e-3, eval_interval=250, eval_batches=4),
    },
    "full": {
        "reverse": dict(task_options={}, dim=128, depth=3, heads=4, batch_size=64, steps=4000, lr=1e-3,
                        eval_interval=500, eval_batches=8),
        "g2p": dict(task_options={"validation_size": 1000, "test_size": 2000}, dim=128, depth=3, heads=4,
                    batch_size=64, steps=6000, lr=1e-3, eval_interval=250, eval_batches=8),
        "copy-names": dict(task_options={}, dim=128, depth=3, heads=4, batch_size=32, steps=2000, lr=1e-3,
                           eval_interval=500, eval_batches=8),
    },
}
# How the trained models are measured: the batch sizes and sentences timed for AT vs NAT, rounds of timing.
MEASURE: Dict[str, Dict[str, Any]] = {
    "quick": dict(batch_sizes=(1, 32), timed_sentences=100, nat_repeats=3, decoder_repeats=1),
    "full": dict(batch_sizes=(1, 100), timed_sentences=200, nat_repeats=5, decoder_repeats=2),
}
CELL_TIMEOUT_S = {"quick": 1200.0, "full": 14400.0}

# Every training run: name -> (task, the settings it changes from its task's budget).
CELLS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "reverse-at": ("reverse", {}),
    "reverse-nat": ("reverse", {"decoding": "non-autoregressive"}),
    "g2p-at": ("g2p", {}),
    "g2p-nat": ("g2p", {"decoding": "non-autoregressive"}),
    "g2p-token": ("g2p", {"scheduled_sampling": "token"}),
    "g2p-two-pass": ("g2p", {"scheduled_sampling": "two-pass"}),
    "g2p-guided": ("g2p", {"guide_loss": 1.0}),
    "copy-names-copy": ("copy-names", {"copy_mechanism": True}),
    "copy-names-plain": ("copy-names", {}),
}
# Labels of the runs in the tables.
SAMPLING_ROWS = [("teacher forcing", "g2p-at"), ("scheduled sampling, token", "g2p-token"),
                 ("scheduled sampling, two-pass", "g2p-two-pass")]
GUIDE_ROWS = [("without the guide loss", "g2p-at"), ("with the guide loss (weight 1.0)", "g2p-guided")]
COPY_ROWS = [("with --copy-mechanism", "copy-names-copy"), ("without", "copy-names-plain")]
NAT_PAIRS = [("reverse", "reverse-at", "reverse-nat"), ("g2p", "g2p-at", "g2p-nat")]


@dataclass
class ReportConfig:
    """What ``attnzoo seq2seq-report`` runs: a preset (``BUDGETS``' key), the attention mechanism of every run
    (default softmax) and its options, modules to import in every cell (``--import``), how many cells train at
    once and with how many threads, and overrides applied to every cell (``steps`` and ``eval_interval`` for a
    quick check; ``task_options`` merged into each task's)."""

    preset: str = "quick"
    jobs: int = 1
    threads: Optional[int] = None
    cell_timeout_s: Optional[float] = None
    overrides: Dict[str, Any] = field(default_factory=dict)
    mechanism: str = BASELINE
    options: Dict[str, Any] = field(default_factory=dict)
    imports: List[str] = field(default_factory=list)

    def validate(self) -> None:
        check_preset(self.preset, BUDGETS)
        check_names("--mechanism", [self.mechanism], mechanisms_available())
        check_cell_settings(self.jobs, self.threads, self.cell_timeout_s)
        check_mechanism_options({self.mechanism: self.options})
        for name in CELLS:
            self.train_config(name)  # every override must make a valid config

    def train_config(self, name: str) -> TrainConfig:
        """The config of cell ``name``: its task's budget, the cell's own setting, then the overrides."""
        task, changes = CELLS[name]
        settings = {**BUDGETS[self.preset][task], **changes}
        overrides = dict(self.overrides)
        settings["task_options"] = {**settings["task_options"], **overrides.pop("task_options", {})}
        settings.update(overrides)
        if self.options:
            settings["mechanism_options"] = dict(self.options)
        return TrainConfig(task=task, mechanism=self.mechanism, **settings)

    def settings(self) -> Dict[str, Any]:
        """What must not change between an interrupted run and its continuation."""
        return {"budget": self.preset, "overrides": self.overrides,
                "cells": {name: self.train_config(name).as_dict() for name in CELLS}}


# -- reading the runs --------------------------------------------------------------------------------------
def validation_curve(cell: Path, column: str) -> List[Tuple[int, float]]:
    """[(step, value)] of ``column`` over the validation rows of a run's metrics.csv (empty if it has none)."""
    path = cell / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return [(int(row["step"]), float(row[column])) for row in csv.DictReader(handle)
                if row["split"] == "validation" and row.get(column, "") != ""]


def first_step_under(curve: Sequence[Tuple[int, float]], threshold: float) -> Optional[int]:
    """The first step whose value is below ``threshold`` (None if none is)."""
    return next((step for step, value in curve if value < threshold), None)


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def _measured(label: str, measure: Callable[[], Any], progress: Optional[Callable[[str], None]]) -> Dict[str, Any]:
    """{"status": "ok", "result": ...} or {"status": "failed", "reason": ...}: a failed measurement is a row."""
    if progress is not None:
        progress(f"measuring: {label}")
    try:
        return {"status": "ok", "result": measure()}
    except Exception as error:  # noqa: BLE001 - whatever went wrong is reported in its table row
        traceback.print_exc()
        return {"status": "failed", "reason": _why(error)}


def _cell_missing(cells: Dict[str, Dict[str, Any]], *names: str) -> Optional[str]:
    """Why a measurement over ``names`` cannot run (a cell that did not finish), else None."""
    for name in names:
        row = cells.get(name, {})
        if row.get("status") != "ok":
            return f"run {name} {row.get('status', 'missing')}: {row.get('reason', '')}".strip(" :")
    return None


def measure(config: ReportConfig, output: Path, cells: Dict[str, Dict[str, Any]],
            progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Every measurement of the report on the trained cells; each {"status", "result" or "reason"}."""
    from .seq2seq_eval import compare_at_nat, compare_decoders, copy_breakdown, cross_attention_map

    plan = MEASURE[config.preset]
    cell = {name: output / "cells" / name for name in cells}

    def guarded(label: str, names: Sequence[str], run: Callable[[], Any]) -> Dict[str, Any]:
        missing = _cell_missing(cells, *names)
        return {"status": "missing", "reason": missing} if missing else _measured(label, run, progress)

    sections: Dict[str, Any] = {"at_vs_nat": {}, "decoders": {}, "copy": {}, "attention": {}}
    for task, at, nat in NAT_PAIRS:
        sections["at_vs_nat"][task] = guarded(
            f"AT vs NAT on {task}", (at, nat),
            lambda at=at, nat=nat: compare_at_nat(cell[at], cell[nat], "test", plan["batch_sizes"],
                                                  plan["timed_sentences"], plan["nat_repeats"]))
    for _, name in GUIDE_ROWS:
        sections["decoders"][name] = guarded(f"decoders on {name}", (name,),
                                             lambda name=name: compare_decoders(cell[name], "test",
                                                                                plan["decoder_repeats"]))
        sections["attention"][name] = guarded(f"attention map of {name}", (name,),
                                              lambda name=name: cross_attention_map(cell[name], "test"))
    for _, name in COPY_ROWS:
        sections["copy"][name] = guarded(f"names and numbers of {name}", (name,),
                                         lambda name=name: copy_breakdown(cell[name], "test"))
    sections["guide_curves"] = {name: validation_curve(output / "cells" / name, "guide_loss")
                                for name in ("g2p-at", "g2p-token", "g2p-two-pass", "g2p-guided")}
    return sections


def machine() -> Dict[str, Any]:
    """The machine the report was measured on."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def run_report(config: ReportConfig, output: Path, argv: Sequence[str],
               progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Train (or continue) every cell, measure the runs and write the report, its JSON and figures into
    ``output``; returns the report's data."""
    keep_settings(output / SETTINGS_JSON, config.settings(), "a seq2seq report")

    def report(name: Any, row: Dict[str, Any], kept: bool) -> None:
        if progress is not None:
            progress(f"{name}: kept ({row['status']})" if kept else
                     f"{name}: {row['status']}" + (f" ({row['seconds']} s)" if "seconds" in row else ""))

    trainings = [(name, config.train_config(name), output / "cells" / name) for name in CELLS]
    timeout = config.cell_timeout_s or CELL_TIMEOUT_S[config.preset]
    cells = train_cells(trainings, timeout, config.threads, config.jobs, config.imports, report)
    threads = config.threads or 1
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # the measurements' timings, on as many threads as each training had
    try:
        sections = measure(config, output, cells, progress)
    finally:
        torch.set_num_threads(previous_threads)
    data = {"command": list(argv), "budget": config.preset, "machine": machine(), "threads": threads,
            "jobs": config.jobs, "guide_threshold": GUIDE_THRESHOLD, "measure": MEASURE[config.preset],
            "settings": {task: config.train_config(name).as_dict()
                         for task, name in (("reverse", "reverse-at"), ("g2p", "g2p-at"),
                                            ("copy-names", "copy-names-plain")) if name in CELLS},
            "cells": cells, "sections": sections}
    write_report(data, output)
    return data


# -- the report -------------------------------------------------------------------------------------------
def _number(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _unavailable(label: str, reason: str, width: int) -> List[str]:
    """A table row for something that could not be measured: the label, why, and dashes."""
    return [label, f"not available ({reason})", *["-"] * (width - 2)]


def _cell_test(data: Dict[str, Any], name: str) -> Optional[Dict[str, float]]:
    row = data["cells"].get(name, {})
    return row.get("test") if row.get("status") == "ok" else None




def nat_table(section: Dict[str, Any]) -> List[str]:
    """AT vs NAT: one row per decoder, times at each batch size, the speed-up over AT greedy."""
    if section["status"] != "ok":
        return _table(["decoder", "result"], [["AT greedy, NAT", f"not available ({section['reason']})"]])
    result = section["result"]
    sizes = sorted({row["batch_size"] for row in result["rows"]})
    by_decoder: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for row in result["rows"]:
        by_decoder.setdefault(row["decoder"], {})[row["batch_size"]] = row
    header = ["decoder", "exact match", "token error rate",
              *[f"ms / sentence, batch {size}" for size in sizes],
              "speed-up over AT greedy, batch " + " / ".join(map(str, sizes))]
    rows = []
    for decoder, per_size in by_decoder.items():
        first = per_size[sizes[0]]
        speedups = " / ".join(f"{per_size[size]['speedup']:.1f}x" for size in sizes)
        rows.append([decoder, f"{first['exact_match']:.3f}", f"{first['token_error_rate']:.4f}",
                     *[f"{per_size[size]['ms_per_sentence']:.2f}" for size in sizes],
                     "1" if decoder == "AT greedy" else speedups])
    return _table(header, rows)


def _run_rows(data: Dict[str, Any], runs: Sequence[Tuple[str, str]], width: int,
              fill: Callable[[str, str, Dict[str, float]], List[str]]) -> List[List[str]]:
    """One row per (label, run): ``fill(label, run, its test metrics)``, or why the run has none."""
    return [fill(label, name, test) if test is not None else
            _unavailable(label, _cell_missing(data["cells"], name) or "no test metrics", width)
            for label, name in runs for test in [_cell_test(data, name)]]


def sampling_table(data: Dict[str, Any]) -> List[str]:
    header = ["training", "exact match (word accuracy)", "token error rate (PER)", "BLEU"]
    return _table(header, _run_rows(data, SAMPLING_ROWS, len(header), lambda label, _, test: [
        label, f"{test['exact_match']:.3f}", f"{test['token_error_rate']:.4f}", f"{test['bleu']:.1f}"]))


def copy_table(data: Dict[str, Any]) -> List[str]:
    header = ["copy mechanism", "exact match", "rare tokens reproduced (rare_token_recall)", "names", "numbers",
              "parameters"]

    def fill(label: str, name: str, test: Dict[str, float]) -> List[str]:
        breakdown = data["sections"]["copy"].get(name, {"status": "missing", "reason": "not measured"})
        names, numbers = ((f"not available ({breakdown['reason']})", "-") if breakdown["status"] != "ok" else
                          (f"{breakdown['result']['names']:.3f}", f"{breakdown['result']['numbers']:.3f}"))
        return [label, f"{test['exact_match']:.3f}", f"{test['rare_token_recall']:.3f}", names, numbers,
                f"{data['cells'][name]['parameters']:,}"]

    return _table(header, _run_rows(data, COPY_ROWS, len(header), fill))


def guide_table(data: Dict[str, Any]) -> List[str]:
    threshold = data["guide_threshold"]
    header = ["training", "word accuracy", "PER", "BLEU", "final guide loss (test)",
              f"first validation step with guide loss < {threshold:g}"]

    def fill(label: str, name: str, test: Dict[str, float]) -> List[str]:
        curve = data["sections"]["guide_curves"].get(name, [])
        step = first_step_under(curve, threshold)
        if step is not None:
            reached = str(step)
        elif curve:
            lowest = min(curve, key=lambda point: point[1])
            reached = f"never (lowest {lowest[1]:.3f} at step {lowest[0]})"
        else:
            reached = "never (no validation rows)"
        return [label, f"{test['exact_match']:.3f}", f"{test['token_error_rate']:.4f}", f"{test['bleu']:.1f}",
                f"{test['guide_loss']:.3f}", reached]

    return _table(header, _run_rows(data, GUIDE_ROWS, len(header), fill))


def decoders_table(section: Dict[str, Any]) -> List[str]:
    header = ["decoder", "word accuracy", "PER", "BLEU", "ms / sentence"]
    if section["status"] != "ok":
        return _table(header, [_unavailable("every decoder", section["reason"], len(header))])
    return _table(header, [[row["decoder"], f"{row['exact_match']:.3f}", f"{row['token_error_rate']:.4f}",
                            f"{row['bleu']:.1f}", f"{row['ms_per_sentence']:.2f}"]
                           for row in section["result"]["rows"]])


def _settings_line(settings: Dict[str, Any]) -> str:
    options = ",".join(f"{k}={v}" for k, v in settings["task_options"].items()) or "defaults"
    return (f"dim {settings['dim']}, {settings['depth']} + {settings['depth']} layers, {settings['heads']} heads, "
            f"{settings['steps']} steps of {settings['batch_size']}, lr {settings['lr']:g}, seed {settings['seed']}, "
            f"task options {options}")


def render_markdown(data: Dict[str, Any]) -> str:
    """The report: how it was made, then one section per comparison (test split throughout)."""
    sections = data["sections"]
    host = data["machine"]
    load = host.get("load_average")
    text = [f"# attnzoo seq2seq-report, preset {data['budget']}", "",
            f"Command: `{' '.join(data['command'])}`", "",
            f"Machine: {host['processor']}, {host['cpus']} CPUs, {host['platform']}, Python {host['python']}, "
            f"torch {host['torch']}; {data['jobs']} training run(s) at once, {data['threads']} thread(s) each"
            + (f"; load average {load[0]:.1f} when the report was written" if load else "") + ".", "",
            "Budgets (every run of a task alike but for the setting compared):", ""]
    text += [f"- {task}: {_settings_line(settings)}" for task, settings in data["settings"].items()]
    text += ["", "Training runs:", ""]
    run_rows = []
    for name, row in data["cells"].items():
        if row.get("status") == "ok":
            run_rows.append([name, "ok", f"{row['parameters']:,}", f"{row['train_seconds']:.0f}"])
        else:
            run_rows.append([name, f"{row.get('status')}: {row.get('reason', '')}", "-", "-"])
    text += _table(["run", "status", "parameters", "training seconds"], run_rows)
    measure_plan = data["measure"]
    text += ["## AT vs NAT", "",
             f"Same model size and budget; quality over the test split, time over its first "
             f"{measure_plan['timed_sentences']} sentences at each batch size (median of {measure_plan['nat_repeats']} "
             "rounds, the decoders alternating).", ""]
    for task, _, _ in NAT_PAIRS:
        text += [f"`{task}`:", "", *nat_table(sections["at_vs_nat"][task])]
    text += ["## Teacher forcing vs scheduled sampling (g2p)", "", *sampling_table(data)]
    text += ["## Copy mechanism (copy-names)", "", *copy_table(data)]
    text += ["## Guide loss (g2p)", "",
             f"![validation guide loss over steps]({GUIDE_CURVES_PNG})", "",
             f"![cross-attention of one test word]({ATTENTION_PNG})", "", *guide_table(data)]
    text += ["## Greedy vs beam, monotonic inference (g2p)", ""]
    for label, name in GUIDE_ROWS:
        text += [f"Model trained {label}:", "", *decoders_table(sections["decoders"][name])]
    return "\n".join(text)


def write_report(data: Dict[str, Any], output: Path) -> Dict[str, Path]:
    """seq2seq-report.json, seq2seq-report.md and the two figures, into ``output``."""
    from .seq2seq_figures import plot_attention_maps, plot_guide_curves

    paths = {"json": output / REPORT_JSON, "markdown": output / REPORT_MD,
             "guide_curves": output / GUIDE_CURVES_PNG, "attention": output / ATTENTION_PNG}
    paths["json"].write_text(json.dumps(data, indent=2))
    paths["markdown"].write_text(render_markdown(data))
    labels = {"g2p-at": "teacher forcing", "g2p-token": "scheduled sampling, token",
              "g2p-two-pass": "scheduled sampling, two-pass", "g2p-guided": "guide loss 1.0"}
    plot_guide_curves({labels[name]: curve for name, curve in data["sections"]["guide_curves"].items()},
                      data["guide_threshold"], paths["guide_curves"], "g2p: how fast the cross-attention becomes diagonal")
    maps = [(f"{label}\n(test word {entry['result']['index']}, teacher-forced)", entry["result"])
            for label, name in GUIDE_ROWS
            for entry in [data["sections"]["attention"][name]] if entry["status"] == "ok"]
    plot_attention_maps(maps, paths["attention"])
    return paths
