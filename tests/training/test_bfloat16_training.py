"""Training under bfloat16 autocast (``--precision bfloat16``) with every registered mechanism and with each
gated block: a few steps of a tiny model end with a finite loss.

Each mechanism trains a language model on ``bytes`` (causal attention) where it can, else a classifier on
``listops`` (bidirectional, with key padding). Forward and backward of every mechanism under autocast, and
their closeness to float32, are checked in ``tests/conformance/test_autocast.py``; this is the user's path
through the training loop (its optimiser, gradient clipping and evaluation) and the command line.
"""

from __future__ import annotations

import json
import math

import pytest

import attnzoo
from attnzoo.cli import main
from attnzoo.tasks import load
from attnzoo.training import TrainConfig, train, unsupported_reasons

BYTES = {"train_bytes": 2048, "validation_bytes": 512, "test_bytes": 512, "seq_len": 16}
LISTOPS = {"train_size": 16, "validation_size": 8, "test_size": 8, "min_length": 8, "max_length": 16}
TINY = dict(dim=16, depth=1, heads=2, batch_size=4, steps=3, eval_interval=3, eval_batches=1, precision="bfloat16")
# Options a mechanism needs at this size (linformer's default rank exceeds the length).
OPTIONS = {"linformer": {"rank": 4}}


def config_for(name: str) -> TrainConfig:
    """The mechanism's run: a language model on bytes if it attends causally, else a listops classifier."""
    options = OPTIONS.get(name, {})
    reasons = {}
    for task, task_options in (("bytes", BYTES), ("listops", LISTOPS)):
        config = TrainConfig(task, task_options=task_options, mechanism=name, mechanism_options=options, **TINY)
        reasons[task] = unsupported_reasons(config, load(task, **task_options))
        if not reasons[task]:
            return config
    raise AssertionError(f"{name} can train on neither task: {reasons}")


@pytest.mark.slow
@pytest.mark.parametrize("name", attnzoo.available())
def test_every_mechanism_trains_in_bfloat16(name, one_thread):
    result = train(config_for(name), None, progress=False)
    assert math.isfinite(result.test["loss"]), result.test


@pytest.mark.slow
@pytest.mark.parametrize("block, options", [("gau", {}), ("flash_gau", {"chunk_size": 4})])
@pytest.mark.parametrize("task, task_options", [("bytes", BYTES), ("listops", LISTOPS)])
def test_each_gated_block_trains_in_bfloat16(block, options, task, task_options, one_thread):
    config = TrainConfig(task, task_options=task_options, block=block, block_options=options, **TINY)
    result = train(config, None, progress=False)
    assert math.isfinite(result.test["loss"]), result.test


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["linear", "efficient"])
def test_attnzoo_train_with_precision_bfloat16(mechanism, capsys, tmp_path, one_thread):
    """The command of the bug report: the hand-written causal backward of linear (and efficient) attention."""
    argv = ["train", "bytes", "--mechanism", mechanism, "--precision", "bfloat16", "--steps", "2",
            "--task-options", json.dumps(BYTES), "--dim", "16", "--depth", "1", "--heads", "2",
            "--batch-size", "4", "--eval-interval", "2", "--output", str(tmp_path), "--quiet", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["precision"] == "bfloat16"
    assert math.isfinite(result["test"]["loss"])


def test_a_seq2seq_model_decoding_with_flash_gau_in_bfloat16(one_thread):
    """Evaluation decodes token by token under autocast: flash_gau's prefill gave its linear state in bfloat16
    (an autocast matmul) where its state layout declares float32, and the next step refused it."""
    task_options = dict(train_size=16, validation_size=4, test_size=4, length=6)
    config = TrainConfig("copy", task_options=task_options, mechanism="flash_gau",
                         mechanism_options={"chunk_size": 4}, **{**TINY, "steps": 2, "eval_interval": 2})
    result = train(config, None, progress=False)
    assert math.isfinite(result.test["loss"]) and 0 <= result.test["exact_match"] <= 1, result.test
