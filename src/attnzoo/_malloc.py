"""Process-wide settings of glibc's allocator, for the two jobs that want the opposite of its default.

glibc serves a block above its mmap threshold (at most 32 MiB, raised as large blocks are freed) with a fresh
``mmap`` and unmaps it when freed. Training allocates and frees tensors of that size every step (FAVOR+
features, LSH chunks, FLASH's squared-ReLU scores), and every fresh mapping is page-faulted and zeroed by the
kernel again: on a CPU with little memory bandwidth that costs more than the arithmetic on it (an elementwise
product of an 84 MB tensor: 80 ms into a new tensor, 10 ms into a reused one).

- :func:`keep_freed_memory`, for training and timing: every block comes from the heap and freed memory stays
  there for the next step, so nothing is faulted in twice.
- :func:`fix_malloc_threshold`, for memory measurements: every block of a few pages gets its own mapping, so
  the resident size follows live tensors to the page; :func:`release_free_memory` before each measurement.

Both are process-wide and change what follows, so only commands call them (``attnzoo train`` the first, the
memory benchmarks the second); importing attnzoo changes nothing. Elsewhere than glibc they do nothing and
return False.
"""

from __future__ import annotations

import ctypes

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1  # mallopt takes a C int
_DEFAULT_MMAP_MAX = 65536  # glibc's default: mmap allowed again after keep_freed_memory switched it off
_DEFAULT_TRIM_THRESHOLD = 128 * 1024  # glibc's default: free memory at the heap's top given back again


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _mallopt(*settings: tuple) -> bool:
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return all([bool(mallopt(parameter, value)) for parameter, value in settings])


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap (no per-block mmap) and never give freed memory back to the system
    (trim only above 2 GiB free at the heap's top), so a training step reuses the pages of the one before.

    The price: the resident size stays at its peak after tensors are freed. Returns False where glibc's
    ``mallopt`` is unavailable."""
    return _mallopt((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX))


def fix_malloc_threshold(threshold: int = 4096) -> bool:
    """Make glibc map every block of ``threshold`` bytes or more on its own, and unmap it when freed.

    By default glibc raises its mmap threshold after large frees and then keeps freed tensors in the heap,
    so the resident size stops following live memory and peaks depend on what ran before. A fixed small
    threshold (which also switches the adjustment off) makes resident size track live tensors to the
    page. It slows allocation down, so only memory measurements use it, never timings.

    It undoes :func:`keep_freed_memory`: mmap and trimming are switched on again, and the free memory it kept in
    the heap is given back to the system (:func:`release_free_memory`). Returns False where glibc's ``mallopt``
    is unavailable.
    """
    done = _mallopt((_M_MMAP_MAX, _DEFAULT_MMAP_MAX), (_M_MMAP_THRESHOLD, threshold),
                    (_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD))
    return release_free_memory() and done


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``), so that a block glibc then
    serves from a free chunk is faulted in, and counted in the resident size, as a fresh mapping is. A memory
    measurement calls it first: glibc serves a new block from a free chunk before it considers mapping one,
    and a chunk freed earlier in the process may still be resident. False where it is unavailable."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True
