"""attnzoo lra's second picture: speed and memory at --long-length, measured by the kernel benchmark in the same
run; bad long lengths refused in one line before any work; the measurement saved and reused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from attnzoo.cli import EXIT_USAGE, main
from attnzoo.experiments import lra, lra_speed
from attnzoo.experiments.lra_speed import DEFAULT_LONG_LENGTH, LONG_DIR
from attnzoo.mechanisms import mechanism_class

RECALL = {"train_size": 32, "validation_size": 8, "test_size": 8, "num_pairs": 4, "num_keys": 8, "num_values": 4}


@pytest.fixture
def no_work(monkeypatch):
    """Any training or measuring fails the test: a usage error must come before both."""
    def started(*args, **kwargs):
        raise AssertionError("work started despite a usage error")

    monkeypatch.setattr(lra, "run_lra", started)
    monkeypatch.setattr(lra_speed, "run_compare", started)


def _error_line(argv, capsys, tmp_path) -> str:
    try:
        code = main(["lra", *argv, "--output", str(tmp_path / "out")])
    except SystemExit as stop:
        code = stop.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USAGE and len(lines) == 1, lines
    assert not (tmp_path / "out").exists()
    return lines[0]


@pytest.mark.parametrize("value", ["0", "-4096", "nan", "inf", "1.5", "many"])
def test_a_long_length_that_is_no_count_of_tokens_is_one_line(value, capsys, tmp_path, no_work):
    line = _error_line(["--long-length", value], capsys, tmp_path)
    assert line.startswith("attnzoo lra: error: --long-length must be a whole number of tokens >= 1, got")


def test_a_long_length_above_a_mechanisms_max_length_is_one_line_naming_it(capsys, tmp_path, no_work):
    line = _error_line(["--mechanisms", "softmax,bigbird", "--set", "bigbird.max_seq_len=1024"], capsys, tmp_path)
    assert line.startswith(f"attnzoo lra: error: --long-length {DEFAULT_LONG_LENGTH}: bigbird") and "1024" in line
    line = _error_line(["--mechanisms", "linformer", "--long-length", "70000", "--set", "linformer.max_seq_len=512"],
                       capsys, tmp_path)
    assert line.startswith("attnzoo lra: error: --long-length 70000: linformer") and "max_seq_len=512" in line


def test_a_long_length_off_a_mechanisms_length_multiple_is_one_line(capsys, tmp_path, no_work, monkeypatch):
    softmax = mechanism_class("softmax")
    monkeypatch.setattr(softmax, "capabilities", dataclasses.replace(softmax.capabilities, length_multiple=1000))
    line = _error_line(["--mechanisms", "softmax", "--long-length", "4096"], capsys, tmp_path)
    assert line.startswith("attnzoo lra: error: --long-length 4096: softmax") and "length_multiple=1000" in line


def test_the_long_length_is_measured_at_the_widest_models_heads():
    config = lra.LraConfig(preset="full")
    assert config.attention_shape() == (128, 4)
    assert lra.LraConfig(preset="full", tasks=["pathfinder"]).attention_shape() == (64, 4)
    assert lra.LraConfig().long_length == DEFAULT_LONG_LENGTH == 4096


@pytest.fixture
def tiny_recall(monkeypatch):
    """The quick preset shrunk to one small recall budget, for speed."""
    budget = dict(lra.BUDGETS["quick"]["recall"], task_options=RECALL, dim=16, depth=1, heads=2, batch_size=8)
    monkeypatch.setitem(lra.BUDGETS, "quick", {"recall": budget})


def test_lra_draws_accuracy_against_speed_and_memory_at_the_long_length(capsys, tmp_path, tiny_recall,
                                                                       monkeypatch):
    argv = ["lra", "--tasks", "recall", "--mechanisms", "linear", "--steps", "2", "--threads", "1",
            "--long-length", "128", "--output", str(tmp_path), "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    data = json.loads((tmp_path / "lra.json").read_text())
    long = data["long_length"]
    assert (long["length"], long["batch"], long["heads"], long["head_dim"], long["dim"]) == (128, 1, 2, 8, 16)
    assert [row["mechanism"] for row in long["rows"]] == ["linear", "softmax"]  # softmax: what ratios refer to
    for row in long["rows"]:
        assert row["status"] == "ok", row
        assert row["tokens_per_second"] == pytest.approx(128 / (row["forward_backward_ms"] / 1e3))
        # Measured (a number), but at N=128 the warmed-up pass may touch no new page: 0 MiB is a true reading.
        assert isinstance(row["peak_memory_mib"], float) and row["peak_memory_mib"] >= 0
    assert long["rows"][1]["speed_vs_softmax"] == 1.0
    assert data["training_lengths"] == {"recall": 12}
    measured = json.loads((tmp_path / LONG_DIR / "results.json").read_text())  # the kernel benchmark's own file
    assert measured["config"]["lengths"] == [128] and measured["config"]["repeats"] == 1
    assert "--long-length 128" in measured["command"] and (tmp_path / LONG_DIR / "results.csv").exists()
    assert (tmp_path / "lra.png").stat().st_size > 0 and (tmp_path / "lra-long.png").stat().st_size > 0
    table = (tmp_path / "lra.md").read_text()
    assert "## Speed and memory at N=128" in table and "| linear |" in table
    assert "trained and tested at the tasks' own lengths (recall 12 tokens)" in table.lower()
    assert not (tmp_path / "lra-curves.png").exists() and "## Learning curves" not in table  # one validation

    # Continued with the same settings, the measurement is read back (measuring again would fail here); with
    # any other long-length setting it is measured anew.
    def measured_again(*args, **kwargs):
        raise AssertionError("measured again")

    config = lra_speed.long_length_config(128, ["linear"], {}, 2, 8, 1, [])
    monkeypatch.setattr(lra_speed, "run_compare", measured_again)
    assert lra_speed.measure_long_length(config, tmp_path, argv) == measured
    for other in (lra_speed.long_length_config(64, ["linear"], {}, 2, 8, 1, []),
                  lra_speed.long_length_config(128, ["linear", "local"], {}, 2, 8, 1, []),
                  lra_speed.long_length_config(128, ["linear"], {"linear": {"chunk_size": 32}}, 2, 8, 1, []),
                  lra_speed.long_length_config(128, ["linear"], {}, 4, 4, 1, [])):
        with pytest.raises(AssertionError, match="measured again"):
            lra_speed.measure_long_length(other, tmp_path, argv)


def test_a_preset_validating_more_than_once_draws_its_learning_curves_beside_the_published_figure(
        capsys, tmp_path, tiny_recall, monkeypatch):
    monkeypatch.setitem(lra.EVALUATIONS, "quick", 2)
    monkeypatch.setitem(lra.PUBLISHED, "quick", {"recall": (0.5, "a paper, Table 9")})
    argv = ["lra", "--tasks", "recall", "--mechanisms", "linear,softmax", "--steps", "4", "--threads", "1",
            "--long-length", "64", "--output", str(tmp_path), "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    data = json.loads((tmp_path / "lra.json").read_text())
    for mechanism in ("linear", "softmax"):
        curve = data["curves"]["recall"][mechanism]
        assert [step for step, _ in curve] == [2, 4]
        assert all(0.0 <= accuracy <= 1.0 for _, accuracy in curve)
        assert curve[-1][1] == data["cells"]["recall"][mechanism]["validation"]["accuracy"]
    assert data["published"] == {"recall": {"accuracy": 0.5, "source": "a paper, Table 9"}}
    assert (tmp_path / "lra-curves.png").stat().st_size > 0
    table = (tmp_path / "lra.md").read_text()
    linear = data["curves"]["recall"]["linear"]
    assert "## Learning curves" in table and "| mechanism | step 2 | step 4 |" in table
    assert f"| linear | {100 * linear[0][1]:.1f} | {100 * linear[1][1]:.1f} |" in table
    assert "| published (a paper, Table 9) | test accuracy 50.0 | |" in table


def test_the_curves_table_says_which_cells_did_not_finish_and_which_task_has_no_validation_yet():
    data = {"metrics": {"listops": "accuracy", "bytes": "bits_per_byte"},
            "settings": {"listops": {"eval_batches": 8}, "bytes": {"eval_batches": None}},
            "cells": {"listops": {"softmax": {"status": "ok"}, "linear": {"status": "too slow"}},
                      "bytes": {"softmax": {"status": "unsupported"}}},
            "curves": {"listops": {"softmax": [[50, 0.2], [100, 0.25]], "linear": [[50, 0.1]]},
                       "bytes": {"softmax": []}},
            "published": {"listops": {"accuracy": 0.371, "source": "a paper"}}}
    lines = lra.render_curves(data)
    assert "### listops (validation accuracy %, the first 8 validation batches)" in lines
    assert "| softmax | 20.0 | 25.0 |" in lines and "| linear (out of time) | 10.0 | - |" in lines
    assert "| published (a paper) | test accuracy 37.1 | |" in lines
    at = lines.index("### bytes (validation bpb, lower is better, the whole validation split)")
    assert lines[at + 2] == "No cell has validated yet."


def test_a_learning_curve_counts_a_step_validated_again_after_a_resume_once(tmp_path):
    (tmp_path / "metrics.csv").write_text(
        "step,split,loss,accuracy\n5,train,2.0,0.1\n5,validation,2.1,0.2\n10,validation,2.0,0.25\n"
        "10,validation,1.9,0.3\n15,validation,1.8,\n")
    assert lra.learning_curve(tmp_path, "accuracy") == [[5, 0.2], [10, 0.3]]
    assert lra.learning_curve(tmp_path / "missing", "accuracy") == []


def test_the_long_length_table_says_why_a_row_is_missing():
    data = {"long_length": {"length": 4096, "batch": 1, "heads": 4, "head_dim": 16, "dim": 64, "threads": 1,
                            "repeats": 3, "files": "long-length/results.json", "rows": [
                                {"mechanism": "softmax", "status": "ok", "reason": None, "forward_backward_ms": 500.0,
                                 "tokens_per_second": 8192.0, "peak_memory_mib": 800.0, "speed_vs_softmax": 1.0,
                                 "memory_vs_softmax": 1.0},
                                {"mechanism": "vq", "status": "timeout", "reason": "too slow: one forward+backward",
                                 "forward_backward_ms": None, "tokens_per_second": None, "peak_memory_mib": None,
                                 "speed_vs_softmax": None, "memory_vs_softmax": None}]}}
    lines = lra.render_long_length(data)
    assert lines[0] == "## Speed and memory at N=4096"
    assert "| softmax | 500.0 | 8,192 | 800.0 | 1.00 | 1.00 | ok |" in lines
    assert "| vq | - | - | - | - | - | timeout: too slow: one forward+backward |" in lines


# -- the long preset and cells with a time limit ---------------------------------------------------------------
def test_the_long_preset_is_the_arenas_lengths_at_the_nystromformer_small_model():
    config = lra.LraConfig(preset="long")
    config.validate()
    assert config.task_names == ["listops", "pathfinder"]
    for task in config.task_names:
        cell = config.train_config(task, "softmax")
        assert (cell.depth, cell.dim, cell.heads, cell.ff_dim) == (2, 64, 2, 128)
        assert cell.eval_interval * 10 == cell.steps
    assert config.train_config("listops", "softmax").task_options == {"min_length": 500, "max_length": 2000}
    assert config.train_config("pathfinder", "softmax").task_options == {}  # 32 x 32, 1,024 pixels
    assert config.attention_shape() == (64, 2)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "long", "--tasks", "bytes"], "--tasks: the long preset has no budget for bytes; its tasks: listops"),
    (["--tasks", "nosuch"], "--tasks: unknown 'nosuch'"),
    (["--cell-time-limit", "0"], "--cell-timeout (--cell-time-limit) must be a positive number of seconds, got 0.0"),
    (["--cell-time-limit", "nan"], "--cell-timeout (--cell-time-limit) must be a positive number of seconds, got nan"),
])
def test_bad_presets_tasks_and_time_limits_are_one_line(argv, message, capsys, tmp_path, no_work):
    assert message in _error_line(argv, capsys, tmp_path)


def test_a_cell_out_of_time_is_a_row_with_its_last_validation(tmp_path):
    from attnzoo.experiments.cells import last_validation, run_cell
    from attnzoo.training import TrainConfig

    cell = tmp_path / "cell"
    cell.mkdir()
    assert last_validation(cell) is None
    (cell / "metrics.csv").write_text("step,split,loss,accuracy,lr\n10,train,0.9,0.4,0.001\n10,validation,0.8,0.5,\n"
                                      "20,train,0.7,0.6,0.001\n20,validation,0.6,0.7,\n30,train,0.5,0.8,0.001\n")
    assert last_validation(cell) == {"step": 20, "loss": 0.6, "accuracy": 0.7}
    config = TrainConfig(task="recall", mechanism="softmax", task_options=RECALL, steps=100000)
    row = run_cell(config, cell, timeout_s=0.2, threads=1)
    assert row["status"] == "too slow" and row["last_validation"] == {"step": 20, "loss": 0.6, "accuracy": 0.7}
    assert "not finished in 0 s" in row["reason"] and "validated last at step 20" in row["reason"]
    assert lra._cell_text(row, "accuracy") == "out of time (70.0 validation at step 20)"
    assert lra._cell_text(dict(row, last_validation=None), "accuracy") == "out of time"
