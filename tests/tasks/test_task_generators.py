"""The task generators' count and size arguments are checked as pathfinder's are: one clear error naming the
argument, before anything is drawn, the same error the task gives for the same option."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attnzoo import tasks
from attnzoo.tasks.byte_lm import windows
from attnzoo.tasks.listops import generate_listops
from attnzoo.tasks.packing import pack_documents
from attnzoo.tasks.recall import generate_recall

LISTOPS = dict(min_length=4, max_length=16, max_depth=3, max_args=3)
RECALL = dict(num_pairs=3, num_queries=2, num_keys=8, num_values=5)


@pytest.mark.parametrize("argument, value, error, message", [
    ("count", 0, ValueError, r"^count must be an integer >= 1, got 0$"),
    ("count", -2, ValueError, r"^count must be an integer >= 1, got -2$"),
    ("count", 2.0, TypeError, r"^count must be an integer, got 2.0 \(float\)$"),
    ("min_length", -1, ValueError, r"^min_length must be an integer >= 0"),
    ("max_length", 5, ValueError, r"^max_length must be an integer >= 6"),
    ("max_depth", 0, ValueError, r"^max_depth must be an integer >= 1"),
    ("max_args", 1, ValueError, r"^max_args must be an integer >= 2"),
    ("rng", 0, TypeError, r"^rng must be a random.Random .*got 0 \(int\)"),
])
def test_generate_listops_names_a_bad_argument(argument, value, error, message):
    arguments = dict(LISTOPS, count=4, rng=random.Random(0))
    arguments[argument] = value
    with pytest.raises(error, match=message):
        generate_listops(arguments.pop("count"), **arguments)


@pytest.mark.parametrize("argument, value, error, message", [
    ("count", 0, ValueError, r"^count must be an integer >= 1, got 0$"),
    ("count", -1, ValueError, r"^count must be an integer >= 1, got -1$"),
    ("num_pairs", 0, ValueError, r"^num_pairs must be an integer >= 1"),
    ("num_queries", 4, ValueError, r"^num_queries must be an integer >= 1 and <= 3"),
    ("num_keys", 2, ValueError, r"^num_keys must be an integer >= 3"),
    ("num_values", 1, ValueError, r"^num_values must be an integer >= 2"),
    ("rng", 0, TypeError, r"^rng must be a numpy.random.Generator .*got 0 \(int\)"),
])
def test_generate_recall_names_a_bad_argument(argument, value, error, message):
    arguments = dict(RECALL, count=4, rng=np.random.default_rng(0))
    arguments[argument] = value
    with pytest.raises(error, match=message):
        generate_recall(arguments.pop("count"), **arguments)


def test_the_generators_still_generate():
    expressions, values, depths = generate_listops(3, rng=random.Random(0), **LISTOPS)
    assert len(expressions) == len(values) == len(depths) == 3
    split = generate_recall(3, rng=np.random.default_rng(0), **RECALL)
    assert split.inputs.shape == (3, 2 * 3 + 2)


@pytest.mark.parametrize("make", [
    lambda value: tasks.load("listops", max_args=value),
    lambda value: generate_listops(2, rng=random.Random(0), **{**LISTOPS, "max_args": value}),
])
def test_listops_generator_and_task_refuse_alike(make):
    with pytest.raises(ValueError, match=r"^max_args must be an integer >= 2, got 1$"):
        make(1)


@pytest.mark.parametrize("make", [
    lambda value: tasks.load("recall", num_pairs=4, num_keys=value),
    lambda value: generate_recall(2, rng=np.random.default_rng(0), **{**RECALL, "num_pairs": 4, "num_queries": 4,
                                                                      "num_keys": value}),
])
def test_recall_generator_and_task_refuse_alike(make):
    with pytest.raises(ValueError, match=r"^num_keys must be an integer >= 4, got 3$"):
        make(3)


@pytest.mark.parametrize("seq_len", [0, -1])
def test_windows_and_packing_name_seq_len(seq_len):
    with pytest.raises(ValueError, match=rf"^seq_len must be an integer >= 1, got {seq_len}$"):
        windows(b"abcdefgh", seq_len)
    with pytest.raises(ValueError, match=rf"^seq_len must be an integer >= 1, got {seq_len}$"):
        pack_documents(torch.arange(8), [3, 5], seq_len)
