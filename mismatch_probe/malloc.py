"""glibc's ``malloc`` tuned for the data path's batch-sized arrays: ``keep_freed_memory``.

Every numpy temporary of a metric batch (about 1 MB: 131,072 float64) comes from ``malloc``.
glibc serves a request above its mmap threshold with a fresh ``mmap`` and gives it back on
``free``, and it returns freed memory at the top of a heap beyond its trim threshold to the
kernel; either way the next batch's temporaries fault the same pages in again, zeroed. That cost
is a large share of the metric engine's time (``docs/speed.md``). ``keep_freed_memory`` raises
both thresholds, so freed blocks stay in the process for the next batch: the working set of a
batch is reused instead of remapped, and memory stays flat (a few batches' worth more at peak).

The ``probe`` command calls it once at start (``cli.main``); a library caller may, too. It is
process-wide and has no effect where the C library is not glibc (the call is skipped).
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit: requests below come from the heap
TRIM_THRESHOLD = 256 * 2**20  # free memory kept at a heap's top before it is given back


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (``MMAP_THRESHOLD``, ``TRIM_THRESHOLD``); whether
    both were set (False where the C library is not glibc)."""
    if not _glibc():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mmap_set = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trim_set = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mmap_set and trim_set)


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):  # not a glibc system
        return False
