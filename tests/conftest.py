"""Shared fixtures, and the import path of the test suite's own modules.

The tests live in one folder per area (mechanisms, conformance, models, training, dropin, packing, tasks,
experiments, support). The modules several areas import (``decoding_helpers``, ``tensor_records``,
``fla_reference``, ``data_parallel_runs``) live in ``support/``, and the conformance package is imported as
``conformance``: both folders are put on the import path here, once, for every area.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
for folder in (TESTS, TESTS / "support"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


# Under pytest-xdist (``./run.sh test`` runs one worker per core), each worker takes its share of the cores, so
# that the workers' torch threads do not outnumber them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


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
