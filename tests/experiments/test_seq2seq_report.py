"""attnzoo seq2seq-report: its pieces (configs, the guide-loss threshold step, the tables) and, marked slow, the
command end to end on a tiny override budget."""

from __future__ import annotations

import json
import re

import pytest

from attnzoo.experiments import seq2seq_report as report
from attnzoo.experiments.seq2seq_eval import pick_example
from attnzoo.cli import main


def test_first_step_under_is_the_first_crossing_not_the_lowest_point():
    curve = [(100, 0.30), (200, 0.12), (300, 0.08), (400, 0.11), (500, 0.05)]
    assert report.first_step_under(curve, 0.1) == 300
    assert report.first_step_under(curve, 0.05) is None  # strictly under
    assert report.first_step_under(curve, 0.5) == 100
    assert report.first_step_under([], 0.1) is None


def test_validation_curve_reads_only_validation_rows_with_a_value(tmp_path):
    (tmp_path / "metrics.csv").write_text(
        "step,split,guide_loss\n10,train,\n20,validation,0.4\n30,validation,\n40,validation,0.2\n40,test,0.1\n")
    assert report.validation_curve(tmp_path, "guide_loss") == [(20, 0.4), (40, 0.2)]
    assert report.validation_curve(tmp_path / "missing", "guide_loss") == []


def test_pick_example_takes_the_first_long_enough_else_the_longest():
    assert pick_example([3, 9, 12], 8) == 1
    assert pick_example([3, 5, 4], 8) == 1


def test_cells_of_a_task_differ_only_in_the_setting_compared():
    config = report.ReportConfig()
    for task in ("reverse", "g2p", "copy-names"):
        names = [name for name, (cell_task, _) in report.CELLS.items() if cell_task == task]
        base = config.train_config(names[0])
        for name in names[1:]:
            differences = config.train_config(name).differences(base)
            assert set(differences) == set(report.CELLS[name][1]) | set(report.CELLS[names[0]][1]), name
            assert base.steps == config.train_config(name).steps and base.dim == config.train_config(name).dim


def test_overrides_reach_every_cell_and_task_options_merge():
    config = report.ReportConfig(overrides={"steps": 3, "task_options": {"test_size": 7}})
    for name in report.CELLS:
        train_config = config.train_config(name)
        assert train_config.steps == 3 and train_config.task_options["test_size"] == 7
    assert config.train_config("g2p-at").task_options["validation_size"] == 500  # the budget's, kept


@pytest.mark.parametrize("changes, option", [
    (dict(preset="huge"), "--preset"), (dict(jobs=0), "--jobs"), (dict(jobs=True), "--jobs"),
    (dict(threads=0), "--threads"), (dict(cell_timeout_s=float("nan")), "--cell-timeout"),
])
def test_bad_settings_are_refused_naming_the_option(changes, option):
    with pytest.raises(ValueError, match=re.escape(option)):
        report.ReportConfig(**changes).validate()


def test_a_bad_override_is_refused_before_anything_runs():
    with pytest.raises((TypeError, ValueError), match="steps"):
        report.ReportConfig(overrides={"steps": 0}).validate()


def _data(cells, sections):
    return {"command": ["attnzoo", "seq2seq-report"], "budget": "quick", "jobs": 2, "threads": 1,
            "machine": {"processor": "cpu", "cpus": 2, "platform": "linux", "python": "3", "torch": "2",
                        "load_average": [1.0, 1.0, 1.0]},
            "guide_threshold": 0.1, "measure": report.MEASURE["quick"], "settings": {}, "cells": cells,
            "sections": sections}


def _ok_cell(**test):
    return {"status": "ok", "parameters": 1000, "train_seconds": 5.0, "test": test}


def test_tables_show_measured_rows_and_say_why_a_row_is_missing():
    g2p = dict(exact_match=0.5, token_error_rate=0.14, bleu=70.0, guide_loss=0.05)
    cells = {"g2p-at": _ok_cell(**g2p), "g2p-guided": _ok_cell(**g2p),
             "g2p-token": {"status": "failed", "reason": "RuntimeError: boom"},
             "copy-names-copy": _ok_cell(exact_match=0.9, rare_token_recall=0.95)}
    sections = {"at_vs_nat": {"reverse": {"status": "missing", "reason": "run reverse-at missing"},
                              "g2p": {"status": "failed", "reason": "ValueError: odd"}},
                "decoders": {"g2p-at": {"status": "ok", "result": {"rows": [
                    {"decoder": "greedy", "exact_match": 0.5, "token_error_rate": 0.14, "bleu": 70.0,
                     "ms_per_sentence": 1.5}]}},
                    "g2p-guided": {"status": "failed", "reason": "KeyError: x"}},
                "copy": {"copy-names-copy": {"status": "ok", "result": {"names": 0.9, "numbers": 1.0}}},
                "attention": {},
                "guide_curves": {"g2p-at": [(100, 0.3), (200, 0.2)], "g2p-guided": [(100, 0.2), (200, 0.08)]}}
    text = report.render_markdown(_data(cells, sections))
    assert "| teacher forcing | 0.500 | 0.1400 | 70.0 |" in text
    assert "| scheduled sampling, token | not available (run g2p-token failed: RuntimeError: boom) |" in text
    assert "not available (run g2p-two-pass missing)" in text
    assert "| with the guide loss (weight 1.0) | 0.500 | 0.1400 | 70.0 | 0.050 | 200 |" in text
    assert "never (lowest 0.200 at step 200)" in text
    assert "not available (ValueError: odd)" in text and "not available (run reverse-at missing)" in text
    assert "| with --copy-mechanism | 0.900 | 0.950 | 0.900 | 1.000 | 1,000 |" in text
    assert "not available (KeyError: x)" in text
    assert "Command: `attnzoo seq2seq-report`" in text


def test_nat_table_has_times_per_batch_size_and_speed_ups():
    rows = [{"decoder": d, "batch_size": b, "exact_match": 1.0, "token_error_rate": 0.0, "ms_per_sentence": ms,
             "speedup": s} for d, b, ms, s in [("AT greedy", 1, 40.0, 1.0), ("AT greedy", 32, 2.0, 1.0),
                                               ("NAT (predicted length)", 1, 8.0, 5.0),
                                               ("NAT (predicted length)", 32, 1.0, 2.0)]]
    lines = report.nat_table({"status": "ok", "result": {"rows": rows}})
    assert lines[0].startswith("| decoder | exact match | token error rate | ms / sentence, batch 1 | "
                               "ms / sentence, batch 32 |")
    assert "| NAT (predicted length) | 1.000 | 0.0000 | 8.00 | 1.00 | 5.0x / 2.0x |" in lines


def _table_rows(text):
    return [line for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| decoder |") and not line.startswith("| run |")
            and not line.startswith("| training |") and not line.startswith("| copy mechanism |")]


@pytest.mark.slow
def test_the_command_end_to_end_on_a_tiny_budget(tmp_path, monkeypatch, capsys):
    # Four of the runs (one g2p model among them), two steps each: the other rows must say why they are empty.
    kept = ("reverse-at", "reverse-nat", "g2p-at", "copy-names-copy")
    monkeypatch.setattr(report, "CELLS", {name: report.CELLS[name] for name in kept})
    output = tmp_path / "report"
    argv = ["seq2seq-report", "--steps", "2", "--task-options", "validation_size=8,test_size=8", "--jobs", "2",
            "--threads", "1", "--output", str(output), "--quiet"]
    assert main(argv) == 0
    for name in (report.REPORT_MD, report.REPORT_JSON, report.GUIDE_CURVES_PNG, report.ATTENTION_PNG):
        assert (output / name).stat().st_size > 0, name
    text = (output / report.REPORT_MD).read_text()
    data = json.loads((output / report.REPORT_JSON).read_text())
    assert data["command"] == ["attnzoo", *argv]
    assert all(data["cells"][name]["status"] == "ok" for name in kept)
    rows = _table_rows(text)
    assert len(rows) >= 10
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert all(cells), row  # no empty cell
        if "-" in cells[1:]:
            assert "not available (" in row, row  # an empty row says why
    assert "| AT greedy |" in text and "| NAT (predicted length) |" in text  # reverse: both runs there
    assert "not available (run g2p-nat missing)" in text
    assert "| teacher forcing | " in text and "not available (run g2p-guided missing)" in text
    assert "| greedy |" in text and "| beam 4 |" in text
    # Rerunning keeps the finished runs and writes the same tables (times aside).
    assert main(argv) == 0
    again = json.loads((output / report.REPORT_JSON).read_text())
    assert again["cells"] == data["cells"]


def test_the_full_budget_makes_valid_configs_bigger_than_the_quick_one():
    report.ReportConfig(preset="full").validate()
    for name in report.CELLS:
        quick, full = report.ReportConfig().train_config(name), report.ReportConfig(preset="full").train_config(name)
        assert full.steps > quick.steps and full.dim >= quick.dim


def test_a_yes_no_field_reaches_the_train_command_as_a_flag(tmp_path):
    from attnzoo.experiments.cells import train_command as _train_command

    with_copy = _train_command(report.ReportConfig().train_config("copy-names-copy"), tmp_path, False, 1)
    without = _train_command(report.ReportConfig().train_config("copy-names-plain"), tmp_path, False, 1)
    assert "--copy-mechanism" in with_copy and "True" not in with_copy
    assert "--copy-mechanism" not in without


@pytest.mark.parametrize("argv, option", [(["--jobs", "0"], "--jobs"), (["--preset", "full", "--steps", "0"], "steps")])
def test_the_command_refuses_bad_options_naming_them_before_training(argv, option, tmp_path, capsys):
    assert main(["seq2seq-report", *argv, "--output", str(tmp_path / "out")]) == 2
    assert option in capsys.readouterr().err
    assert not (tmp_path / "out" / "cells").exists()


def test_the_measurements_decode_a_bfloat16_run_in_bfloat16(tmp_path, monkeypatch):
    # As `attnzoo eval` does: a run trained under bfloat16 autocast is measured under it, not in float32.
    from attnzoo.experiments import seq2seq_eval
    from attnzoo.training import TrainConfig, train

    config = TrainConfig("copy-names", task_options={"validation_size": 8, "test_size": 8}, dim=16, depth=1,
                         heads=2, batch_size=4, steps=1, eval_interval=1, eval_batches=1, precision="bfloat16")
    train(config, tmp_path / "run", progress=False)
    seen = []
    original = seq2seq_eval.autocast
    monkeypatch.setattr(seq2seq_eval, "autocast", lambda precision: seen.append(precision) or original(precision))
    breakdown = seq2seq_eval.copy_breakdown(tmp_path / "run")
    attention = seq2seq_eval.cross_attention_map(tmp_path / "run")
    assert set(breakdown) >= {"names", "numbers", "rare"} and attention["weights"]
    assert seen and set(seen) == {"bfloat16"}
