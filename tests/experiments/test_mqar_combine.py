"""scripts/mqar_combine.py: one MQAR table from several runs, the learning rate chosen on validation over all of
their cells, checked on runs written here in miniature and on the shipped medium-preset results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mqar_combine", ROOT / "scripts" / "mqar_combine.py")
combine_script = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = combine_script
_spec.loader.exec_module(combine_script)


def _cell(schedule, width, lr, validation, test, status="ok"):
    return {"schedule": schedule, "width": width, "lr": lr, "status": status,
            "validation": {"accuracy": validation}, "test": {"accuracy": test}}


def _run(cells, preset="medium", options=None):
    return {"command": ["attnzoo", "mqar", preset], "preset": preset, "task_options": options or {"num_pairs": 32},
            "cells": cells}


def test_the_best_learning_rate_is_chosen_on_validation_across_runs():
    first = _run([_cell("linear", 64, 1e-3, 0.2, 0.9), _cell("linear", 64, 1e-2, 0.5, 0.4)])
    second = _run([_cell("linear", 64, 3e-2, 0.4, 0.8), _cell("linear", 64, 3e-3, 0.9, 0.0, status="failed")])
    (row,) = combine_script.combine([first, second])
    assert row["best_lr"] == 1e-2 and row["test_accuracy"] == 0.4  # the best on validation, not on test
    assert row["test_accuracy_by_lr"] == {"0.001": 0.9, "0.01": 0.4, "0.03": 0.8}  # the failed cell left out


def test_runs_that_do_not_fit_together_are_refused():
    with pytest.raises(ValueError, match="another preset or task setting"):
        combine_script.combine([_run([]), _run([], options={"num_pairs": 64})])
    with pytest.raises(ValueError, match="two cells of linear width 64 at lr 0.001"):
        combine_script.combine([_run([_cell("linear", 64, 1e-3, 0.1, 0.1)])] * 2)


def test_the_shipped_medium_runs_combine_to_the_table_in_the_docs(tmp_path):
    runs = [ROOT / "docs" / "results" / "mqar" / name for name in ("medium", "medium-linear-based", "medium-lr1e-3")]
    output = tmp_path / "combined.json"
    assert combine_script.main([str(path) for path in runs] + ["--output", str(output)]) == 0
    rows = {(row["schedule"], row["width"]): row for row in json.loads(output.read_text())["rows"]}
    assert round(100 * rows["gated_delta", 128]["test_accuracy"], 1) == 43.4
    assert round(100 * rows["linear", 128]["test_accuracy"], 1) == 98.1
    assert len(rows["linear", 128]["test_accuracy_by_lr"]) == 3
