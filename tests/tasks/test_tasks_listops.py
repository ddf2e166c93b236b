"""ListOps: every label recomputed by a parser of the token ids written here, independently of the generator's
trees; length and depth bounds; no duplicate expressions within or across splits; the early abandonment of
long trees loses no tree that would have been accepted."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from attnzoo import tasks
from attnzoo.tasks.listops import sample_expression

# The documented layout: pad 0, CLS 1, [MIN 2, [MAX 3, [MED 4, [SM 5, ] 6, digits 0-9 at 7-16.
PAD, CLS, CLOSE = 0, 1, 6
OPERATIONS = {
    2: min,
    3: max,
    4: lambda args: int(statistics.median(args)),  # LRA: int(np.median(...)), truncating x.5
    5: lambda args: sum(args) % 10,
}


def evaluate(tokens):
    """(value, depth) of one expression given as token ids, by recursive descent; depth counts the root as 1.
    Raises ValueError on anything that is not exactly one well-formed expression."""

    def parse(position):
        token = tokens[position]
        if 7 <= token <= 16:
            return token - 7, 1, position + 1
        if token not in OPERATIONS:
            raise ValueError(f"unexpected token {token} at {position}")
        args, depth, position = [], 0, position + 1
        while tokens[position] != CLOSE:
            value, child_depth, position = parse(position)
            args.append(value)
            depth = max(depth, child_depth)
        if len(args) < 2:
            raise ValueError(f"operator with {len(args)} argument(s)")
        return OPERATIONS[token](args), depth + 1, position + 1

    value, depth, end = parse(0)
    if end != len(tokens):
        raise ValueError(f"{len(tokens) - end} token(s) after the expression")
    return value, depth


def test_the_evaluator_on_hand_written_expressions():
    MAX, MIN, MED, SM = 3, 2, 4, 5
    d = lambda x: 7 + x  # noqa: E731
    assert evaluate([MAX, d(2), d(9), MIN, d(4), d(7), CLOSE, d(0), CLOSE]) == (9, 3)
    assert evaluate([MED, d(1), d(2), d(3), d(4), CLOSE]) == (2, 2)  # median 2.5, truncated
    assert evaluate([MED, d(1), d(9), d(3), CLOSE]) == (3, 2)
    assert evaluate([SM, d(9), d(9), d(5), CLOSE]) == (3, 2)
    assert evaluate([d(6)]) == (6, 1)
    for malformed in ([MAX, d(1), d(2)], [MAX, d(1), CLOSE], [d(1), d(2)], [CLOSE]):
        with pytest.raises((ValueError, IndexError)):
            evaluate(malformed)


@pytest.fixture(scope="module")
def task():
    return tasks.load("listops", train_size=150, validation_size=40, test_size=40, min_length=10,
                      max_length=60, max_depth=5, max_args=6, seed=4)


def expressions(split):
    """Each row's expression (CLS and padding removed), checking the layout on the way."""
    rows = []
    for tokens, padded in zip(split.inputs.tolist(), split.padding_mask.tolist()):
        length = padded.index(True) if True in padded else len(padded)
        assert all(padded[length:]) and not any(padded[:length])  # padding only at the end
        assert tokens[0] == CLS and PAD not in tokens[1:length] and CLS not in tokens[1:length]
        rows.append(tokens[1:length])
    return rows


def test_every_label_depth_and_length(task):
    depths = []
    for split_name in tasks.SPLITS:
        split = task.split(split_name)
        for expression, label in zip(expressions(split), split.targets.tolist()):
            value, depth = evaluate(expression)
            assert value == label
            assert task.min_length < len(expression) < task.max_length
            assert depth <= task.max_depth
            depths.append(depth)
    assert depths == task.depths.tolist()
    assert max(depths) == task.max_depth  # the bound is reached, not just respected
    assert task.seq_len == task.max_length


def test_no_duplicates_within_or_across_splits(task):
    seen = [tuple(e) for split_name in tasks.SPLITS for e in expressions(task.split(split_name))]
    assert len(seen) == len(set(seen)) == 230


def test_the_longest_inputs_fill_seq_len_exactly():
    """CLS + an expression of max_length - 1 tokens fills seq_len = max_length with no padding."""
    task = tasks.load("listops", train_size=300, validation_size=1, test_size=1, min_length=6, max_length=12)
    lengths = (~task.split("train").padding_mask).sum(dim=1)
    assert int(lengths.max()) == task.seq_len == 12 and int(lengths.min()) == 1 + 7


def test_abandoned_trees_would_all_have_been_too_long():
    """sample_expression stops growing a tree once it is sure to be too long. Grown in full from the same
    random state, every abandoned tree is indeed at least max_length tokens, and every tree kept is the
    same: so the accepted trees are distributed as LRA's (which grows every tree in full)."""
    for max_length in (12, 20):  # short, so that trees ending just under the limit are common
        rng = random.Random(7)
        abandoned = kept = 0
        for _ in range(2000):
            state = rng.getstate()
            limited = sample_expression(rng, 10, 10, max_length)
            full_rng = random.Random()
            full_rng.setstate(state)
            full = sample_expression(full_rng, 10, 10, 10**9)
            if limited is None:
                assert len(full[0]) >= max_length
                abandoned += 1
            else:
                assert limited == full
                kept += 1
        assert abandoned > 100 and kept > 100


def test_labels_are_skewed_and_the_baseline_is_the_majority_share():
    task = tasks.load("listops", train_size=10, validation_size=10, test_size=400, min_length=20, max_length=100)
    counts = torch.bincount(task.split("test").targets, minlength=10)
    assert task.baseline()["accuracy"] == pytest.approx(float(counts.max()) / 400)
    assert float(counts.max()) / 400 > 0.11  # MIN/MAX pull values towards 0 and 9


def test_bad_length_options_name_the_option():
    with pytest.raises(ValueError, match="^max_length must be an integer >= 34"):
        tasks.load("listops", min_length=32, max_length=32)
    with pytest.raises(ValueError, match="^max_length must be"):
        tasks.load("listops", min_length=40, max_length=20)
    with pytest.raises(ValueError, match="^min_length must be"):
        tasks.load("listops", min_length=-1)
    with pytest.raises(ValueError, match="^max_args must be an integer >= 2"):
        tasks.load("listops", max_args=1)
    with pytest.raises(ValueError, match="found only 10 distinct expressions of the 30 wanted"):
        # 0 < L < 2: single digits only, of which there are ten.
        tasks.load("listops", train_size=10, validation_size=10, test_size=10, min_length=0, max_length=2)
