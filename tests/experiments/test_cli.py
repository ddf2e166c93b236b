"""Tests of the ``attnzoo`` command line: ``list``, ``compare``'s options, output modes and exit codes, the flags
every command shares, and ``--import`` of a mechanism of your own in ``train``, ``eval`` and ``lra``."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnzoo import available, capabilities, mechanism_options
from attnzoo.cli import EXIT_FAILED_ROWS, EXIT_OK, EXIT_USAGE, main

TINY = ["--lengths", "16,32", "--batch", "1", "--heads", "2", "--head-dim", "8", "--repeats", "2",
        "--time-budget", "5", "--threads", "1", "--mechanisms", "softmax", "--no-sweep"]


def test_list_shows_every_registered_mechanism_with_its_capabilities(capsys):
    assert main(["list"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["mechanism", "causal", "cross", "padding", "step"]
    assert max(map(len, lines)) <= 120  # the complexity on the lines below each row: a row starts at column 0
    rows = {line.split()[0]: line.split() for line in lines[3:] if not line.startswith(" ")}
    assert set(rows) == set(available())
    for name, cells in rows.items():
        caps = capabilities(name)
        assert cells[1:5] == ["yes" if flag else "-" for flag in (caps.causal, caps.cross, caps.key_padding,
                                                                    caps.recurrent_step)]
        assert cells[5:8] == [caps.grouped_kv, caps.packing, "any" if caps.any_value_width else "head_dim"]
        assert caps.kind in cells
    assert "grouped kv" in lines[0] and "packing" in lines[0] and "v width" in lines[0]
    assert rows["aft"][7] == "head_dim" and rows["softmax"][7] == "any"


def test_list_wide_shows_each_complexity_whole(capsys):
    assert main(["list", "--wide"]) == EXIT_OK
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(capabilities(name).complexity in out for name in available())
    assert len(lines) == 2 + len(available()) and max(map(len, lines)) > 120


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


@pytest.fixture
def no_measuring(monkeypatch):
    """Makes measuring fail the test: a usage error must be found before anything runs."""
    import attnzoo.bench.compare as compare

    def run_compare(*args, **kwargs):
        raise AssertionError("measured despite a usage error")

    monkeypatch.setattr(compare, "run_compare", run_compare)


def one_error_line(err: str) -> str:
    """The single line a usage error prints (no traceback, no usage block)."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnzoo compare: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--mechanisms", "no_such_mechanism"], "--mechanisms names unknown mechanism(s) no_such_mechanism; valid"),
    (["--heads", "0"], "--heads must be an integer >= 1, got 0"),
    (["--head-dim", "0"], "--head-dim must be an integer >= 1, got 0"),
    (["--batch", "0"], "--batch must be an integer >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
    (["--threads", "-1"], "--threads must be an integer >= 0, got -1"),
    (["--time-budget", "nan"], "--time-budget must be finite, got nan"),
    (["--time-budget", "inf"], "--time-budget must be finite, got inf"),
    (["--time-budget", "0"], "--time-budget must be a number > 0, got 0.0"),
    (["--time-budget", "-1"], "--time-budget must be a number > 0, got -1.0"),
    (["--lengths", "0,16"], "--lengths must be an integer >= 1, got 0"),
    (["--lengths", ","], "--lengths must be a non-empty list"),
    (["--device", "cuda:x"], "--device must be 'cpu' or 'cuda[:N]', got 'cuda:x'"),
    (["--accuracy", "/nonexistent/results.json"], "--accuracy"),
    (["--import", "/nonexistent/mechanisms.py"], "--import /nonexistent/mechanisms.py: No such file or directory"),
    (["--set", "nystrom.landmarks=0"], "--set for nystrom: landmarks must be an integer >= 1, got 0"),
    (["--set", "nystrom.landmark=16"], "--set for nystrom: mechanism 'nystrom' got unknown option(s) landmark"),
    (["--set", "nosuch.rank=4"], "--set names unknown mechanism 'nosuch'"),
    (["--set", "linformer.sharing=diagonal"], "--set for linformer: sharing must be one of"),
    (["--set", "performer.shrinkage=yes"], "--set for performer: shrinkage must be True or False, got 'yes'"),
])
def test_bad_values_exit_2_with_one_line_naming_them_before_measuring(argv, message, capsys, tmp_path,
                                                                       no_measuring):
    out = tmp_path / "out"
    assert main(["compare", *argv, "--output", str(out)]) == EXIT_USAGE
    assert message in one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_an_output_whose_parent_is_a_file_is_a_usage_error(capsys, tmp_path, no_measuring):
    (tmp_path / "file").write_text("")
    assert main(["compare", *TINY, "--output", str(tmp_path / "file" / "results")]) == EXIT_USAGE
    line = one_error_line(capsys.readouterr().err)
    assert line.endswith(f"--output {tmp_path / 'file' / 'results'}: cannot create the directory (Not a directory)")


def test_an_output_naming_an_existing_file_is_a_usage_error(capsys, tmp_path, no_measuring):
    (tmp_path / "results").write_text("keep me")
    assert main(["compare", *TINY, "--output", str(tmp_path / "results")]) == EXIT_USAGE
    assert one_error_line(capsys.readouterr().err).endswith("exists and is not a directory")
    assert (tmp_path / "results").read_text() == "keep me"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes to read-only directories")
def test_an_output_in_a_read_only_directory_is_a_usage_error(capsys, tmp_path, no_measuring):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert main(["compare", *TINY, "--output", str(locked)]) == EXIT_USAGE
        assert "cannot write files in it" in one_error_line(capsys.readouterr().err)
    finally:
        locked.chmod(0o700)


def test_a_user_module_that_raises_is_one_line_not_a_traceback(capsys, tmp_path, no_measuring):
    module = tmp_path / "broken_mechanisms.py"
    module.write_text("raise RuntimeError('registration failed')\n")
    assert main(["compare", *TINY, "--import", str(module), "--output", str(tmp_path / "out")]) == EXIT_USAGE
    assert one_error_line(capsys.readouterr().err).endswith(
        f"--import {module}: RuntimeError: registration failed")


def test_results_that_cannot_be_written_after_the_run_still_print_and_exit_2(capsys, tmp_path, monkeypatch):
    import attnzoo.bench.compare as compare
    import attnzoo.bench.results as results
    from attnzoo.bench.compare import CompareResult

    def run_compare(config, argv, progress=None, progress_total=None):
        return CompareResult(synthetic_data())

    def write_results(data, output):
        raise OSError(errno.ENOSPC, "No space left on device", str(output / "results.json"))

    monkeypatch.setattr(compare, "run_compare", run_compare)
    monkeypatch.setattr(results, "write_results", write_results)
    assert main(["compare", *TINY, "--output", str(tmp_path)]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert "N = 16" in captured.out  # the measurements are not lost
    assert one_error_line(captured.err).endswith(
        f"--output {tmp_path}: cannot write {tmp_path / 'results.json'} (No space left on device)")


def synthetic_data() -> dict:
    """A results.json for one softmax row, as run_compare would return it."""
    from attnzoo.bench.results import CSV_COLUMNS, add_ratios, summarize

    row = {column: None for column in CSV_COLUMNS}
    row.update(mechanism="softmax", source="attnzoo", kind="exact", length=16, batch=1, heads=2, head_dim=8,
               dtype="float32", causal=False, device="cpu", status="ok", forward_ms=1.0, forward_backward_ms=3.0,
               peak_memory_mib=1.0, error=0.0)
    add_ratios([row])
    return {"config": {"batch": 1, "heads": 2, "head_dim": 8, "dtype": "float32", "causal": False, "device": "cpu"},
            "machine": {"threads": 1, "cpu": "test cpu", "cores": 2, "cores_busy_elsewhere": 0.0},
            "rows": [row], "summary": summarize([row]), "uniform_error": [], "sweeps": [], "missing_peers": []}


def test_threads_0_means_every_core(tmp_path, monkeypatch):
    import attnzoo.bench.compare as compare

    class Measured(Exception):
        """Stops the command where measuring would begin, with the configuration it was given."""

    def run_compare(config, argv, progress=None, progress_total=None):
        raise Measured(config.resolved_threads())

    monkeypatch.setattr(compare, "run_compare", run_compare)
    with pytest.raises(Measured) as measured:
        main(["compare", *TINY, "--threads", "0", "--quiet", "--output", str(tmp_path)])
    assert measured.value.args == (os.cpu_count() or 1,)


@pytest.mark.parametrize("argv", [["--lengths", "a"], ["--preset", "huge"], ["--quiet", "--json"],
                                  ["--batch", "1.5"], ["--time-budget", "soon"], ["--set", "landmarks=16"],
                                  ["--set", "nystrom.=16"]])
def test_malformed_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *argv])
    assert exit_info.value.code == EXIT_USAGE
    assert one_error_line(capsys.readouterr().err).endswith("(see attnzoo compare --help)")


@pytest.mark.slow
def test_compare_prints_the_table_and_progress_and_exits_0(capsys, tmp_path):
    assert main(["compare", *TINY, "--output", str(tmp_path)]) == EXIT_OK
    captured = capsys.readouterr()
    assert "N = 16" in captured.out and "N = 32" in captured.out and "crossover" in captured.out
    assert "[1/" in captured.err  # plain progress lines when stderr is not a terminal
    data = json.loads((tmp_path / "results.json").read_text())
    assert [row["status"] for row in data["rows"]] == ["ok", "ok"]
    assert data["argv"] == ["attnzoo", "compare", *TINY, "--output", str(tmp_path)]


def test_ctrl_c_keeps_every_finished_row_and_says_where_it_stopped(capsys, tmp_path, monkeypatch):
    """Interrupted as the second length is timed: the first length's rows are written (report, CSV, JSON,
    figures), the second's marked interrupted; exit 130. Each job is announced as it starts."""
    import attnzoo.bench.compare as compare

    run, calls = compare.Launcher.run, []

    def interrupted_at_the_second_length(self, job, timeout_s):
        calls.append(job["kind"])
        if job["kind"] == "time" and job["length"] == 32:
            raise KeyboardInterrupt
        return run(self, job, timeout_s)

    monkeypatch.setattr(compare.Launcher, "run", interrupted_at_the_second_length)
    argv = ["compare", *TINY, "--mechanisms", "softmax,linear", "--output", str(tmp_path)]
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert calls == ["time", "memory", "memory", "time"]
    assert "interrupted; the 2 rows measured are written" in captured.err
    assert "[1/6] time N=16: 2 side by side" in captured.err and "[4/6] time N=32" in captured.err
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["interrupted"] is True
    assert [(row["length"], row["status"]) for row in data["rows"]] == \
        [(16, "ok"), (16, "ok"), (32, "interrupted"), (32, "interrupted")]
    assert "**Interrupted**" in (tmp_path / "report.md").read_text()
    assert "INTERRUPTED" in captured.out and (tmp_path / "time.png").exists()


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


def test_set_reaches_the_mechanism_and_is_recorded(tmp_path):
    """--set builds the mechanism with the option (a rank of 4 makes linformer differ from softmax at length
    16) and results.json records it beside the command."""
    out = tmp_path / "out"
    assert main(["compare", *TINY[:-3], "--no-sweep", "--mechanisms", "linformer", "--set", "linformer.rank=4",
                 "--set", "linformer.sharing=kv", "--output", str(out), "--quiet"]) == EXIT_OK
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["options"] == {"linformer": {"rank": 4, "sharing": "kv"}}
    assert "--set linformer.rank=4" in data["command"]
    rows = [row for row in data["rows"] if row["mechanism"] == "linformer" and row["status"] == "ok"]
    assert rows and all(row["error"] > 1e-3 for row in rows)


def test_peers_follow_the_options_given_to_their_counterpart():
    from attnzoo.bench.peers import _NYSTROM, _option

    names = ("landmarks", "num_landmarks")
    assert _option({"landmarks": 256}, _NYSTROM, names, 64) == 256
    assert _option({}, _NYSTROM, names, 7) == mechanism_options("nystrom")["landmarks"]


# -- one syntax for every command --------------------------------------------------------------------------------
@pytest.mark.parametrize("command, instead", [
    (["compare", "--budget", "5"], "--time-budget SECONDS"), (["lra", "--budget", "quick"], "--preset quick|full"),
    (["seq2seq-report", "--budget", "full"], "--preset quick|full"), (["lra", "--budget"], "--preset quick|full"),
])
def test_a_retired_flag_is_one_line_naming_the_new_one(command, instead, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(command)
    assert exit_info.value.code == EXIT_USAGE
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"--budget is retired: use {instead}" in lines[0], lines


def test_train_set_must_name_the_runs_own_mechanism(capsys, tmp_path):
    assert main(["train", "recall", "--set", "nosuch.levels=4", "--output", str(tmp_path / "run")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--set nosuch.levels: this command's mechanism is 'softmax'" in err
    assert main(["lra", "--set", "nosuch.rank=4", "--output", str(tmp_path / "lra")]) == EXIT_USAGE
    assert "--set names unknown mechanism 'nosuch'" in capsys.readouterr().err
    assert not (tmp_path / "lra").exists()


# -- a mechanism of your own in every command --------------------------------------------------------------------
TOY = Path(__file__).parents[1] / "mechanisms" / "toy_new_mechanism.py"
RECALL = "train_size=32,validation_size=8,test_size=8,num_pairs=4,num_keys=8,num_values=4"
TINY_MODEL = {"dim": 16, "depth": 1, "heads": 2, "batch_size": 8}


def attnzoo(*argv: str, code: str = "") -> subprocess.CompletedProcess:
    """The command in its own interpreter (after ``code``), so that the toy never registers in this one."""
    script = f"import sys\n{code}\nfrom attnzoo.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300)


def test_lra_train_eval_and_resume_run_a_mechanism_of_your_own(tmp_path):
    """lra's cell (an attnzoo train process) imports the toy and records it; eval reads the record; a run whose
    record is gone is refused in one line naming --import."""
    shrink = (f"from attnzoo.experiments import lra\n"
              f"lra.BUDGETS['quick']['recall'].update(task_options=dict({RECALL}), **{TINY_MODEL!r})")
    done = attnzoo("lra", "--import", str(TOY), "--mechanisms", "toy-quantized", "--set", "toy-quantized.levels=4",
                   "--tasks", "recall", "--steps", "2", "--output", str(tmp_path), "--quiet", code=shrink)
    assert done.returncode == 0, done.stderr
    run = tmp_path / "cells" / "recall" / "toy-quantized"
    cell = json.loads((run / "cell.json").read_text())
    assert cell["status"] == "ok", cell
    assert "--import" in cell["command"] and '{"levels": 4}' in cell["command"]
    evaluated = attnzoo("eval", str(run), "--json")  # no --import: the run recorded it
    assert evaluated.returncode == 0, evaluated.stderr
    report = json.loads(evaluated.stdout)
    assert report["mechanism"] == "toy-quantized" and report["config"]["mechanism_options"] == {"levels": 4}
    (run / "imports.json").unlink()
    refused = attnzoo("train", "--resume", str(run))  # --resume and eval read the record alike
    assert refused.returncode == EXIT_USAGE and len(refused.stderr.splitlines()) == 1
    assert "mechanism 'toy-quantized' is not registered: give --import" in refused.stderr


def test_train_set_gives_the_option_to_the_mechanism(capsys, tmp_path):
    argv = ["train", "recall", "--task-options", RECALL, "--output", str(tmp_path / "run")]
    assert main([*argv, "--set", "no_such_option=4"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("attnzoo train: error: --set") and "no_such_option" in err
    assert not (tmp_path / "run").exists()


# -- every command's values checked before any work, by the shared helpers ------------------------------------------
COMMANDS = {
    "train": ["train", "recall", "--steps", "2"],
    "lra": ["lra", "--mechanisms", "softmax", "--tasks", "recall", "--steps", "2"],
    "seq2seq-report": ["seq2seq-report", "--steps", "2"],
    "mqar": ["mqar", "--widths", "16", "--steps", "2"],
    "compare": ["compare", "--mechanisms", "softmax", "--lengths", "16"],
}


@pytest.fixture
def no_work(monkeypatch):
    """Makes any command's work fail the test: a usage error must be found before anything runs."""
    import attnzoo.bench.compare as compare
    import attnzoo.experiments.lra as lra
    import attnzoo.experiments.mqar as mqar
    import attnzoo.experiments.seq2seq_report as seq2seq_report
    import attnzoo.training as training

    def started(*args, **kwargs):
        raise AssertionError("work started despite a usage error")

    for module, name in ((compare, "run_compare"), (lra, "run_lra"), (mqar, "run_mqar"),
                         (seq2seq_report, "run_report"), (training, "train")):
        monkeypatch.setattr(module, name, started)


def _usage_error_line(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == EXIT_USAGE and len(lines) == 1, captured.err
    return lines[0]


def _bad_outputs(root: Path) -> dict:
    (root / "a-file").write_text("keep me")
    return {"an existing file": (root / "a-file", "exists and is not a directory"),
            "under a file": (root / "a-file" / "out", "cannot create the directory (Not a directory)")}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("value", ["-1", "0", "x", "1.5", "nan"])
def test_bad_threads_are_one_line_exit_2_in_every_command(command, value, capsys, tmp_path, no_work):
    if command == "compare" and value == "0":
        value = "-2"  # compare's --threads 0 means every core
    out = tmp_path / "out"
    line = _usage_error_line([*COMMANDS[command], "--threads", value, "--output", str(out)], capsys)
    assert "--threads" in line and line.startswith("attnzoo"), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("kind", ["an existing file", "under a file"])
def test_an_output_that_cannot_be_a_directory_is_one_line_exit_2_in_every_command(command, kind, capsys, tmp_path,
                                                                                   no_work):
    output, problem = _bad_outputs(tmp_path)[kind]
    line = _usage_error_line([*COMMANDS[command], "--output", str(output)], capsys)
    assert line == f"attnzoo {command}: error: --output {output}: {problem}"
    assert [path.name for path in tmp_path.iterdir()] == ["a-file"] and (tmp_path / "a-file").read_text() == "keep me"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes to read-only directories")
@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_output_in_a_read_only_directory_is_one_line_exit_2_in_every_command(command, capsys, tmp_path, no_work):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        line = _usage_error_line([*COMMANDS[command], "--output", str(locked / "out")], capsys)
        assert line.startswith(f"attnzoo {command}: error: --output {locked / 'out'}: cannot create the directory")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_resume_naming_a_file_is_one_line_exit_2(capsys, tmp_path, no_work):
    (tmp_path / "a-file").write_text("")
    line = _usage_error_line(["train", "--resume", str(tmp_path / "a-file")], capsys)
    assert line == f"attnzoo train: error: --resume {tmp_path / 'a-file'}: exists and is not a directory"


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """``attnzoo list | head -0``: the write into a closed pipe stops the command with 141, no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes anything
    try:
        done = subprocess.run([sys.executable, "-m", "attnzoo", "list"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""
