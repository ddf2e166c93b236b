"""attnzoo mqar: bad settings refused in one line before any cell trains; the state sizes recomputed by hand; the
best learning rate chosen on validation; a small sweep run end to end, its finished cells kept by the next run
and an interrupted one resumed."""

from __future__ import annotations

import csv
import json

import pytest

from cli_runs import run_cli

from attnzoo.experiments import mqar
from attnzoo.experiments.mqar import MqarConfig, best_of, render_markdown, schedule_folder, state_bytes
from attnzoo.models import SequenceTagger


@pytest.fixture
def no_work(monkeypatch):
    """Any training fails the test: a usage error must come before it."""
    def started(*args, **kwargs):
        raise AssertionError("work started despite a usage error")

    monkeypatch.setattr(mqar, "run_mqar", started)


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "nope"], "--schedule"),
    (["--schedule", "fnet"], "--schedule 'fnet' cannot train on mqar: layers item 'fnet': mqar asks for a causal model"),
    (["--schedule", "softmax,linear,softmax"], "--schedule 'softmax,linear,softmax': layers has 3 items"),
    (["--schedule", "local(window=0)"],
     "--schedule 'local(window=0)': layers item 'local(window=0)': window must be"),
    (["--schedule", "softmax", "--schedule", "softmax()"], "--schedule 'softmax()' is 'softmax' again"),
    (["--widths", "3"], "--widths: each must be a whole multiple of the 2 heads, got 3"),
    (["--widths", "16,16"], "--widths: a value is given twice"),
    (["--lrs", "0"], "--lrs: each must be a positive number, got 0.0"),
    (["--lrs", "nan"], "--lrs: each must be a positive number, got nan"),
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--jobs", "0"], "--jobs must be an integer >= 1"),
    (["--preset", "huge"], "argument --preset: invalid choice"),
    (["--widths", "a"], "argument --widths: expected comma-separated integers"),
])
def test_bad_settings_are_one_line_before_any_work(argv, message, capsys, tmp_path, no_work):
    code, _, err = run_cli(capsys, "mqar", *argv, "--output", str(tmp_path / "out"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("attnzoo mqar: error: ") and message in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


# -- the state ----------------------------------------------------------------------------------------------
def _tagger(layers: str, dim: int = 16, heads: int = 2) -> SequenceTagger:
    return SequenceTagger(32, 32, dim=dim, heads=heads, depth=2, layers=layers, causal=True)


@pytest.mark.parametrize("preset", sorted(mqar.PRESETS))
def test_every_preset_checks_out_with_its_own_schedules(preset):
    """A preset's schedules, widths and rates pass the same checks as ones given on the command line."""
    options = mqar.PRESETS[preset]
    MqarConfig(preset=preset, schedules=list(options["schedules"]), widths=list(options["widths"]),
               lrs=list(options["lrs"])).validate()
    assert preset in mqar.CELL_TIMEOUT_S


def test_state_bytes_by_hand():
    """Float32 (4 bytes) per sequence of 2 layers, 2 heads of width 8 (model width 16)."""
    heads, head_dim, seq = 2, 8, 40
    kv_cache = 2 * heads * seq * head_dim * 4 + 8  # keys and values at every position, and a filled count
    assert state_bytes(_tagger("softmax"), seq) == 2 * kv_cache
    assert state_bytes(_tagger("softmax"), 2 * seq) == 2 * (2 * kv_cache - 8)  # grows with the sequence
    linear = heads * (head_dim * (head_dim + 1) + 1) * 4  # sums of k v^T and of k, and a log scale per head
    assert state_bytes(_tagger("linear"), seq) == state_bytes(_tagger("linear"), 10 * seq) == 2 * linear
    delta = heads * head_dim * head_dim * 4
    assert state_bytes(_tagger("gated_delta"), seq) == 2 * delta
    assert state_bytes(_tagger("gated_delta,softmax"), seq) == delta + kv_cache
    # A Mamba-2 block: the convolution's last 3 inputs of x, B and C (32 + 2 * 8 channels) and 2 heads of
    # 8 x 16 SSM state.
    assert state_bytes(_tagger("block:mamba2(state_dim=8)"), seq) == 2 * ((32 + 16) * 3 + 2 * 8 * 16) * 4
    assert state_bytes(_tagger("reformer(bucket_size=4),softmax"), seq) is None  # no recurrent step


def test_schedule_folders_are_readable_names():
    assert schedule_folder("gated_delta(conv_size=4),softmax") == "gated_delta+conv_size=4+softmax"
    assert schedule_folder("softmax") == "softmax"


# -- the table ----------------------------------------------------------------------------------------------
def _row(validation, test):
    return {"status": "ok", "validation": {"accuracy": validation}, "test": {"accuracy": test}, "seconds": 1.0}


def test_the_best_learning_rate_is_chosen_on_validation_not_test():
    rows = {1e-3: _row(0.5, 0.9), 1e-2: _row(0.8, 0.7), 3e-2: {"status": "failed", "reason": "boom"}}
    assert best_of(rows) == 1e-2
    assert best_of({1e-3: {"status": "too slow"}}) is None


def test_the_table_names_every_missing_cell():
    config = MqarConfig(schedules=["softmax"], widths=[16], lrs=[1e-3, 1e-2])
    rows = {("softmax", 16, 1e-3): _row(0.25, 0.5), ("softmax", 16, 1e-2): {"status": "too slow", "reason": "late"}}
    data = mqar.collect(config, rows, {("softmax", 16): {"state_bytes": None, "parameters": 10}}, 0.03, ["x"])
    assert data["table"][0]["best_lr"] == 1e-3 and data["table"][0]["test_accuracy"] == 0.5
    text = render_markdown(data)
    assert "| softmax | 16 | - | 10 | 0.001 | 50.0 | 50.0 | - |" in text
    assert "- softmax width 16 lr 0.01: too slow: late" in text


# -- a sweep, run and continued -------------------------------------------------------------------------------
def test_a_sweep_writes_its_table_keeps_finished_cells_and_resumes_an_interrupted_one(capsys, tmp_path):
    out = tmp_path / "sweep"
    common = ["mqar", "--schedule", "softmax", "--schedule", "linear,softmax", "--widths", "16", "--lrs", "1e-2,3e-2",
              "--jobs", "2", "--threads", "1", "--output", str(out)]
    argv = [*common, "--steps", "3"]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert err.count("[") == 4 and "[4/4]" in err and "linear,softmax width 16 lr 0.03" in err  # progress
    data = json.loads((out / "mqar.json").read_text())
    assert [(e["schedule"], e["width"]) for e in data["table"]] == [("softmax", 16), ("linear,softmax", 16)]
    for entry in data["table"]:
        cells = {c["lr"]: c for c in data["cells"] if c["schedule"] == entry["schedule"]}
        assert all(c["status"] == "ok" for c in cells.values()), cells
        assert entry["best_lr"] == best_of(cells)
        assert entry["test_accuracy"] == cells[entry["best_lr"]]["test"]["accuracy"]
        assert entry["state_bytes"] > 0 and entry["parameters"] > 0
    table = list(csv.DictReader((out / "mqar.csv").open()))
    assert [row["schedule"] for row in table] == ["softmax", "linear,softmax"]
    assert set(table[0]) >= {"state_bytes", "best_lr", "test_accuracy", "test_accuracy_lr_0.01",
                             "test_accuracy_lr_0.03"}
    assert "| softmax | 16 |" in (out / "mqar.md").read_text() and "| softmax | 16 |" in stdout
    assert (out / "mqar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    cell = out / "cells" / "linear+softmax" / "d16" / "lr0.03"
    kept = (out / "cells" / "softmax" / "d16" / "lr0.01" / "cell.json").stat().st_mtime_ns
    (cell / "cell.json").unlink()  # as if interrupted after its last checkpoint: the next run resumes it
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert err.count("(kept)") == 3 and "linear,softmax width 16 lr 0.03: test accuracy" in err
    assert json.loads((cell / "cell.json").read_text())["status"] == "ok"
    assert (out / "cells" / "softmax" / "d16" / "lr0.01" / "cell.json").stat().st_mtime_ns == kept
    again = json.loads((out / "mqar.json").read_text())
    without_time = lambda table: [{k: v for k, v in e.items() if k != "seconds"} for e in table]  # noqa: E731
    assert without_time(again["table"]) == without_time(data["table"])

    code, _, err = run_cli(capsys, *common, "--steps", "4")
    assert code == 2 and "other settings" in err and len(err.strip().splitlines()) == 1
