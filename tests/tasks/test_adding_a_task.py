"""The "adding a task" recipe of docs/architecture.md: a task and a mechanism with training hooks, each in a
file of its own outside attnzoo, trained by ``attnzoo train --import`` with no other file touched.

Each command runs in its own interpreter, so neither toy registers in the test process."""

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from attnzoo.training.checkpoint import find_checkpoint

TESTS = Path(__file__).resolve().parent
TASK = TESTS / "toy_new_task.py"
HOOKED = TESTS.parent / "mechanisms" / "toy_trained_mechanism.py"
TINY = ["--dim", "16", "--depth", "1", "--heads", "2", "--batch-size", "8", "--quiet"]


def attnzoo(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnzoo.cli", *argv], capture_output=True, text=True,
                          timeout=300)


def test_the_toy_task_is_one_short_class():
    source = TASK.read_text()
    assert source.count("\nclass ") == 1 and len(source.splitlines()) < 50


def test_a_task_of_your_own_trains_and_evaluates(tmp_path):
    run = tmp_path / "run"
    trained = attnzoo("train", "--import", str(TASK), "toy-parity", "--task-options", "length=6", *TINY,
                      "--steps", "2", "--eval-interval", "2", "--output", str(run))
    assert trained.returncode == 0, trained.stderr
    results = json.loads((run / "results.json").read_text())
    assert results["config"]["task"] == "toy-parity" and 0.0 <= results["test"]["accuracy"] <= 1.0
    evaluated = attnzoo("eval", str(run), "--json")  # the run recorded its import
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["task"] == "toy-parity"


def test_unknown_task_names_import_in_one_line(tmp_path):
    refused = attnzoo("train", "toy-parity", "--output", str(tmp_path / "run"))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "toy-parity" in refused.stderr and not (tmp_path / "run").exists()


def test_a_mechanism_with_training_hooks_trains_from_the_command_line(tmp_path):
    """The hooks run in attnzoo train as in the Python API: the toy's after-step update counted every step."""
    run = tmp_path / "run"
    trained = attnzoo("train", "--import", str(HOOKED), "recall", "--mechanism", "toy-tempered",
                      "--set", "penalty=0.5", "--task-options",
                      "train_size=32,validation_size=8,test_size=8,num_pairs=4,num_keys=8,num_values=4",
                      *TINY, "--steps", "3", "--eval-interval", "3", "--output", str(run))
    assert trained.returncode == 0, trained.stderr
    weights = load_file(str(find_checkpoint(run) / "model.safetensors"))
    updates = [int(value) for key, value in weights.items() if key.endswith(".updates")]
    assert updates == [3]
