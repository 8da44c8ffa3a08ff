"""Memory on the data path: glibc's ``malloc`` tuned for batch-sized arrays
(``keep_freed_memory``), and Python's cycle collector paused during a pass (``collector_paused``).

Every numpy temporary of a metric batch (about 2 MB: 262,144 float64) comes from ``malloc``.
glibc serves a request above its mmap threshold (128 KiB at start, raised as such blocks are
freed) with a fresh ``mmap`` and unmaps it on ``free``, and it gives the free memory at the top
of a heap beyond its trim threshold (twice the mmap threshold) back to the kernel. Either way
the next batch's temporaries fault the same pages in again, zeroed. ``keep_freed_memory`` raises
both thresholds, so freed blocks stay in the process for the next batch. Memory stays flat, a
few batches' worth more at peak. What it is worth: ``make bench metrics_duckdb``
(``speedup_kept_freed_memory_1_worker``).

The ``probe`` command calls it once at start (``cli.main``); a library caller may, too. It is
process-wide. Nothing changes where the C library is not glibc, or where the user set glibc's
malloc in the environment.

A metric pass allocates thousands of small Python objects a batch (a fresh engine of every
accumulator, their records); each few hundred start a collection of the youngest generation and
every tenth of those an older one, which walks every object the process holds (pyarrow's and
numpy's included): 3% of the 10M-token pass in a profile. None of a pass's objects form cycles,
so reference counting frees them all; ``collector_paused`` turns the automatic collections off
for the pass's duration (nested and concurrent passes keep it off until the last ends).
"""

from __future__ import annotations

import gc
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit: requests below come from the heap
TRIM_THRESHOLD = 256 * 2**20  # free memory kept at a heap's top before it is given back


USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (``MMAP_THRESHOLD``, ``TRIM_THRESHOLD``); whether
    both were set. Nothing is changed where the C library is not glibc, or where the user has
    set glibc's malloc through the environment (``USER_SETTINGS``): theirs stands."""
    if glibc_version() is None or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except (ImportError, OSError):
        return False
    mmap_set = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trim_set = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mmap_set and trim_set)


def glibc_version() -> tuple[int, int] | None:
    """glibc's ``(major, minor)``, None where the C library is not glibc."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (ValueError, OSError, AttributeError):  # not a glibc system
        return None
    found = re.match(r"glibc (\d+)\.(\d+)", text or "")
    return (int(found[1]), int(found[2])) if found else None


_paused = 0  # passes in progress that paused the collector
_pause_lock = threading.Lock()


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's automatic cycle collection off for the body, back on when the last paused body
    ends; left off where it was off when the first began (a ``gc.disable()`` made while a
    body runs is undone when the last ends)."""
    global _paused
    with _pause_lock:
        if _paused == 0 and not gc.isenabled():
            _paused = -1  # off before us: never turned on by us
        if _paused >= 0:
            _paused += 1
            gc.disable()
    try:
        yield
    finally:
        with _pause_lock:
            if _paused > 0:
                _paused -= 1
                if _paused == 0:
                    gc.enable()
            elif _paused == -1:
                _paused = 0
