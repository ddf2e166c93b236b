"""The allocator settings of :mod:`attnzoo._malloc`, checked by the page faults a freed-and-reallocated tensor
costs. Each case runs in a fresh interpreter: the settings are process-wide."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="the settings are glibc's mallopt"
)

# Allocates and frees a 64 MiB tensor a few times (as training steps do; the first frees may leave small blocks
# that split the freed region), then counts the minor page faults of doing it once more.
_FAULTS_OF_A_SECOND_ALLOCATION = """
import resource, sys, torch
from attnzoo._malloc import fix_malloc_threshold, keep_freed_memory, release_free_memory
setting = sys.argv[1]
if setting == "keep, then released":
    assert keep_freed_memory()
if setting == "keep":
    assert keep_freed_memory()
elif setting == "fixed":
    assert fix_malloc_threshold()
elif setting == "keep, then fixed":
    assert keep_freed_memory() and fix_malloc_threshold()
elements = 16 * 2**20  # 64 MiB of float32: 16384 pages of 4 KiB
for _ in range(3):
    torch.ones(elements)
if setting == "keep, then released":  # the heap's freed pages given back before the measured allocation
    assert keep_freed_memory() and release_free_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(elements)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(setting: str) -> int:
    done = subprocess.run([sys.executable, "-c", _FAULTS_OF_A_SECOND_ALLOCATION, setting],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_keep_freed_memory_reuses_the_pages_of_a_freed_tensor():
    pages = 16 * 2**20 * 4 // 4096
    assert _faults("default") > pages // 2  # glibc maps a block this large afresh: every page faults again
    assert _faults("fixed") > pages // 2
    assert _faults("keep, then fixed") > pages // 2  # the memory benchmarks' setting undoes training's
    assert _faults("keep") < pages // 20
    # A memory measurement after training in the same process: the pages kept are released, so they count again.
    assert _faults("keep, then released") > pages // 2


def test_importing_attnzoo_leaves_the_allocator_alone():
    done = subprocess.run([sys.executable, "-c", "import attnzoo, attnzoo.training, attnzoo.bench.measure, "
                           "attnzoo.cli.train; " + _FAULTS_OF_A_SECOND_ALLOCATION.replace("sys.argv[1]", "'x'")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) > 16 * 2**20 * 4 // 4096 // 2


_PEAK_AFTER_TRAINING = """
import torch
from attnzoo._malloc import fix_malloc_threshold, keep_freed_memory
from attnzoo.bench.measure import PeakMemory
assert keep_freed_memory()
kept = []
for mib in (50, 12, 30, 75):  # training's tensors, freed between small ones that stay: free chunks in the heap
    block = torch.ones(mib * 2**18)
    kept.append(torch.ones(2**10))
    del block
assert fix_malloc_threshold()
with PeakMemory("cpu") as peak:
    scratch = torch.ones(32 * 2**18)  # 32 MiB, which a free chunk of the heap could hold
    del scratch
print(peak.peak_bytes)
"""


def test_peak_memory_counts_a_block_served_from_memory_training_kept():
    """The memory benchmarks' peak after training ran in the same process: glibc serves the block from a free
    chunk of the heap, whose pages were resident; released before the measurement, they count."""
    done = subprocess.run([sys.executable, "-c", _PEAK_AFTER_TRAINING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert 30 * 2**20 <= int(done.stdout.strip()) < 48 * 2**20
