"""The "adding a setting" recipe of docs/architecture.md: a toy setting, ``head_bias`` (a bias on the language
model's output layer), added to a copy of attnzoo by editing three files, reaches ``attnzoo train``'s flags,
the model, the checkpoint's config and ``attnzoo eval``, which rebuilds the model from that config.

The copy runs in its own interpreter, so the toy setting never reaches the test process."""

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import attnzoo

PACKAGE = Path(attnzoo.__file__).resolve().parent
MOST_FILES = 3

# The whole recipe: (file, text found once, text it becomes).
RECIPE: List[Tuple[str, str, str]] = [
    ("training/config.py", "    def __post_init__(self) -> None:\n        check_declared(self)",
     "    head_bias: bool = setting(False, check=boolean, help=\"a bias on the output layer of a language model\")\n"
     "\n    def __post_init__(self) -> None:\n        check_declared(self)"),
    ("models/config.py", "    block_config: BlockConfig = field(init=False",
     "    head_bias: bool = False\n    block_config: BlockConfig = field(init=False"),
    ("models/language.py", "nn.Linear(config.dim, config.vocab_size, bias=False)",
     "nn.Linear(config.dim, config.vocab_size, bias=config.head_bias)"),
]

# One interpreter: train with the new flag, evaluate the checkpoint, and report what reached where.
SCRIPT = """
import json, sys
from attnzoo.cli import main
from attnzoo.tasks import load
from attnzoo.training import TrainConfig, build_model
from attnzoo.training.checkpoint import find_checkpoint, read_config

run, task_options = sys.argv[1], json.loads(sys.argv[2])
tiny = ["--dim", "16", "--depth", "1", "--heads", "2", "--batch-size", "4", "--steps", "2", "--eval-interval", "2",
        "--eval-batches", "1", "--quiet", "--task-options", json.dumps(task_options)]
trained = main(["train", "bytes", *tiny, "--head-bias", "--output", run])
evaluated = main(["eval", run, "--json"])  # rebuilds the model from the recorded config, loads it strictly
task = load("bytes", **task_options)
models = {flag: build_model(TrainConfig("bytes", task_options=task_options, dim=16, heads=2, head_bias=flag), task)
          for flag in (True, False)}
print(json.dumps({"trained": trained, "evaluated": evaluated,
                  "recorded": read_config(find_checkpoint(run))["train"]["head_bias"],
                  "biased": {str(flag): model.head.bias is not None for flag, model in models.items()}}))
"""
BYTES = {"train_bytes": 2048, "validation_bytes": 512, "test_bytes": 512, "seq_len": 16}


def edited_copy(target: Path, recipe: List[Tuple[str, str, str]]) -> Path:
    """A copy of the attnzoo package under ``target/src`` with the recipe's edits; returns the package."""
    package = target / "src" / "attnzoo"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    for relative, old, new in recipe:
        path = package / relative
        text = path.read_text()
        assert text.count(old) == 1, f"{relative} no longer holds the recipe's anchor {old!r}"
        path.write_text(text.replace(old, new))
    return package


def changed_files(original: Path, copy: Path) -> List[str]:
    """The files of ``copy`` that differ from (or are missing in) ``original``, relative to ``copy``."""
    def walk(comparison: filecmp.dircmp, prefix: Path) -> List[str]:
        files = [str(prefix / name) for name in comparison.diff_files + comparison.left_only]
        for name, sub in comparison.subdirs.items():
            files += walk(sub, prefix / name)
        return files

    return sorted(walk(filecmp.dircmp(copy, original, ignore=["__pycache__"]), Path()))


def test_a_new_setting_reaches_the_flags_the_model_and_the_checkpoint_from_three_files(tmp_path):
    package = edited_copy(tmp_path, RECIPE)
    changed = changed_files(PACKAGE, package)
    assert changed == sorted(relative for relative, _, _ in RECIPE) and len(changed) <= MOST_FILES
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(run), json.dumps(BYTES)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(package.parent)})
    assert result.returncode == 0, result.stderr
    report: Dict = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["trained"] == 0 and report["evaluated"] == 0
    assert report["recorded"] is True  # config.json holds it, so eval and --resume rebuild the same model
    assert report["biased"] == {"True": True, "False": False}  # the flag changes the model


def test_the_file_count_catches_a_fourth_file(tmp_path):
    """The count is of every file that differs: a recipe that needed one more file would fail the test above."""
    package = edited_copy(tmp_path, RECIPE + [("cli/train.py", "IMPORTS_JSON = ", "IMPORTS_JSON  = ")])
    assert len(changed_files(PACKAGE, package)) == MOST_FILES + 1

