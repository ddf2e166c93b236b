"""Training on a chosen device (``train(..., device=)``, ``attnzoo train --device``, ``attnzoo lra --device``):
the device is checked before anything trains, recorded in the results, and handed to every cell. The CUDA
runs themselves are checked by ``scripts/cuda_check.py`` (its training rows) on a machine with a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from attnzoo.cli import main
from attnzoo.experiments.cells import train_command
from attnzoo.experiments.lra import LraConfig
from attnzoo.training import TrainConfig, train
from attnzoo.training.loop import training_device
from attnzoo.training.ranks import ranks_of

LISTOPS = {"train_size": 16, "validation_size": 8, "test_size": 8, "min_length": 8, "max_length": 24}
SMALL = dict(dim=16, depth=1, heads=2, batch_size=4, steps=2, eval_interval=2, eval_batches=1)


def test_a_run_records_the_device_it_trained_on(tmp_path):
    result = train(TrainConfig("listops", task_options=LISTOPS, **SMALL), tmp_path, progress=False, device="cpu")
    assert result.device == "cpu"
    assert json.loads((tmp_path / "results.json").read_text())["device"] == "cpu"


@pytest.mark.parametrize("device, message", [
    ("tpu", "device must be 'cpu' or 'cuda[:N]', got 'tpu'"),
    ("cuda:x", "device must be 'cpu' or 'cuda[:N]', got 'cuda:x'"),
    (2.5, "device must be 'cpu' or 'cuda[:N]', got 2.5"),
])
def test_a_device_that_is_not_one_is_refused_naming_it(device, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        training_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_cuda_where_there_is_none_is_a_one_line_usage_error_before_training(capsys, tmp_path):
    argv = ["train", "listops", "--device", "cuda", "--task-options", json.dumps(LISTOPS), "--steps", "1",
            "--output", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == "attnzoo train: error: --device is 'cuda' but CUDA is not available\n"
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="--device is 'cuda' but CUDA is not available"):
        LraConfig(mechanisms=["softmax"], device="cuda").validate()


def test_seq2seq_on_a_gpu_is_refused_naming_the_option(capsys, tmp_path, monkeypatch):
    import attnzoo.training.loop as loop

    monkeypatch.setattr(loop, "training_device", lambda device: torch.device("cuda", 0))  # as if there were one
    argv = ["train", "g2p", "--device", "cuda", "--task-options", "train_size=32,validation_size=8,test_size=8",
            "--steps", "1", "--output", str(tmp_path / "run")]
    assert main(argv) == 2
    assert capsys.readouterr().err == ("attnzoo train: error: --device cuda: g2p is a seq2seq task, and seq2seq "
                                       "tasks train on the CPU only\n")


def test_a_data_parallel_run_takes_its_ranks_devices_not_one_given():
    with pytest.raises(ValueError, match="device is chosen by the data-parallel process group"):
        ranks_of(object(), torch.device("cpu"))  # type: ignore[arg-type]
    assert ranks_of(None, torch.device("cpu")).device == torch.device("cpu")


def test_every_lra_cell_trains_on_the_device_given(tmp_path):
    config = TrainConfig("listops", task_options=LISTOPS, **SMALL)
    assert train_command(config, tmp_path, False, 1, (), "cuda:1")[-3:] == ["--device", "cuda:1", "--quiet"]
    assert "--device" not in train_command(config, tmp_path, False, 1)
    resumed = train_command(config, tmp_path, True, None, (), "cuda")
    assert resumed[-3:] == ["--device", "cuda", "--quiet"] and "--resume" in resumed


def test_lra_records_one_device_however_it_is_named(monkeypatch):
    # A continued run is refused when its settings differ: `--device cpu` and no `--device` are one run, and so
    # are `cuda` and `cuda:0` where device 0 is the current one.
    import attnzoo.experiments.lra as lra

    plain = LraConfig().settings()
    assert "device" not in plain and LraConfig(device="cpu").settings() == plain
    current = torch.device("cuda", 0)
    monkeypatch.setattr(lra, "training_device",
                        lambda device: current if device == "cuda" else torch.device(device))
    assert LraConfig(device="cuda").settings()["device"] == LraConfig(device="cuda:0").settings()["device"] == "cuda:0"
    assert LraConfig(device="cuda:1").settings()["device"] == "cuda:1"
