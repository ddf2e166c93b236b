"""Tests of the ``attnzoo`` command line: ``list``, and ``compare``'s options, output modes and exit codes."""

from __future__ import annotations

import json

import pytest
import torch

from attnzoo import available, capabilities, mechanism_options
from attnzoo.cli import EXIT_FAILED_ROWS, EXIT_OK, EXIT_USAGE, main

TINY = ["--lengths", "16,32", "--batch", "1", "--heads", "2", "--head-dim", "8", "--repeats", "2",
        "--budget", "5", "--threads", "1", "--mechanisms", "softmax", "--no-sweep"]


def test_list_shows_every_registered_mechanism_with_its_capabilities(capsys):
    assert main(["list"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["mechanism", "causal", "cross", "padding", "step"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == set(available())
    for name, cells in rows.items():
        caps = capabilities(name)
        assert cells[1:5] == ["yes" if flag else "-" for flag in (caps.causal, caps.cross, caps.key_padding,
                                                                    caps.recurrent_step)]
        assert ("approximate" if caps.approximate else "exact") in cells


def test_list_options_names_every_option_with_its_default(capsys):
    assert main(["list", "--options"]) == EXIT_OK
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in out.split("options (")[1].splitlines()[1:]}
    assert set(lines) == set(available())
    for name in available():
        for option, default in mechanism_options(name).items():
            assert f"{option}={default!r}" in lines[name]
    assert "optimal_features=False" in lines["performer"]


def test_compare_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "exit codes:" in text
    for code in (EXIT_OK, EXIT_FAILED_ROWS, EXIT_USAGE):
        assert f"  {code}  " in text


@pytest.mark.parametrize("argv, message", [
    (["--mechanisms", "no_such_mechanism"], "valid choices"),
    (["--heads", "0"], "heads"),
    (["--accuracy", "/nonexistent/results.json"], "--accuracy"),
    (["--import", "/nonexistent/mechanisms.py"], "mechanisms.py"),
])
def test_bad_values_exit_2_with_a_message_naming_them(argv, message, capsys, tmp_path):
    assert main(["compare", *argv, "--output", str(tmp_path)]) == EXIT_USAGE
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_cuda_without_cuda_is_a_usage_error(capsys, tmp_path):
    assert main(["compare", "--device", "cuda", "--output", str(tmp_path)]) == EXIT_USAGE
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--lengths", "0,16"], ["--lengths", "a"], ["--preset", "huge"],
                                  ["--quiet", "--json"]])
def test_malformed_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *argv])
    assert exit_info.value.code == EXIT_USAGE


@pytest.mark.slow
def test_compare_prints_the_table_and_progress_and_exits_0(capsys, tmp_path):
    assert main(["compare", *TINY, "--output", str(tmp_path)]) == EXIT_OK
    captured = capsys.readouterr()
    assert "N = 16" in captured.out and "N = 32" in captured.out and "crossover" in captured.out
    assert "[1/" in captured.err  # plain progress lines when stderr is not a terminal
    data = json.loads((tmp_path / "results.json").read_text())
    assert [row["status"] for row in data["rows"]] == ["ok", "ok"]
    assert data["argv"] == ["attnzoo", "compare", *TINY, "--output", str(tmp_path)]


@pytest.mark.slow
def test_compare_quiet_prints_nothing_but_writes_the_files(capsys, tmp_path):
    assert main(["compare", *TINY, "--quiet", "--output", str(tmp_path)]) == EXIT_OK
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert (tmp_path / "report.md").exists() and (tmp_path / "bubble.png").exists()


@pytest.mark.slow
def test_compare_json_prints_exactly_the_results(capsys, tmp_path):
    accuracy = tmp_path / "accuracy.json"
    accuracy.write_text(json.dumps({"softmax": 0.61}))
    assert main(["compare", *TINY, "--causal", "--json", "--accuracy", str(accuracy),
                 "--output", str(tmp_path)]) == EXIT_OK
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data == json.loads((tmp_path / "results.json").read_text())
    assert data["accuracy"] == {"path": str(accuracy), "values": {"softmax": 0.61}}
    assert str(accuracy) in (tmp_path / "report.md").read_text()
    assert all(row["causal"] and row["status"] == "ok" for row in data["rows"])
    assert "[1/" not in captured.err  # no progress lines either
