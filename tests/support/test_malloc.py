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
from attnzoo._malloc import fix_malloc_threshold, keep_freed_memory
setting = sys.argv[1]
if setting == "keep":
    assert keep_freed_memory()
elif setting == "fixed":
    assert fix_malloc_threshold()
elif setting == "keep, then fixed":
    assert keep_freed_memory() and fix_malloc_threshold()
elements = 16 * 2**20  # 64 MiB of float32: 16384 pages of 4 KiB
for _ in range(3):
    torch.ones(elements)
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


def test_importing_attnzoo_leaves_the_allocator_alone():
    done = subprocess.run([sys.executable, "-c", "import attnzoo, attnzoo.training, attnzoo.bench.measure, "
                           "attnzoo.cli.train; " + _FAULTS_OF_A_SECOND_ALLOCATION.replace("sys.argv[1]", "'x'")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) > 16 * 2**20 * 4 // 4096 // 2
