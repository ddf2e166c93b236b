"""The recipe for adding a training experiment holds: tests/experiments/toy_new_experiment.py, one file that uses only
attnzoo.experiments, trains its cells in fresh processes, writes its table, and keeps finished cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import toy_new_experiment as toy


def test_a_new_experiment_runs_its_cells_and_keeps_the_finished_ones(tmp_path):
    rows = toy.run(tmp_path, steps=2, jobs=2, threads=1)
    assert list(rows) == list(toy.ENCODINGS)
    assert all(row["status"] == "ok" for row in rows.values()), rows
    assert all(0.0 <= row["test"]["accuracy"] <= 1.0 for row in rows.values())
    commands = {name: rows[name]["command"] for name in rows}
    assert "--positional" in commands["rotary"] and "rotary" in commands["rotary"]
    table = (tmp_path / "positional.md").read_text()
    assert "| sinusoidal |" in table and "| rotary |" in table
    stamps = {name: (tmp_path / "cells" / name / "cell.json").stat().st_mtime_ns for name in rows}
    assert toy.run(tmp_path, steps=2, jobs=2, threads=1) == json.loads((tmp_path / "positional.json").read_text())
    assert stamps == {name: (tmp_path / "cells" / name / "cell.json").stat().st_mtime_ns for name in rows}  # kept
    with pytest.raises(ValueError, match="other settings"):
        toy.run(tmp_path, steps=3)  # a continuation must keep the settings it began with


def test_the_shared_checks_name_the_option():
    with pytest.raises(ValueError, match="--jobs"):
        toy.run(Path("unused"), jobs=0)
