"""Modules that moved into subpackages keep their old import paths, giving the very same objects."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import attnzoo
import attnzoo.dropin.hf
import attnzoo.dropin.swap
import attnzoo.parallel.sequence

MOVED = {
    "attnzoo.swap": attnzoo.dropin.swap,
    "attnzoo.hf": attnzoo.dropin.hf,
    "attnzoo.distributed": attnzoo.parallel.sequence,
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_module_of_its_new_home(old):
    assert importlib.import_module(old) is MOVED[old]
    assert getattr(attnzoo, old.split(".")[1]) is MOVED[old]


def test_the_old_import_lines_give_the_same_objects():
    from attnzoo.distributed import assert_replicated, sequence_parallel_attention
    from attnzoo.hf import HFSwapReport, use_attnzoo
    from attnzoo.swap import SwappedAttention, swap_attention, translate_masks

    assert sequence_parallel_attention is attnzoo.parallel.sequence_parallel_attention
    assert assert_replicated is attnzoo.parallel.assert_replicated
    assert (use_attnzoo, HFSwapReport) == (attnzoo.dropin.use_attnzoo, attnzoo.dropin.HFSwapReport)
    assert swap_attention is attnzoo.swap_attention is attnzoo.dropin.swap_attention
    assert SwappedAttention is attnzoo.SwappedAttention
    assert translate_masks is attnzoo.dropin.translate_masks


def test_an_old_path_works_in_a_fresh_interpreter():
    """``import attnzoo.swap`` as the first import of attnzoo, then the names read through the package."""
    code = ("import attnzoo.swap, attnzoo.hf, attnzoo.distributed\n"
            "assert attnzoo.swap.swap_attention is attnzoo.dropin.swap_attention\n"
            "assert attnzoo.hf.use_attnzoo is attnzoo.dropin.hf.use_attnzoo\n"
            "assert attnzoo.distributed.sequence_parallel_reasons is attnzoo.parallel.sequence_parallel_reasons\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_file_is_left_at_an_old_path():
    """The aliases are the only old paths: a second copy of a module would drift from the one in use."""
    package = Path(attnzoo.__file__).parent
    for old in MOVED:
        name = old.split(".")[1]
        assert not (package / f"{name}.py").exists() and not (package / name).is_dir(), old
