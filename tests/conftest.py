"""Shared fixtures, and the import path of the test suite's own modules.

The tests live in one folder per area (mechanisms, conformance, models, training, dropin, packing, tasks,
experiments, support). The modules several areas import (``decoding_helpers``, ``tensor_records``,
``fla_reference``, ``data_parallel_runs``) live in ``support/``, and the conformance package is imported as
``conformance``: both folders are put on the import path here, once, for every area.
"""

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
for folder in (TESTS, TESTS / "support"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Tiny models train fastest on one thread (and do not fight other processes for the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
