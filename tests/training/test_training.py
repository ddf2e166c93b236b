"""attnzoo.training and the train / eval / lra commands: the loop learns, resumes exactly, and refuses bad
checkpoints and settings with clear errors."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import attnzoo
from cli_runs import run_cli
from attnzoo import UnsupportedOptionError
from attnzoo.cli import main
from attnzoo.training import (
    CheckpointError,
    TrainConfig,
    batch_indices,
    build_model,
    evaluate_checkpoint,
    find_checkpoint,
    load_trained,
    train,
    unsupported_reasons,
)
from attnzoo.training import checkpoint as checkpoint_module
from attnzoo.training.checkpoint import read_config
from attnzoo.tasks import load

LISTOPS = {"train_size": 64, "validation_size": 16, "test_size": 16, "min_length": 8, "max_length": 24}
RECALL = {"train_size": 64, "validation_size": 16, "test_size": 16, "num_pairs": 4, "num_keys": 8, "num_values": 4}
BYTES = {"train_bytes": 8192, "validation_bytes": 2048, "test_bytes": 2048, "seq_len": 32}
SMALL = dict(dim=16, depth=1, heads=2, batch_size=8, steps=6, eval_interval=3)


def small(task: str = "listops", **changes) -> TrainConfig:
    options = {"listops": LISTOPS, "recall": RECALL, "bytes": BYTES}[task]
    settings = {**SMALL, "task_options": options, **changes}
    return TrainConfig(task, **settings)


def weights(output: Path) -> dict:
    return load_file(str(find_checkpoint(output) / "model.safetensors"))


# -- schedule and data order ---------------------------------------------------------------------------------
def test_learning_rate_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    config = TrainConfig("listops", steps=110, warmup_steps=10, min_lr_ratio=0.1)
    factors = [config.learning_rate_factor(step) for step in range(110)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1)
    middle = 10 + 99 // 2
    assert factors[middle] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (middle - 10) / 99)))
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))  # never rises after warm-up
    assert TrainConfig("listops", steps=50).warmup == 5


def test_batches_cover_every_example_once_per_epoch_and_do_not_depend_on_history():
    size, batch = 10, 4
    epochs = torch.cat([batch_indices(size, batch, step, seed=3) for step in range(5)])  # 20 = two epochs
    assert sorted(epochs[:10].tolist()) == list(range(10)) and sorted(epochs[10:].tolist()) == list(range(10))
    assert torch.equal(batch_indices(size, batch, 2, seed=3), batch_indices(size, batch, 2, seed=3))
    assert not torch.equal(torch.cat([batch_indices(size, batch, s, seed=4) for s in range(5)]), epochs)


# -- config --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, error", [
    ("steps", 0, ValueError), ("lr", 0.0, ValueError), ("lr", float("nan"), ValueError),
    ("dropout", 1.0, ValueError), ("batch_size", 2.0, TypeError), ("precision", "float16", ValueError),
    ("grad_clip", -1.0, ValueError), ("min_lr_ratio", 1.5, ValueError), ("heads", 3, ValueError),
    ("mechanism_options", "nb_features=4", TypeError), ("seed", -1, ValueError),
])
def test_config_refuses_bad_settings_naming_them(field, value, error):
    with pytest.raises(error, match="heads" if field == "heads" else field):
        TrainConfig("listops", **{field: value})


def test_config_round_trips_and_names_unknown_fields():
    config = small()
    assert TrainConfig.from_dict(config.as_dict()) == config
    with pytest.raises(ValueError, match="stepz"):
        TrainConfig.from_dict({**config.as_dict(), "stepz": 3})


# -- training ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task, mechanism, metric", [
    ("listops", "softmax", "accuracy"), ("listops", "performer", "accuracy"), ("recall", "linear", "accuracy"),
    ("bytes", "softmax", "bits_per_byte"), ("bytes", "gla", "bits_per_byte"),
])
def test_a_few_steps_on_each_task_write_metrics_checkpoint_and_results(tmp_path, task, mechanism, metric):
    result = train(small(task, mechanism=mechanism), tmp_path, progress=False, command=["attnzoo", "train"])
    assert result.steps == 6 and metric in result.test and metric in result.baseline
    assert math.isfinite(result.test[metric]) and math.isfinite(result.validation["loss"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["command"] == ["attnzoo", "train"] and saved["test"] == result.test
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,split,loss") and len(rows) == 1 + 4  # train + validation at steps 3 and 6
    assert find_checkpoint(tmp_path).name == "step-000006"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == ["step-000006"]


def test_training_learns_beyond_the_untrained_model(tmp_path):
    """A classifier trained for a few dozen steps fits its training data far better than at the start."""
    config = small("recall", steps=40, lr=3e-3, dim=32, eval_interval=40)
    task = load("recall", **config.task_options)
    trained, _, _ = load_trained(train(config, tmp_path, progress=False).output)
    from attnzoo.training import evaluate
    from attnzoo.training.model import build_model

    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        untrained = build_model(config, task)
    assert evaluate(trained, task, "train")["loss"] < 0.8 * evaluate(untrained, task, "train")["loss"]


def test_the_callers_random_state_is_left_alone(tmp_path):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    train(small(), None, progress=False)
    assert torch.equal(torch.get_rng_state(), before)


def test_bfloat16_autocast_trains(tmp_path):
    result = train(small(precision="bfloat16"), None, progress=False)
    assert math.isfinite(result.test["loss"])


def test_a_length_option_is_set_to_the_task_length():
    result = train(small(mechanism="linformer", mechanism_options={"rank": 4}), None, progress=False)
    assert math.isfinite(result.test["loss"])


def test_a_non_causal_mechanism_cannot_train_a_language_model():
    config = small("bytes", mechanism="linformer", mechanism_options={"rank": 4})
    reasons = unsupported_reasons(config, load("bytes", **BYTES))
    assert reasons and "causal" in reasons[0]
    with pytest.raises(UnsupportedOptionError, match="linformer cannot train on bytes.*causal"):
        train(config, None, progress=False)


# -- resume --------------------------------------------------------------------------------------------------
def _interrupt_at(stop: int):
    def on_step(step, metrics):
        if step == stop:
            raise KeyboardInterrupt
    return on_step


@pytest.mark.parametrize("stop, mechanism", [(2, "softmax"), (3, "softmax"), (2, "vq")])  # between / at evaluations;
def test_an_interrupted_run_resumes_to_bit_identical_parameters(tmp_path, stop, mechanism):  # vq: EMA codebooks
    config = small(dropout=0.1, steps=7, mechanism=mechanism)
    whole = train(config, tmp_path / "whole", progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "cut", progress=False, on_step=_interrupt_at(stop))
    assert find_checkpoint(tmp_path / "cut").name == f"step-{stop:06d}"
    resumed = train(None, tmp_path / "cut", resume=True, progress=False)
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.test == whole.test
    # The log holds each evaluation once, with the same losses as the uninterrupted run's (timings aside).
    columns = lambda run: [row.split(",")[:5] for row in (tmp_path / run / "metrics.csv").read_text().splitlines()]
    assert columns("cut") == columns("whole")


def test_resume_refuses_another_configuration(tmp_path):
    train(small(), tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="another configuration.*lr"):
        train(small(lr=5e-4), tmp_path, resume=True, progress=False)


# -- bad checkpoints -----------------------------------------------------------------------------------------
@pytest.fixture
def run_dir(tmp_path):
    train(small(), tmp_path / "run", progress=False)
    return tmp_path / "run"


def test_a_truncated_weights_file_is_named(run_dir):
    path = find_checkpoint(run_dir) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated"):
        evaluate_checkpoint(run_dir)


def test_an_altered_file_is_named(run_dir):
    path = find_checkpoint(run_dir) / "state.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="state.pt: corrupt"):
        train(None, run_dir, resume=True, progress=False)


def test_weights_of_another_model_are_refused(run_dir, tmp_path):
    other = tmp_path / "other"
    train(small(dim=32), other, progress=False)
    shutil.copy(find_checkpoint(other) / "model.safetensors", find_checkpoint(run_dir) / "model.safetensors")
    manifest_path = find_checkpoint(run_dir) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model.safetensors"] = json.loads((find_checkpoint(other) / "manifest.json").read_text())["model.safetensors"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not fit the model"):
        evaluate_checkpoint(run_dir)


def test_a_directory_without_a_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        find_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        find_checkpoint(tmp_path / "missing")


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_in_place(run_dir, monkeypatch):
    before = find_checkpoint(run_dir)
    model, _, config = load_trained(run_dir)

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint_module.save_checkpoint(run_dir, 99, model, {"train": config.as_dict()}, {})
    assert find_checkpoint(run_dir) == before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["LATEST", before.name]
    evaluate_checkpoint(run_dir)  # still loads


# -- command line --------------------------------------------------------------------------------------------
_cli = run_cli  # attnzoo in-process: (exit code, stdout, stderr)


def test_version(capsys):
    code, out, _ = _cli(capsys, "--version")
    assert code == 0 and out.strip() == f"attnzoo {attnzoo.__version__}"


def test_train_help_lists_the_tasks(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for task in ("listops", "pathfinder", "bytes", "recall"):
        assert task in out


@pytest.mark.parametrize("argv, message", [
    (["train", "listopz"], "unknown task 'listopz'; valid: .*listops"),
    (["train", "listops", "--mechanism", "softmaks"], "--mechanism: unknown mechanism 'softmaks'; valid"),
    (["train", "listops", "--mechanism", "performer", "--mechanism-options", "nb_featurez=4"], "nb_featurez"),
    (["train", "listops", "--task-options", "train_sise=4"], "--task-options: .*train_sise"),
    (["train", "listops", "--lr", "-1"], "--lr must be"),
    (["train", "listops", "--mechanism-options", "{bad json"], "not valid JSON"),
    (["train", "bytes", "--mechanism", "fnet"], "fnet cannot train on bytes"),
    (["train"], "give a TASK"),
    (["eval", "/nonexistent/run"], "no such directory"),
    (["train", "bytes", "--nope", "1"], r"^attnzoo train: error: unrecognized arguments: --nope 1 \(see attnzoo "
                                        r"train --help\)"),
    (["eval", "run", "--seed", "1"], r"^attnzoo eval: .*--seed 1 \(see attnzoo eval --help\)"),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = _cli(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_the_command_line_generates_the_task_once_and_train_refuses_another_task(capsys, tmp_path, monkeypatch):
    import attnzoo.tasks.listops as listops

    generated = []
    original = listops.generate_listops
    monkeypatch.setattr(listops, "generate_listops", lambda *a, **k: generated.append(1) or original(*a, **k))
    argv = ["train", "listops", "--task-options", json.dumps(LISTOPS), "--dim", "16", "--depth", "1", "--heads",
            "2", "--batch-size", "8", "--steps", "1", "--output", str(tmp_path / "run"), "--quiet"]
    code, _, err = _cli(capsys, *argv)
    assert code == 0, err
    assert len(generated) == 1  # one call generates every split; the check before training reuses it
    config = small()
    other = load("listops", **{**LISTOPS, "seed": 1})
    with pytest.raises(ValueError, match="task: the config trains 'listops'"):
        train(config, None, progress=False, task=other)
    with pytest.raises(ValueError, match="task given is 'recall'"):
        train(config, None, progress=False, task=load("recall", **RECALL))
    from attnzoo.tasks.base import task_class

    with pytest.raises(ValueError, match="built from None"):  # constructed directly: its options are unknown
        train(config, None, progress=False, task=task_class("listops")(**LISTOPS))
    derived = load("recall", **{**RECALL, "num_queries": 3})  # an option the config leaves None, given here
    with pytest.raises(ValueError, match="task: the config trains 'recall'"):
        train(small("recall"), None, progress=False, task=derived)
    given = load("listops", **LISTOPS)
    assert train(config, None, progress=False, task=given).test == train(config, None, progress=False).test


def test_train_then_eval_then_resume_from_the_command_line(capsys, tmp_path):
    out_dir = tmp_path / "run"
    argv = ["train", "listops", "--task-options", json.dumps(LISTOPS), "--dim", "16", "--depth", "1", "--heads", "2",
            "--batch-size", "8", "--steps", "4", "--eval-interval", "2", "--output", str(out_dir), "--quiet"]
    code, out, err = _cli(capsys, *argv)
    assert code == 0, err
    assert "test:" in out and "baseline:" in out
    assert json.loads((out_dir / "results.json").read_text())["command"] == ["attnzoo", *argv]
    code, out, err = _cli(capsys, "eval", str(out_dir), "--json")
    assert code == 0, err
    assert json.loads(out)["metrics"]["accuracy"] >= 0
    code, out_cpu, err = _cli(capsys, "eval", str(out_dir), "--json", "--device", "cpu")
    assert code == 0 and json.loads(out_cpu)["metrics"] == json.loads(out)["metrics"], err
    code, _, err = _cli(capsys, "eval", str(out_dir), "--device", "tpu")
    assert code == 2 and "--device" in err and len(err.strip().splitlines()) == 1, err
    # The same output again is refused; resuming with another setting is refused; resuming as it was works.
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and "already holds a run" in err
    code, _, err = _cli(capsys, "train", "--resume", str(out_dir), "--lr", "0.5")
    assert code == 2 and "--lr 0.5 (the checkpoint has 0.001)" in err
    before = (out_dir / "results.json").read_text()
    code, out, err = _cli(capsys, "train", "--resume", str(out_dir), "--steps", "4", "--quiet")
    assert code == 0 and out == "" and "is complete (4 of 4 steps)" in err, err
    assert (out_dir / "results.json").read_text() == before  # nothing re-run


def test_lra_runs_cells_writes_the_table_and_continues_where_it_stopped(capsys, tmp_path):
    argv = ["lra", "--tasks", "listops", "--mechanisms", "softmax,linformer,linear", "--steps", "2", "--jobs", "2", "--output",
            str(tmp_path), "--quiet"]
    # Small task settings come through the budget; the test shrinks it for speed.
    from attnzoo.experiments import lra

    budget = {task: dict(settings, task_options=LISTOPS if task == "listops" else settings["task_options"],
                         dim=16, depth=1, heads=2, batch_size=8)
              for task, settings in lra.BUDGETS["quick"].items()}
    original = lra.BUDGETS["quick"]
    lra.BUDGETS["quick"] = budget
    try:
        code, _, err = _cli(capsys, *argv)
        assert code == 0, err
        data = json.loads((tmp_path / "lra.json").read_text())
        assert data["cells"]["listops"]["softmax"]["status"] == "ok"
        table = (tmp_path / "lra.md").read_text()
        assert "| softmax |" in table and "baseline" in table and (tmp_path / "lra.png").exists()
        stamp = (tmp_path / "cells" / "listops" / "softmax" / "cell.json").stat().st_mtime_ns
        code, _, err = _cli(capsys, *argv)
        assert code == 0, err
        assert (tmp_path / "cells" / "listops" / "softmax" / "cell.json").stat().st_mtime_ns == stamp  # not rerun
        code, _, err = _cli(capsys, *[("3" if a == "2" else a) for a in argv])  # other --steps
        assert code == 2 and "other settings" in err
    finally:
        lra.BUDGETS["quick"] = original


def test_lra_quick_validates_once_at_the_end_on_a_few_batches_and_full_five_times_on_all():
    from attnzoo.experiments.lra import LraConfig

    for budget, evaluations, batches in (("quick", 1, 4), ("full", 5, None)):
        for task in ("listops", "recall"):
            config = LraConfig(preset=budget).train_config(task, "softmax")
            assert config.eval_interval * evaluations == config.steps and config.eval_batches == batches
    assert LraConfig(preset="quick", overrides={"steps": 7}).train_config("listops", "softmax").eval_interval == 7
    assert LraConfig(preset="quick", overrides={"eval_interval": 2}).train_config("listops", "softmax").eval_interval == 2


# -- gated units (--block) -----------------------------------------------------------------------------------
FLASH = {"chunk_size": 8, "shared_dim": 8, "expansion_dim": 24}


def test_block_flash_trains_resumes_bit_identically_and_keeps_its_units(tmp_path):
    config = small("bytes", steps=5, block="flash_gau", block_options=FLASH)
    model = build_model(config, load("bytes", **BYTES))
    units = [m for m in model.modules() if type(m).__name__ == "GatedDecoderLayer"]
    assert len(units) == config.depth and units[0].attention.chunk_size == 8 and units[0].expansion_dim == 24
    whole = train(config, tmp_path / "whole", progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "cut", progress=False, on_step=_interrupt_at(2))
    resumed = train(None, tmp_path / "cut", resume=True, progress=False)
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any("in_proj" in name for name in a)  # the saved weights are the units'
    assert resumed.test == whole.test


def test_train_bytes_with_block_flash_then_eval_and_resume_from_the_command_line(capsys, tmp_path):
    out_dir = tmp_path / "run"
    argv = ["train", "bytes", "--task-options", json.dumps(BYTES), "--dim", "16", "--depth", "1", "--heads", "2",
            "--batch-size", "8", "--steps", "4", "--eval-interval", "2", "--block", "flash_gau",
            "--block-options", "chunk_size=8,shared_dim=8", "--output", str(out_dir), "--quiet"]
    code, out, err = _cli(capsys, *argv)
    assert code == 0, err
    saved = read_config(find_checkpoint(out_dir))["train"]
    assert saved["block"] == "flash_gau" and saved["block_options"] == {"chunk_size": 8, "shared_dim": 8}
    code, out, err = _cli(capsys, "eval", str(out_dir), "--json")
    assert code == 0, err
    assert json.loads(out)["metrics"]["bits_per_byte"] > 0 and json.loads(out)["block"] == "flash_gau"
    code, out, err = _cli(capsys, "eval", str(out_dir))
    assert code == 0 and out.startswith("flash_gau on bytes"), err
    code, _, err = _cli(capsys, "train", "--resume", str(out_dir), "--block", "gau")
    assert code == 2 and "--block 'gau' (the checkpoint has 'flash_gau')" in err
    code, out, err = _cli(capsys, "train", "--resume", str(out_dir), "--steps", "4", "--quiet")
    assert code == 0, err


@pytest.mark.parametrize("argv, message", [
    (["bytes", "--block-options", "chunk_size=8"], "--block-options given but block is 'attention'"),
    (["bytes", "--block", "flash_gau", "--mechanism", "vq"], "block 'flash_gau' replaces every attention.*mechanism"),
    (["bytes", "--block", "flash_gau", "--block-options", "chunk_sise=8"], "--block-options: .*chunk_sise"),
    (["copy", "--block", "gau"], "block 'gau' cannot train on copy: its model, a Seq2SeqTransformer"),
    (["bytes", "--block", "lstm"], "--block"),
])
def test_bad_block_settings_are_usage_errors(capsys, tmp_path, argv, message):
    code, out, err = _cli(capsys, "train", *argv, "--output", str(tmp_path / "run"), "--quiet")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
