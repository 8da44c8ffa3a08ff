"""``malloc.keep_freed_memory``: after it, a batch-sized numpy temporary comes from the heap
(not a fresh ``mmap``) and its memory stays in the process when freed, for the next batch."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from mismatch_probe.malloc import MMAP_THRESHOLD, keep_freed_memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


def _mmapped_bytes() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().hblkhd)


glibc = pytest.mark.skipif(
    not hasattr(os, "confstr") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="not glibc"
)


@glibc
def test_batch_sized_temporaries_come_from_the_heap() -> None:
    assert keep_freed_memory()
    before = _mmapped_bytes()
    temporary = np.ones(131_072)  # one float64 column of a metric batch: 1 MiB
    assert _mmapped_bytes() == before  # served from the heap, not mmapped
    assert temporary.nbytes < MMAP_THRESHOLD
    del temporary
    huge = np.ones(MMAP_THRESHOLD // 8 + 4096)  # beyond the threshold: mmapped as before
    assert _mmapped_bytes() > before
    del huge
