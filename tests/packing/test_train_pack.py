"""Training on packed batches (``TrainConfig.pack``, ``attnzoo train --pack``): documents back to back with no
padding, the loss masked at document boundaries, the same results as unpacked, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnzoo.cli import main
from attnzoo.tasks import IGNORE_INDEX, PackedSplit, load, pack_documents
from attnzoo.training import TrainConfig, build_model, find_checkpoint, train
from attnzoo.training.evaluation import input_tokens, loss_and_tally, take
from attnzoo.training.packing import take_packed

LISTOPS = {"train_size": 32, "validation_size": 8, "test_size": 8, "min_length": 8, "max_length": 24}
BYTES = {"train_bytes": 8192, "validation_bytes": 2048, "test_bytes": 2048, "seq_len": 32}
SMALL = dict(dim=16, depth=1, heads=2, batch_size=4, steps=5, eval_interval=2, eval_batches=2)


def small(task: str, **changes) -> TrainConfig:
    options = {"listops": LISTOPS, "bytes": BYTES}[task]
    return TrainConfig(task, **{**SMALL, "task_options": options, "pack": True, **changes})


# -- the data ------------------------------------------------------------------------------------------------
def test_pack_documents_lays_documents_back_to_back_and_masks_their_last_tokens():
    tokens = torch.arange(10, 21)  # documents of 3, 5 and 3 tokens: 11 tokens, rows of 4 (the last 3 dropped)
    split = pack_documents(tokens, [3, 5, 3], 4)
    assert split.inputs.tolist() == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert split.targets.tolist() == [[11, 12, IGNORE_INDEX, 14], [15, 16, 17, IGNORE_INDEX]]
    # document starts: 10 and 13; the second row starts the rest of the second document
    assert split.document_starts.tolist() == [[True, False, False, True], [True, False, False, False]]
    assert split.padding_mask is None
    with pytest.raises(ValueError, match="sum to the 11 tokens"):
        pack_documents(tokens, [3, 5], 4)


def test_bytes_packs_its_files_as_documents():
    task = load("bytes", **BYTES)
    split = task.packed_split("train")
    assert isinstance(split, PackedSplit) and split.inputs.shape[1] == BYTES["seq_len"]
    stream = split.inputs.reshape(-1)
    assert torch.equal(stream, task.packed_split("train").inputs.reshape(-1))  # built once, the same
    assert torch.equal(stream, task.stream("train")[: stream.numel()])  # the files in order, nothing padded
    ends = torch.tensor(task.file_lengths["train"]).cumsum(0)
    ends = ends[ends < stream.numel()]
    # The last byte of every file predicts nothing; the next file starts a document.
    assert bool((split.targets.reshape(-1)[ends - 1] == IGNORE_INDEX).all())
    assert bool(split.document_starts.reshape(-1)[ends].all())
    assert len(task.files["train"]) == len(task.file_lengths["train"]) > 1


def test_a_packed_batch_holds_real_tokens_only_with_offsets_per_document():
    task = load("listops", **LISTOPS)
    split, index = task.packed_split("train"), torch.tensor([3, 0, 5])
    inputs, targets, offsets = take_packed(split, index)
    lengths = (~split.padding_mask[index]).sum(dim=1)
    assert inputs.shape == (1, int(lengths.sum())) == (1, input_tokens(split, index))
    assert offsets.tolist() == [0, *lengths.cumsum(0).tolist()] and offsets.dtype == torch.int64
    assert torch.equal(targets, split.targets[index])
    assert torch.equal(inputs[0, : lengths[0]], split.inputs[3, : lengths[0]])

    rows = load("bytes", **BYTES).packed_split("train")
    inputs, targets, offsets = take_packed(rows, torch.tensor([1, 2]))
    assert inputs.shape == targets.shape == (1, 2 * BYTES["seq_len"])
    assert BYTES["seq_len"] in offsets.tolist()  # a row never runs into the next one


# -- the loss ------------------------------------------------------------------------------------------------
def test_packed_bytes_loss_is_the_documents_losses_alone():
    task = load("bytes", **BYTES)
    torch.manual_seed(0)
    model = build_model(small("bytes", mechanism="linear"), task).double().eval()
    split = task.packed_split("train")
    inside = split.document_starts[:, 1:].any(dim=1).nonzero().reshape(-1)[:3]  # rows where a file ends
    inputs, targets, offsets = take_packed(split, inside)
    assert len(offsets) > 4
    loss, tally = loss_and_tally("lm", model(inputs, cu_seqlens=offsets), targets)
    total, scored = 0.0, 0
    for start, end in zip(offsets.tolist(), offsets[1:].tolist()):
        alone = loss_and_tally("lm", model(inputs[:, start:end]), targets[:, start:end])[1]
        total, scored = total + alone.loss_sum, scored + alone.scored
    assert tally.scored == scored == int((targets != IGNORE_INDEX).sum()) < targets.numel()
    assert tally.loss_sum == pytest.approx(total, rel=1e-6)  # loss_and_tally sums in float32


@pytest.mark.parametrize("blocks", [{}, {"block": "mamba2", "block_options": {"state_dim": 4, "chunk_size": 4}}],
                         ids=["attention", "mamba2"])
def test_packed_listops_gives_the_padded_loss_and_gradients(blocks):
    """Results equal to the padded run: one batch's loss and gradients, packed and padded. (A Mamba-2
    classifier reads left to right and ignores the padding at the end of a row, so it agrees too.)"""
    task = load("listops", **LISTOPS)
    torch.manual_seed(0)
    model = build_model(small("listops", **blocks), task).double()
    split, index = task.split("train"), torch.arange(8)
    inputs, targets, mask = take(split, index)
    padded, _ = loss_and_tally("classify", model(inputs, padding_mask=mask), targets)
    padded.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    inputs, targets, offsets = take_packed(split, index)
    packed, _ = loss_and_tally("classify", model(inputs, cu_seqlens=offsets), targets)
    packed.backward()
    assert float(packed.detach()) == pytest.approx(float(padded.detach()), rel=1e-6)  # float32 cross-entropy
    for mine, theirs in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


# -- runs ----------------------------------------------------------------------------------------------------
def _interrupt_at(stop: int):
    def on_step(step, metrics):
        if step == stop:
            raise KeyboardInterrupt
    return on_step


@pytest.mark.parametrize("task", ["bytes", "listops"])
def test_an_interrupted_packed_run_resumes_to_bit_identical_parameters(tmp_path, task):
    config = small(task, dropout=0.1)
    whole = train(config, tmp_path / "whole", progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "cut", progress=False, on_step=_interrupt_at(3))
    resumed = train(None, tmp_path / "cut", resume=True, progress=False)
    a = load_file(str(find_checkpoint(tmp_path / "whole") / "model.safetensors"))
    b = load_file(str(find_checkpoint(tmp_path / "cut") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.test == whole.test and resumed.config.pack


def test_a_packed_run_counts_real_tokens(tmp_path):
    seen = []
    result = train(small("listops", steps=2, eval_interval=2), None, progress=False,
                   on_step=lambda step, metrics: seen.append(metrics))
    split = load("listops", **LISTOPS).split("train")
    from attnzoo.training import batch_indices

    real = sum(input_tokens(split, batch_indices(len(split), 4, step, 0)) for step in range(2))
    padded = sum(split.inputs[batch_indices(len(split), 4, step, 0)].numel() for step in range(2))
    # train_seconds is rounded to the millisecond, and two tiny steps take a few: the tokens the rate implies
    # are known to within the rate times half a millisecond (plus the rate's own rounding).
    implied = result.tokens_per_second * result.train_seconds
    tolerance = result.tokens_per_second * 5e-4 + 1
    assert abs(implied - real) <= tolerance, (implied, real)
    assert padded - real > 2 * tolerance  # so a count with the padding in would fail


def test_pack_is_recorded_and_eval_packs_too(capsys, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "bytes", "--pack", "--task-options", json.dumps(BYTES), "--dim", "16", "--depth", "1",
            "--heads", "2", "--batch-size", "4", "--steps", "2", "--eval-interval", "2", "--output", str(out),
            "--quiet", "--json"]
    assert main(argv) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["config"]["pack"] is True
    assert json.loads((Path(out) / "run.json").read_text())["train"]["pack"] is True
    assert main(["eval", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == trained["test"]


@pytest.mark.parametrize("argv, message", [
    (["recall", "--pack"], "--pack is refused: recall cannot be packed: every sequence has the full length"),
    (["copy", "--pack"], "--pack is refused: copy cannot be packed: its model is a Seq2SeqTransformer"),
    (["listops", "--pack", "--mechanism", "linformer", "--task-options", json.dumps(LISTOPS)],
     "--pack is refused: linformer"),
    (["listops", "--pack", "--mechanism", "synthesizer", "--task-options", json.dumps(LISTOPS)],
     "--pack is refused: synthesizer's learned tables"),
])
def test_pack_where_it_cannot_work_is_a_one_line_usage_error(capsys, tmp_path, argv, message):
    assert main(["train", *argv, "--steps", "1", "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnzoo train: error: " + message) and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
