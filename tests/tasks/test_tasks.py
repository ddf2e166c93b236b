"""The task API, for every registered task at small sizes: shapes and dtypes per kind, token ids in the
vocabulary, determinism under a seed (and independence from the global RNGs), options that rebuild the same
data, baselines recomputed independently, and clear errors for bad names and options.

Each task's own data (labels recomputed by independent evaluators) is checked in tests/tasks/test_tasks_<name>.py."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from attnzoo import tasks
from attnzoo.tasks import IGNORE_INDEX, Split, Task

SMALL = {
    "bytes": dict(train_bytes=6000, validation_bytes=1500, test_bytes=1500, seq_len=48, max_file_bytes=2000),
    "listops": dict(train_size=40, validation_size=12, test_size=12, min_length=6, max_length=40),
    "pathfinder": dict(train_size=24, validation_size=8, test_size=8, size=16, contour_length=4,
                       segment_length=2, num_distractors=2),
    "recall": dict(train_size=30, validation_size=8, test_size=8, num_pairs=6, num_keys=12, num_values=8),
    "mqar": dict(train_size=30, validation_size=8, test_size=8, seq_len=32, num_pairs=6, vocab_size=24),
    "copy": dict(train_size=30, validation_size=8, test_size=8, length=7, num_symbols=5),
    "reverse": dict(train_size=30, validation_size=8, test_size=8, length=7, num_symbols=5),
    "sort": dict(train_size=30, validation_size=8, test_size=8, length=7, num_symbols=5),
    "copy-names": dict(train_size=30, validation_size=8, test_size=8, num_names=20, num_numbers=50),
    "g2p": dict(train_size=40, validation_size=10, test_size=10),
}
"""Options that build each task in well under a second."""

EXPECTED = {  # name: (kind, metric, needs_causal)
    "bytes": ("lm", "bits_per_byte", True),
    "listops": ("classify", "accuracy", False),
    "pathfinder": ("classify", "accuracy", False),
    "recall": ("tag", "accuracy", False),
    "mqar": ("tag", "accuracy", False),
    "copy": ("seq2seq", "accuracy", False),
    "reverse": ("seq2seq", "accuracy", False),
    "sort": ("seq2seq", "accuracy", False),
    "copy-names": ("seq2seq", "accuracy", False),
    "g2p": ("seq2seq", "accuracy", False),
}

_BUILT = {}


def small(name: str, **changes) -> Task:
    """The task at its SMALL options (built once per set of options)."""
    options = {**SMALL[name], **changes}
    key = (name, tuple(sorted(options.items())))
    if key not in _BUILT:
        _BUILT[key] = tasks.load(name, **options)
    return _BUILT[key]


def all_tensors(task: Task):
    for split_name in tasks.SPLITS:
        split = task.split(split_name)
        yield from (split.inputs, split.targets, split.padding_mask)


def same_data(a: Task, b: Task) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and x.shape == y.shape and torch.equal(x, y))
        for x, y in zip(all_tensors(a), all_tensors(b))
    )


def test_available_lists_the_tasks_sorted():
    assert tasks.available() == sorted(EXPECTED) == ["bytes", "copy", "copy-names", "g2p", "listops", "mqar",
                                                     "pathfinder", "recall", "reverse", "sort"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_class_attributes(name):
    cls = tasks.task_class(name)
    assert cls.name == name
    assert (cls.kind, cls.metric, cls.needs_causal) == EXPECTED[name]
    assert isinstance(cls.summary, str) and cls.summary and "\n" not in cls.summary


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shapes_dtypes_and_vocabulary(name):
    task = small(name)
    assert all(isinstance(getattr(task, a), int) for a in ("vocab_size", "seq_len", "num_classes"))
    assert task.pad_id is None or (isinstance(task.pad_id, int) and 0 <= task.pad_id < task.vocab_size)
    for split_name in tasks.SPLITS:
        split = task.split(split_name)
        assert isinstance(split, Split)
        n = len(split)
        assert n > 0 and split.inputs.shape == (n, task.seq_len) and split.inputs.dtype == torch.int64
        assert int(split.inputs.min()) >= 0 and int(split.inputs.max()) < task.vocab_size
        assert split.targets.dtype == torch.int64
        if task.pad_id is None:
            assert split.padding_mask is None
        else:
            assert split.padding_mask.dtype == torch.bool and split.padding_mask.shape == (n, task.seq_len)
            # The pad token is where the mask says, and nowhere else.
            assert torch.equal(split.inputs == task.pad_id, split.padding_mask)
        if task.kind == "classify":
            assert split.targets.shape == (n,)
            assert int(split.targets.min()) >= 0 and int(split.targets.max()) < task.num_classes
        elif task.kind == "tag":
            assert split.targets.shape == (n, task.seq_len)
            scored = split.targets != IGNORE_INDEX
            assert scored.any(dim=1).all()
            assert int(split.targets[scored].min()) >= 0 and int(split.targets[scored].max()) < task.num_classes
            if split.padding_mask is not None:
                assert not (scored & split.padding_mask).any()
        elif task.kind == "seq2seq":
            # Targets: tokens, one EOS, then nothing scored; the decoder reads BOS and the targets shifted right.
            assert split.targets.shape == split.decoder_inputs.shape == (n, task.target_len)
            scored = split.targets != IGNORE_INDEX
            assert torch.equal((split.targets == task.eos_id).sum(dim=1), torch.ones(n, dtype=torch.int64))
            assert torch.equal(scored.sum(dim=1) - 1, (split.targets == task.eos_id).int().argmax(dim=1))
            assert (split.decoder_inputs[:, 0] == task.bos_id).all()
            tokens = scored & (split.targets != task.eos_id)
            shifted = torch.where(tokens[:, :-1], split.targets[:, :-1], task.pad_id)
            assert torch.equal(split.decoder_inputs[:, 1:], shifted)
            assert int(split.targets[scored].min()) >= 0 and int(split.targets[scored].max()) < task.num_classes
        else:
            assert task.num_classes == task.vocab_size
            assert split.targets.shape == (n, task.seq_len)
            torch.testing.assert_close(split.targets[:, :-1], split.inputs[:, 1:], rtol=0, atol=0)
            assert int(split.targets.min()) >= 0 and int(split.targets.max()) < task.vocab_size


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_same_seed_same_data_other_seed_other_data_whatever_the_global_rngs(name):
    first = small(name)
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    again = tasks.load(name, **SMALL[name])
    assert same_data(first, again)
    other = tasks.load(name, **{**SMALL[name], "seed": 1})
    for split_name in tasks.SPLITS:
        a, b = first.split(split_name).inputs, other.split(split_name).inputs
        assert a.shape != b.shape or not torch.equal(a, b), split_name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_options_rebuild_the_same_data(name):
    task = small(name, seed=3)
    options = task.options()
    assert list(options) == list(tasks.task_options(name))
    assert options["seed"] == 3
    assert json.loads(json.dumps(options)) == options  # plain JSON values
    assert same_data(tasks.load(name, **options), task)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_task_options_are_the_signature_defaults(name):
    parameters = list(inspect.signature(tasks.task_class(name).__init__).parameters.values())[1:]
    assert tasks.task_options(name) == {p.name: p.default for p in parameters}
    assert tasks.task_options(name)["seed"] == 0
    assert set(SMALL[name]) <= set(tasks.task_options(name))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_baseline_matches_an_independent_count(name):
    task = small(name)
    test = task.split("test")
    if task.kind == "lm":
        counts = Counter(test.targets.flatten().tolist())
        total = sum(counts.values())
        entropy = -sum(c / total * math.log2(c / total) for c in counts.values())
        assert task.baseline() == pytest.approx({"bits_per_byte": entropy}, rel=1e-12)
        assert 0 < entropy <= 8
    else:
        answers = [a for a in test.targets.flatten().tolist() if a != IGNORE_INDEX]
        share = Counter(answers).most_common(1)[0][1] / len(answers)
        assert task.baseline() == pytest.approx({"accuracy": share}, rel=1e-12)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_describe_names_the_task_and_sizes(name):
    task = small(name)
    text = task.describe()
    assert text.startswith(name) and len(text.splitlines()) >= 4
    for split_name in tasks.SPLITS:
        assert f"{split_name}: {len(task.split(split_name))} sequences" in text
    assert "baseline" in text
    assert repr(task).startswith(type(task).__name__ + "(seed=")


# -- errors ----------------------------------------------------------------------------------------------------
def test_unknown_task_lists_the_valid_ones():
    for bad in ("listop", None, 3):
        with pytest.raises(ValueError, match="unknown task.*bytes, copy, copy-names, g2p, listops, mqar, "
                                             "pathfinder, recall, reverse, sort"):
            tasks.load(bad)
        with pytest.raises(ValueError, match="valid tasks"):
            tasks.task_class(bad)
        with pytest.raises(ValueError, match="valid tasks"):
            tasks.task_options(bad)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_unknown_option_is_named_with_the_valid_ones(name):
    with pytest.raises(TypeError, match=r"unknown option\(s\) sead; valid options: seed, ") as error:
        tasks.load(name, sead=1)
    for option in tasks.task_options(name):
        assert option in str(error.value)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_unknown_split_lists_the_valid_ones(name):
    for bad in ("valid", "Train", 0):
        with pytest.raises(ValueError, match="unknown split.*train, validation, test"):
            small(name).split(bad)


SIZE_OPTIONS = {
    "bytes": ["train_bytes", "validation_bytes", "test_bytes", "seq_len", "max_file_bytes"],
    "listops": ["train_size", "validation_size", "test_size", "max_depth"],
    "pathfinder": ["train_size", "validation_size", "test_size", "contour_length", "segment_length",
                   "distractor_length"],
    "recall": ["train_size", "validation_size", "test_size", "num_pairs"],
    "mqar": ["train_size", "validation_size", "test_size", "seq_len", "num_pairs", "vocab_size"],
    "copy": ["train_size", "validation_size", "test_size", "length", "min_length", "num_symbols"],
    "reverse": ["train_size", "validation_size", "test_size", "length", "num_symbols"],
    "sort": ["train_size", "validation_size", "test_size", "length", "num_symbols"],
    "copy-names": ["train_size", "validation_size", "test_size", "num_names", "num_numbers"],
    "g2p": ["validation_size", "test_size", "max_length"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_numbers_are_refused_naming_the_option(name):
    for option in ["seed"] + SIZE_OPTIONS[name]:
        for value in (-1, 0) if option != "seed" else (-1,):
            with pytest.raises(ValueError, match=f"^{option} must be"):
                tasks.load(name, **{**SMALL[name], option: value})
        for value in (2.0, "8", True, None):
            with pytest.raises(TypeError, match=f"^{option} must be"):
                tasks.load(name, **{**SMALL[name], option: value})


def test_yes_no_options_must_be_bools():
    for value in ("False", 0, 1, None):
        with pytest.raises(TypeError, match="^include_tests must be True or False"):
            tasks.load("bytes", **SMALL["bytes"], include_tests=value)


def test_every_task_is_built_from_keyword_only_annotated_defaulted_options():
    """What task_options, load and the train command's flags rely on; register refuses anything else."""
    for name in tasks.available():
        parameters = list(inspect.signature(tasks.task_class(name).__init__).parameters.values())[1:]
        assert parameters and parameters[0].name == "seed"
        for p in parameters:
            assert p.kind is p.KEYWORD_ONLY and p.default is not p.empty and p.annotation is not p.empty, p

    class Loose(Task):
        name, kind, metric, needs_causal, summary = "loose", "classify", "accuracy", False, "x"

        def __init__(self, size=3, *, seed: int = 0):  # positional, unannotated
            pass

    with pytest.raises(ValueError, match="keyword-only, annotated and defaulted.*size"):
        tasks.register(Loose)

    class Causal(Task):
        name, kind, metric, needs_causal, summary = "causal", "classify", "accuracy", True, "x"

        def __init__(self, *, seed: int = 0):
            pass

    with pytest.raises(ValueError, match="needs_causal"):
        tasks.register(Causal)
    assert "loose" not in tasks.available() and "causal" not in tasks.available()


def test_split_checks_its_tensors_and_is_frozen():
    inputs = torch.zeros(3, 5, dtype=torch.int64)
    split = Split(inputs, torch.zeros(3, dtype=torch.int64), None)
    assert len(split) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        split.inputs = inputs
    with pytest.raises(TypeError, match="inputs must be a 2-D int64"):
        Split(inputs.int(), torch.zeros(3, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="targets must have shape"):
        Split(inputs, torch.zeros(4, dtype=torch.int64), None)
    with pytest.raises(TypeError, match="padding_mask must be None or a bool"):
        Split(inputs, torch.zeros(3, dtype=torch.int64), torch.zeros(3, 5, dtype=torch.int64))
    with pytest.raises(NotImplementedError):
        Task()
