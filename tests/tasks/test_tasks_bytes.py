"""bytes: every split's windows are the leading bytes of its own files, read back here from disk; no file in two
splits; only standard-library sources outside site-packages (and the test suites unless asked for)."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from attnzoo import tasks
from attnzoo.tasks.byte_lm import source_files

OPTIONS = dict(train_bytes=20000, validation_bytes=3000, test_bytes=3000, seq_len=100, max_file_bytes=4000)
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def task():
    return tasks.load("bytes", **OPTIONS, seed=5)


def stream(split):
    """A split's bytes, windows joined back: each window is its inputs and its last target."""
    windows = torch.cat([split.inputs, split.targets[:, -1:]], dim=1)
    return bytes(windows.flatten().to(torch.uint8).tolist())


def test_windows_are_the_leading_bytes_of_the_split_files(task):
    budgets = {"train": OPTIONS["train_bytes"], "validation": OPTIONS["validation_bytes"],
               "test": OPTIONS["test_bytes"]}
    for split_name in tasks.SPLITS:
        split = task.split(split_name)
        files = task.files[split_name]
        pieces = [(STDLIB / name).read_bytes()[: OPTIONS["max_file_bytes"]] for name in files]
        joined = b"".join(pieces)
        # Whole files (up to max_file_bytes) until the budget is reached, the last one cut to fill it exactly.
        assert len(joined) - len(pieces[-1]) < budgets[split_name] <= len(joined)
        data = stream(split)
        assert joined.startswith(data)
        assert len(split) == budgets[split_name] // (OPTIONS["seq_len"] + 1)
        assert len(data) == len(split) * (OPTIONS["seq_len"] + 1)
        assert split.inputs.shape[1] == split.targets.shape[1] == task.seq_len == OPTIONS["seq_len"]


def test_no_file_in_two_splits_and_none_from_tests_or_site_packages(task):
    seen = [name for split_name in tasks.SPLITS for name in task.files[split_name]]
    assert len(seen) == len(set(seen)) >= 6
    for name in seen:
        parts = Path(name).parts
        assert name.endswith(".py") and (STDLIB / name).is_file()
        assert not {"site-packages", "test", "tests", "idle_test"} & set(parts), name


def test_the_file_list_and_the_shuffle():
    listed = source_files(STDLIB)
    assert listed == sorted(listed) and "os.py" in listed and "json/decoder.py" in listed
    assert not any(name.startswith("test/") for name in listed)
    with_tests = source_files(STDLIB, include_tests=True)
    assert set(listed) < set(with_tests) and any(name.startswith("test/") for name in with_tests)
    assert not any("site-packages" in name for name in with_tests)
    a = tasks.load("bytes", **OPTIONS, seed=0).files
    b = tasks.load("bytes", **OPTIONS, seed=1).files
    assert a != b and a == tasks.load("bytes", **OPTIONS, seed=0).files


def test_describe_names_the_directory_and_the_python_version(task):
    text = task.describe()
    assert str(STDLIB) in text and sys.version.split()[0] in text
    assert task.pad_id is None and task.needs_causal and task.num_classes == task.vocab_size == 256


def test_budgets_are_checked_naming_the_option():
    with pytest.raises(ValueError, match="^test_bytes must be an integer >= 101"):
        tasks.load("bytes", **{**OPTIONS, "test_bytes": 100})
    with pytest.raises(ValueError, match="ran out before the train split held train_bytes=1000000000"):
        tasks.load("bytes", **{**OPTIONS, "train_bytes": 10**9})


def test_compression_baselines_measure_what_they_name():
    import gzip
    import random

    from attnzoo.tasks.byte_lm import COMPRESSORS, compression_baselines, order0_entropy

    rng = random.Random(0)
    noise = bytes(rng.randrange(256) for _ in range(4096))
    text = b"def f(x):\n    return x + 1\n" * 200
    assert abs(order0_entropy(bytes(range(256)) * 4) - 8.0) < 1e-12
    assert order0_entropy(b"aaaa") == 0.0
    figures = compression_baselines(text, context=noise)
    assert figures["gzip -9"] == pytest.approx(len(gzip.compress(text, 9, mtime=0)) * 8 / len(text), rel=1e-12)
    for name in COMPRESSORS:
        assert 0 < figures[name] < 0.5  # repetitive text compresses well
        assert f"{name}, after context" in figures
    # random bytes do not compress: every compressor pays at least 8 bits per byte
    assert all(compression_baselines(noise)[name] >= 8.0 for name in COMPRESSORS)
    # text seen in the context costs less the second time
    assert compression_baselines(text[:1000], context=text)["xz -9, after context"] < \
        compression_baselines(text[:1000])["xz -9"]
    with pytest.raises(ValueError, match="at least one byte"):
        compression_baselines(b"")
