"""mqar: every scored answer recomputed by a dict lookup over the pairs in the inputs; keys and values from
their halves of the vocabulary; query positions drawn by the documented power law (checked statistically);
splits that share no sequence; one-line errors naming the option; a small softmax model that learns it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli_runs import run_cli

from attnzoo import tasks
from attnzoo.tasks import IGNORE_INDEX
from attnzoo.tasks.mqar import query_slots
from attnzoo.training import TrainConfig, build_model, unsupported_reasons

SMALL = dict(train_size=60, validation_size=20, test_size=20, seq_len=40, num_pairs=6, vocab_size=32)


def _check_row(task, tokens, targets):
    """Every claim the module docstring makes about one sequence, from its tokens alone."""
    context, half = 2 * task.num_pairs, task.vocab_size // 2
    stored = dict(zip(tokens[0:context:2], tokens[1:context:2]))
    assert len(stored) == task.num_pairs and len(set(stored.values())) == task.num_pairs  # distinct
    assert all(0 <= key < half for key in stored) and all(half <= value < task.vocab_size for value in stored.values())
    scored = [t for t, target in enumerate(targets) if target != IGNORE_INDEX]
    assert len(scored) == task.num_pairs and all(t >= context and (t - context) % 2 == 0 for t in scored)
    assert sorted(tokens[t] for t in scored) == sorted(stored)  # each key queried exactly once
    for t in scored:
        assert targets[t] == stored[tokens[t]]
        if task.value_after_query:
            assert tokens[t + 1] == targets[t]  # the language-model form: the answer is the next input


@pytest.mark.parametrize("value_after_query", [True, False])
def test_every_scored_answer_by_dict_lookup(value_after_query):
    task = tasks.load("mqar", **SMALL, value_after_query=value_after_query, seed=3)
    assert (task.seq_len, task.vocab_size, task.num_classes, task.pad_id) == (40, 32, 32, None)
    for split_name in tasks.SPLITS:
        split = task.split(split_name)
        assert split.padding_mask is None
        for tokens, targets in zip(split.inputs.tolist(), split.targets.tolist()):
            _check_row(task, tokens, targets)


def test_the_filler_comes_from_the_whole_vocabulary_and_the_odd_last_position_is_filler():
    task = tasks.load("mqar", **{**SMALL, "seq_len": 41, "train_size": 400}, value_after_query=False)
    inputs, targets = task.split("train").inputs, task.split("train").targets
    assert (targets[:, -1] == IGNORE_INDEX).all()
    filler = inputs[:, 2 * task.num_pairs:][targets[:, 2 * task.num_pairs:] == IGNORE_INDEX]
    assert set(filler.tolist()) == set(range(task.vocab_size))


def test_the_model_is_always_causal():
    task = tasks.load("mqar", **SMALL)
    assert task.needs_causal_model is True
    config = TrainConfig("mqar", task_options=SMALL, dim=16, heads=2, depth=1)
    assert build_model(config, task).causal is True
    refused = unsupported_reasons(TrainConfig("mqar", mechanism="fnet", task_options=SMALL, dim=16, heads=2), task)
    assert refused and "needs causal attention" in refused[0]


def test_query_slots_follow_the_power_law():
    """Pair 1's slot is the first draw: P(slot g) = w_g / sum(w), w_g = (g + 1) ** (a - 1), to sampling error;
    later pairs draw among the slots left, so queries come early, and uniformly when a = 1."""
    space, pairs, n = 56, 8, 4000
    slots = query_slots(np.random.default_rng(0), n, space, pairs, 0.01)
    assert all(len(set(row)) == pairs for row in slots.tolist()) and slots.min() >= 0 and slots.max() < space
    weights = np.arange(1, space + 1) ** (0.01 - 1.0)
    expected = weights / weights.sum()
    for g in (0, 1, 5, 30):
        share = float((slots[:, 0] == g).mean())
        assert abs(share - expected[g]) < 5 * np.sqrt(expected[g] * (1 - expected[g]) / n) + 1e-3, (g, share)
    early = float((slots < space // 2).mean())
    assert early > 0.7  # about 0.77 here; uniform slots give 0.5
    uniform = query_slots(np.random.default_rng(1), n, space, pairs, 1.0)
    assert abs(float((uniform < space // 2).mean()) - 0.5) < 0.03
    assert abs(float((uniform[:, 0] == 0).mean()) - 1 / space) < 5 * np.sqrt(1 / space / n)


def test_the_tasks_queries_come_early_and_earlier_pairs_tend_to_be_asked_first():
    task = tasks.load("mqar", train_size=2000, validation_size=10, test_size=10, seq_len=128, num_pairs=8,
                      vocab_size=256)
    inputs, targets = task.split("train").inputs.numpy(), task.split("train").targets.numpy()
    context = 2 * task.num_pairs
    rows, positions = np.nonzero(targets != IGNORE_INDEX)
    slots = (positions - context) // 2
    assert float((slots < 28).mean()) > 0.7
    first_key = inputs[:, 0]
    first_asked = inputs[np.arange(len(inputs)), context + 2 * slots.reshape(len(inputs), -1).min(axis=1)]
    # about 0.23 here; 1/8 (0.125, standard error 0.007) if the order of the queries were random
    assert float((first_asked == first_key).mean()) > 1.5 / task.num_pairs


def test_no_sequence_is_in_two_splits_even_when_repeats_are_likely():
    # 288 distinct sequences exist at this size (12 key orders, 12 value orders, 2 query orders): 200 of them
    # drawn at random repeat some, and every repeat is drawn again.
    options = dict(train_size=100, validation_size=50, test_size=50, seq_len=8, num_pairs=2, vocab_size=8)
    task = tasks.load("mqar", **options)
    rows = {name: [tuple(row) for row in task.split(name).inputs.tolist()] for name in tasks.SPLITS}
    assert all(len(set(rows[name])) == len(rows[name]) for name in rows)
    assert sum(len(set(r)) for r in rows.values()) == len(set().union(*map(set, rows.values()))) == 200
    # The held-out splits are drawn first, so they do not change with train_size.
    bigger = tasks.load("mqar", **{**options, "train_size": 150})
    for name in ("validation", "test"):
        assert bigger.split(name).inputs.equal(task.split(name).inputs)
    with pytest.raises(ValueError, match="^mqar: too few distinct sequences.*vocab_size=8"):
        tasks.load("mqar", **{**options, "train_size": 300})


@pytest.mark.parametrize("options, error, message", [
    (dict(num_pairs=0), ValueError, "num_pairs must be an integer >= 1"),
    (dict(num_pairs=2.0), TypeError, "num_pairs must be an integer"),
    (dict(num_pairs=8, seq_len=31), ValueError, "seq_len must be an integer >= 32"),
    (dict(num_pairs=8, seq_len=64, vocab_size=15), ValueError, "vocab_size must be an integer >= 16"),
    (dict(power_a=0.0), ValueError, "power_a must be a number > 0 and <= 1"),
    (dict(power_a=1.5), ValueError, "power_a must be a number > 0 and <= 1"),
    (dict(power_a=float("nan")), ValueError, "power_a must be finite"),
    (dict(power_a="0.01"), TypeError, "power_a must be a number"),
    (dict(value_after_query="yes"), TypeError, "value_after_query must be True or False"),
])
def test_bad_options_are_refused_naming_the_option(options, error, message):
    with pytest.raises(error, match=f"^{message}"):
        tasks.load("mqar", **{**SMALL, **options})


def test_a_bad_option_on_the_command_line_is_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "train", "mqar", "--task-options", "num_pairs=8,seq_len=20",
                           "--output", str(tmp_path / "refused"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "seq_len must be an integer >= 32" in err and not (tmp_path / "refused").exists()


def test_a_small_softmax_model_learns_it(capsys, tmp_path):
    """Chance is 1/16 (the values of a 32-token vocabulary), guessing among the four stored values 1/4."""
    options = "vocab_size=32,seq_len=24,num_pairs=4,train_size=2000,validation_size=100,test_size=200"
    code, _, err = run_cli(capsys, "train", "mqar", "--task-options", options, "--dim", "32", "--heads", "1",
                           "--depth", "2", "--positional", "none", "--token-shift", "--steps", "100", "--lr", "1e-2",
                           "--batch-size", "32", "--eval-interval", "100", "--threads", "1", "--quiet",
                           "--output", str(tmp_path / "run"))
    assert code == 0, err
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["test"]["scored"] == 200 * 4
    assert results["test"]["accuracy"] > 0.6, results["test"]
