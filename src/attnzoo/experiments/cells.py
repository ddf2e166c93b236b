"""The cell runner of every training experiment: each cell is one ``attnzoo train`` run in a fresh process.

A cell is ``(key, TrainConfig, directory)``. :func:`train_cells` keeps a cell that finished before (its
``cell.json``), resumes one that was interrupted (its checkpoint), trains the rest ``jobs`` at a time, and
returns one row per cell::

    {"status": "ok", "command": [...], "seconds": 12.3, "test": {...}, "validation": {...}, "baseline": {...},
     "tokens_per_second": ..., "peak_memory_mib": ..., "parameters": ..., "train_seconds": ...}
    {"status": "failed" | "too slow", "reason": "...", "command": [...]}

A cell out of time also says how far it got: ``"last_validation": {"step": 600, "loss": ..., "accuracy": ...}``
from its ``metrics.csv`` (None before its first validation); the next run continues it from its checkpoint.

So a crash, a hang or an out-of-memory kill is that cell's row, and the command that reproduces it is
recorded. Modules given as ``imports`` (``--import``: mechanisms of your own) are imported by every cell.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple

from ..training import TrainConfig
from ..training.settings import flag_of

CELL_JSON = "cell.json"
# Rows kept on disk and not run again; failures and timeouts are tried again by the next run.
KEPT_STATUSES = ("ok", "unsupported")

Cell = Tuple[Hashable, TrainConfig, Path]
Row = Dict[str, Any]


def train_command(config: TrainConfig, cell: Path, resume: bool, threads: Optional[int],
                  imports: Sequence[str] = (), device: Optional[str] = None) -> List[str]:
    """The ``attnzoo train`` command line of one cell: every setting that differs from the defaults (and
    ``--device`` when one is given)."""
    command = [sys.executable, "-m", "attnzoo.cli", "train"]
    for spec in imports:
        command += ["--import", spec]
    if resume:
        command += ["--resume", str(cell)]
    else:
        defaults = TrainConfig(task=config.task)
        command += [config.task, "--mechanism", config.mechanism, "--output", str(cell)]
        for key, option in (("task_options", "--task-options"), ("mechanism_options", "--mechanism-options"),
                            ("block_options", "--block-options")):
            if getattr(config, key):
                command += [option, json.dumps(getattr(config, key))]
        for key, value in config.as_dict().items():
            if key.endswith("options") or key in ("task", "mechanism") or value == getattr(defaults, key):
                continue
            if isinstance(value, bool):  # a yes/no field is a flag (--copy-mechanism), given only when True
                command += [flag_of(key)] if value else []
                continue
            command += [flag_of(key), str(value)]
    if threads:
        command += ["--threads", str(threads)]
    if device is not None:
        command += ["--device", device]
    return command + ["--quiet"]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


def validations(cell: Path) -> List[Dict[str, Any]]:
    """Every validation row of a cell's ``metrics.csv`` in step order (step and the metrics it has): its
    learning curve; empty before the first validation."""
    path = cell / "metrics.csv"
    if not path.exists():
        return []
    with path.open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("split") == "validation"]
    return [{"step": int(row["step"]),
             **{key: float(value) for key, value in row.items() if key not in ("step", "split") and value}}
            for row in rows]


def last_validation(cell: Path) -> Optional[Dict[str, Any]]:
    """The last validation row of a cell's ``metrics.csv`` (step and the metrics it has), or None."""
    rows = validations(cell)
    return rows[-1] if rows else None


def run_cell(config: TrainConfig, cell: Path, timeout_s: float, threads: Optional[int],
             imports: Sequence[str] = (), device: Optional[str] = None) -> Row:
    """Train one cell in a fresh process (resuming its checkpoint if it has one) on ``device`` (None: the
    CPU, ``attnzoo train``'s default); its row."""
    resume = (cell / "checkpoints" / "LATEST").exists()
    command = train_command(config, cell, resume, threads, imports, device)
    cell.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        reached = last_validation(cell)
        progress = "" if reached is None else f"; validated last at step {reached['step']}"
        return {"status": "too slow", "reason": f"not finished in {timeout_s:.0f} s (its checkpoint is kept: "
                                                f"the same command continues it{progress})",
                "command": command, "last_validation": reached}
    seconds = time.perf_counter() - began
    if done.returncode != 0 or not (cell / "results.json").exists():
        return {"status": "failed", "reason": _last_line(done.stderr) or f"exit code {done.returncode}",
                "command": command, "seconds": round(seconds, 1)}
    result = json.loads((cell / "results.json").read_text())
    return {"status": "ok", "command": result.get("command") or command, "seconds": round(seconds, 1),
            "test": result["test"], "validation": result["validation"], "baseline": result["baseline"],
            "tokens_per_second": result["tokens_per_second"], "peak_memory_mib": result.get("peak_memory_mib"),
            "parameters": result["parameters"], "train_seconds": result["train_seconds"]}


def run_cells(trainings: Sequence[Cell], timeout_s: float, threads: Optional[int], jobs: int,
              imports: Sequence[str] = (), device: Optional[str] = None) -> Iterator[Tuple[Hashable, Path, Row]]:
    """Train ``(key, config, cell directory)`` runs ``jobs`` at a time, each by :func:`run_cell` in its own
    process; yields ``(key, cell directory, row)`` as each finishes. Every process gets ``threads`` torch
    threads (1 by default when several run together: small models gain more from a core each than from two
    threads sharing both). Every process trains on ``device`` (several may share one GPU)."""
    threads = threads or (1 if jobs > 1 else None)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_cell, config, cell, timeout_s, threads, imports, device): (key, cell)
                   for key, config, cell in trainings}
        for future in as_completed(futures):
            key, cell = futures[future]
            yield key, cell, future.result()


def save_row(cell: Path, row: Row) -> None:
    """Keep a finished or unsupported cell's row in ``cell/cell.json``, so that the next run does not redo it."""
    if row["status"] in KEPT_STATUSES:
        cell.mkdir(parents=True, exist_ok=True)
        (cell / CELL_JSON).write_text(json.dumps(row, indent=2))


def train_cells(trainings: Sequence[Cell], timeout_s: float, threads: Optional[int] = None, jobs: int = 1,
                imports: Sequence[str] = (),
                progress: Optional[Callable[[Hashable, Row, bool], None]] = None,
                device: Optional[str] = None) -> Dict[Hashable, Row]:
    """Every cell's row, in the order given: kept from ``cell.json`` if it finished before, else trained now
    (:func:`run_cells`) and saved (:func:`save_row`). ``progress(key, row, kept)`` is called for each."""
    rows: Dict[Hashable, Row] = {}
    pending = []
    for key, config, cell in trainings:
        saved = cell / CELL_JSON
        if saved.exists():
            rows[key] = json.loads(saved.read_text())
            if progress is not None:
                progress(key, rows[key], True)
        else:
            pending.append((key, config, cell))
    for key, cell, row in run_cells(pending, timeout_s, threads, jobs, imports, device):
        rows[key] = row
        save_row(cell, row)
        if progress is not None:
            progress(key, row, False)
    return {key: rows[key] for key, _, _ in trainings}
