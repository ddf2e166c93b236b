"""Length-grouped batches (``TrainConfig.group_by_length``, ``attnzoo train --group-by-length``): batches of
examples of similar length cut to their longest example, the same outputs as the padded batch, a pure function
of (seed, step), exact resume, and refusals where cutting the padding would change what a model computes."""

from __future__ import annotations

import json

import pytest
import torch

from attnzoo.cli import main
from resumed_runs import same_weights, whole_and_resumed
from attnzoo.tasks import IGNORE_INDEX, load
from attnzoo.training import TrainConfig, batch_indices, build_model, train
from attnzoo.training.evaluation import loss_and_tally, model_logits, take
from attnzoo.training.length_groups import LengthGroupedOrder, example_lengths, trimmed_batch

COPY = dict(train_size=40, validation_size=8, test_size=8, length=12, min_length=1)
LISTOPS = {"train_size": 32, "validation_size": 8, "test_size": 8, "min_length": 8, "max_length": 24}
SMALL = dict(dim=16, depth=1, heads=2, batch_size=8, steps=6, eval_interval=3, eval_batches=1)


def test_each_epoch_is_a_set_of_full_distinct_batches_that_depends_on_seed_and_step_alone():
    lengths = torch.randint(1, 20, (50,), generator=torch.Generator().manual_seed(0))
    order = LengthGroupedOrder(lengths, 8, seed=3, pool_batches=2)
    assert order.batches_per_epoch == 6  # 48 of the 50 examples each epoch, all batches full
    for epoch in range(2):
        seen = torch.cat([order(epoch * 6 + position) for position in range(6)])
        assert len(seen) == 48 and len(set(seen.tolist())) == 48
    # the order of the calls does not matter (a resumed run asks for step 7 first)
    fresh = LengthGroupedOrder(lengths, 8, seed=3, pool_batches=2)
    assert torch.equal(fresh(7), order(7)) and torch.equal(fresh(0), LengthGroupedOrder(lengths, 8, 3, 2)(0))
    # another epoch or another seed deals other batches
    assert not torch.equal(order.epoch_batches(0), order.epoch_batches(1))
    assert not torch.equal(order.epoch_batches(0), LengthGroupedOrder(lengths, 8, 4, 2).epoch_batches(0))


def test_grouped_batches_are_shorter_than_random_ones():
    split = load("copy", **{**COPY, "train_size": 400}).split("train")
    lengths = (~split.padding_mask).sum(dim=1)
    order = LengthGroupedOrder(example_lengths(split), 16, seed=0)
    grouped = sum(int(lengths[order(step)].max()) for step in range(25)) / 25
    random = sum(int(lengths[batch_indices(len(split), 16, step, 0)].max()) for step in range(25)) / 25
    assert random >= 11 and grouped <= random - 4, (grouped, random)


def test_padding_before_a_token_is_refused_rather_than_cut_away():
    from attnzoo.tasks import Split

    inputs = torch.tensor([[5, 6, 0], [0, 7, 8]])
    split = Split(inputs, torch.tensor([0, 1]), inputs == 0)
    with pytest.raises(ValueError, match="needs padding at the end of each row"):
        example_lengths(split)


def test_a_trimmed_seq2seq_batch_keeps_every_token_and_drops_only_padding():
    split = load("copy", **COPY).split("train")
    index = torch.tensor([3, 1, 7])
    cut = trimmed_batch(split, index)
    longest_source = int((~split.padding_mask[index]).sum(dim=1).max())
    longest_target = int((split.targets[index] != IGNORE_INDEX).sum(dim=1).max())
    assert cut.inputs.shape == (3, longest_source) and cut.targets.shape == (3, longest_target)
    assert torch.equal(cut.inputs, split.inputs[index, :longest_source])
    assert torch.equal(cut.decoder_inputs, split.decoder_inputs[index, :longest_target])
    assert torch.equal(split.inputs[index, longest_source:], torch.zeros_like(split.inputs[index, longest_source:]))
    assert bool((split.targets[index, longest_target:] == IGNORE_INDEX).all())
    whole = trimmed_batch(split, index, trim=False)
    assert torch.equal(whole.inputs, split.inputs[index]) and torch.equal(whole.targets, split.targets[index])


@pytest.mark.parametrize("task, options", [("copy", COPY), ("listops", LISTOPS)])
def test_the_loss_of_a_trimmed_batch_is_the_padded_batch_loss(task, options):
    torch.manual_seed(0)
    config = TrainConfig(task, task_options=options, **SMALL)
    data = load(task, **options)
    model = build_model(config, data).eval()
    split = data.split("train")
    index = torch.sort(example_lengths(split), stable=True).indices[:8]  # the shortest: a deep cut
    losses = []
    for batch, rows in ((split, index), (trimmed_batch(split, index), torch.arange(8))):
        inputs, targets, mask = take(batch, rows)
        logits, _ = model_logits(model, data, batch, rows, inputs, mask)
        losses.append(loss_and_tally(data.kind, logits, targets)[0])
    assert trimmed_batch(split, index).inputs.shape[1] < split.inputs.shape[1]  # something was cut
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("task, options", [("copy", COPY), ("listops", LISTOPS)])
def test_an_interrupted_grouped_run_resumes_to_bit_identical_parameters(tmp_path, task, options):
    config = TrainConfig(task, task_options=options, group_by_length=True, dropout=0.1, **SMALL)
    whole, resumed = whole_and_resumed(config, tmp_path, stop_at=4)
    assert same_weights(tmp_path)
    assert resumed.test["loss"] == whole.test["loss"] and resumed.config.group_by_length
    # and it trained on other batches than the ungrouped run
    plain = train(TrainConfig(task, task_options=options, dropout=0.1, **SMALL), None, progress=False)
    assert plain.test["loss"] != whole.test["loss"]


def test_group_by_length_is_recorded_in_the_run(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "copy", "--group-by-length", "--task-options", json.dumps(COPY), "--dim", "16",
                 "--depth", "1", "--heads", "2", "--batch-size", "8", "--steps", "2", "--eval-interval", "2",
                 "--output", str(out), "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["group_by_length"] is True


@pytest.mark.parametrize("argv, message", [
    (["bytes", "--task-options", "train_bytes=4096,validation_bytes=1024,test_bytes=1024,seq_len=32"],
     "--group-by-length needs a task whose examples are padded; every bytes example is 32 tokens long"),
    # (at 24 tokens nystrom's landmarks are the positions themselves: exact, and cut batches are fine)
    (["listops", "--mechanism", "nystrom", "--task-options", json.dumps({**LISTOPS, "max_length": 160})],
     "--group-by-length is refused: nystrom gives other outputs when a batch is cut to its longest example"),
    (["listops", "--pack", "--task-options", json.dumps(LISTOPS)],
     "--group-by-length cannot be combined with pack"),
    (["copy", "--batch-size", "64", "--task-options", json.dumps(COPY)],
     "--group-by-length needs batch_size at most the 40 training examples (every batch is full), got 64"),
])
def test_group_by_length_where_it_cannot_work_is_a_one_line_usage_error(capsys, tmp_path, argv, message):
    assert main(["train", *argv, "--group-by-length", "--dim", "16", "--depth", "1", "--heads", "2", "--steps", "1",
                 "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnzoo train: error: " + message) and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
