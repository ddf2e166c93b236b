"""``layers`` in training (docs/hybrids.md): a mixed stack trains, checkpoints and resumes bit-identically, the
checkpoint records the schedule, ``attnzoo train --layers`` refuses every bad schedule with one line naming
``--layers`` before any work, and ``--resume`` with another schedule is refused."""

from __future__ import annotations

import json
import re

import pytest

from cli_runs import run_cli
from resumed_runs import same_weights, whole_and_resumed
from attnzoo.tasks import load
from attnzoo.training import TrainConfig, build_model, find_checkpoint
from attnzoo.training.checkpoint import read_config

GATED, SOFTMAX = "gated_delta", "softmax"
BYTES = {"train_bytes": 4096, "validation_bytes": 1024, "test_bytes": 1024, "seq_len": 16}
LISTOPS = {"train_size": 32, "validation_size": 8, "test_size": 8, "min_length": 8, "max_length": 16}
SCHEDULE = f"{GATED}, mamba2(state_dim=8,chunk_size=4)"
RECORDED = f"{GATED},block:mamba2(state_dim=8,chunk_size=4)"
SMALL = ["--dim", "16", "--depth", "2", "--heads", "2", "--batch-size", "4", "--steps", "4", "--eval-interval", "2",
         "--eval-batches", "1", "--quiet"]


_cli = run_cli  # attnzoo in-process: (exit code, stdout, stderr)


def test_a_mixed_stack_resumes_bit_identically_and_records_its_schedule(tmp_path):
    config = TrainConfig("bytes", task_options=BYTES, dim=16, depth=2, heads=2, kv_heads=1, batch_size=4, steps=5,
                         eval_interval=2, eval_batches=1, dropout=0.1, layers=SCHEDULE)
    assert config.layers == RECORDED and config.model_label == f"{GATED}+mamba2"
    model = build_model(config, load("bytes", **BYTES))
    assert [type(layer).__name__ for layer in model.decoder.layers] == ["DecoderLayer", "Mamba2DecoderLayer"]
    whole, resumed = whole_and_resumed(config, tmp_path, stop_at=2)
    assert same_weights(tmp_path)
    assert resumed.test == whole.test
    assert read_config(find_checkpoint(tmp_path / "cut"))["train"]["layers"] == RECORDED


def test_train_eval_and_resume_with_layers_from_the_command_line(capsys, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "bytes", "--task-options", json.dumps(BYTES), *SMALL, "--layers", SCHEDULE, "--output", str(out)]
    code, stdout, err = _cli(capsys, *argv)
    assert code == 0 and stdout.startswith(f"{GATED}+mamba2 on bytes"), err
    code, stdout, err = _cli(capsys, "eval", str(out), "--json")
    assert code == 0 and json.loads(stdout)["layers"] == RECORDED, err
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--layers", f"{SOFTMAX},{GATED}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--layers '{SOFTMAX},{GATED}' (the checkpoint has '{RECORDED}')" in err
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--layers", RECORDED.replace(",", ", "))
    assert code == 0 and "is complete" in err, err  # the same schedule, spelt otherwise


@pytest.mark.parametrize("task, layers, extra, message", [
    ("bytes", f"{GATED}*3,{SOFTMAX}", [], r"--layers has 4 items .*which does not divide depth 2"),
    ("bytes", "nope,softmax", [], r"--layers item 'nope': unknown mechanism or block 'nope'"),
    ("bytes", "block:lstm,softmax", [], r"--layers item 'block:lstm': unknown block 'lstm'"),
    ("bytes", "local(windw=4),softmax", [], r"--layers item 'local\(windw=4\)': .*unknown option\(s\) windw"),
    ("bytes", "local(window=0),softmax", [], r"--layers item 'local\(window=0\)': window must be"),
    ("bytes", "mamba2(state_dim=x),softmax", [], r"--layers item 'block:mamba2\(state_dim=x\)': state_dim must"),
    ("bytes", "fnet,softmax", [], r"--layers cannot train on bytes: layers item 'fnet': bytes is next-token "
                                  r"prediction, which needs causal attention"),
    ("bytes", "softmax(a=1", [], r"--layers 'softmax\(a=1': a parenthesis is not closed"),
    ("bytes", "softmax*2", ["--mechanism", "local"], r"--layers gives each layer's mechanism .* mechanism 'local'"),
    ("bytes", "linformer,softmax", ["--pack"], r"--pack is refused: layers item 'linformer'"),
    ("copy", "mamba2,softmax", [], r"--layers item 'block:mamba2' cannot train on copy: its model, a "
                                   r"Seq2SeqTransformer"),
    ("listops", "softmax*2", ["--block", "mamba2"], r"--layers gives each layer's .* block 'mamba2'"),
])
def test_bad_layers_are_one_line_usage_errors_before_any_work(capsys, tmp_path, task, layers, extra, message):
    options = {"bytes": BYTES, "listops": LISTOPS, "copy": {}}[task]
    argv = ["train", task, *SMALL, "--layers", layers, *extra, "--output", str(tmp_path / "run")]
    if options:
        argv[2:2] = ["--task-options", json.dumps(options)]
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()  # refused before any work
