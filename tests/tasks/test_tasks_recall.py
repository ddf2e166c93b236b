"""recall: every answer recomputed by a plain dict lookup over the pairs in the inputs; the documented token
layout; the queries hold no answers."""

from __future__ import annotations

import pytest

from attnzoo import tasks
from attnzoo.tasks import IGNORE_INDEX


@pytest.fixture(scope="module")
def task():
    return tasks.load("recall", train_size=40, validation_size=10, test_size=10, num_pairs=7, num_queries=5,
                      num_keys=10, num_values=6, seed=9)


def test_every_answer_by_dict_lookup(task):
    pairs = 2 * task.num_pairs
    for split_name in tasks.SPLITS:
        split = task.split(split_name)
        for tokens, targets in zip(split.inputs.tolist(), split.targets.tolist()):
            stored = dict(zip(tokens[0:pairs:2], tokens[1:pairs:2]))
            assert len(stored) == task.num_pairs  # keys distinct
            assert all(0 <= k < task.num_keys for k in stored)
            assert all(task.num_keys <= v < task.vocab_size for v in stored.values())
            queries = tokens[pairs:]
            assert len(queries) == len(set(queries)) == task.num_queries and set(queries) <= set(stored)
            assert targets[:pairs] == [IGNORE_INDEX] * pairs
            assert targets[pairs:] == [stored[q] - task.num_keys for q in queries]


def test_layout(task):
    assert task.seq_len == 2 * 7 + 5 and task.vocab_size == 16 and task.num_classes == 6
    assert task.pad_id is None and task.split("train").padding_mask is None
    # All values and keys get used: nothing in the layout is dead.
    tokens = set(task.split("train").inputs.flatten().tolist())
    assert tokens == set(range(task.vocab_size))


def test_num_queries_defaults_to_every_pair():
    task = tasks.load("recall", train_size=5, validation_size=5, test_size=5, num_pairs=4, num_keys=8)
    assert task.num_queries == 4 and task.options()["num_queries"] == 4 and task.seq_len == 12
    assert tasks.task_options("recall")["num_queries"] is None


def test_bad_counts_name_the_option():
    with pytest.raises(ValueError, match="^num_queries must be an integer >= 1 and <= 4"):
        tasks.load("recall", num_pairs=4, num_queries=5)
    with pytest.raises(ValueError, match="^num_keys must be an integer >= 16"):
        tasks.load("recall", num_pairs=16, num_keys=15)
    with pytest.raises(ValueError, match="^num_values must be"):
        tasks.load("recall", num_values=1)
    with pytest.raises(TypeError, match="^num_queries must be an integer or None"):
        tasks.load("recall", num_queries=2.5)
