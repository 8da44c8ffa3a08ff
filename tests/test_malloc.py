"""``malloc.keep_freed_memory``: after it, a batch-sized numpy temporary comes from the heap,
where glibc's defaults give it a fresh ``mmap`` (in a fresh process, as ``probe`` starts)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mismatch_probe.malloc import USER_SETTINGS, glibc_version

_ALLOCATE = """
import ctypes, sys
import numpy as np
from mismatch_probe.malloc import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
temporary = np.ones(131_072)  # 1 MiB: half a float64 column of a metric batch
print(libc.mallinfo2().hblkhd - before)
"""


def _mmapped_by_a_batch_array(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}  # glibc's defaults
    run = subprocess.run([sys.executable, "-c", _ALLOCATE, mode], capture_output=True,
                         text=True, check=True, env=env)  # fmt: skip
    return int(run.stdout.strip())


@pytest.mark.skipif(
    (glibc_version() or (0, 0)) < (2, 33), reason="mallinfo2 needs glibc 2.33 or later"
)
def test_batch_sized_temporaries_come_from_the_heap() -> None:
    assert _mmapped_by_a_batch_array("default") >= 131_072 * 8  # glibc's default: mmapped
    assert _mmapped_by_a_batch_array("tuned") == 0  # kept in the heap


def test_the_collector_is_paused_during_a_pass_and_back_after() -> None:
    import gc
    import threading

    from mismatch_probe.malloc import collector_paused

    assert gc.isenabled()
    started, release = threading.Event(), threading.Event()

    def other_pass() -> None:
        with collector_paused():
            started.set()
            release.wait()

    thread = threading.Thread(target=other_pass)
    with collector_paused():
        assert not gc.isenabled()
        thread.start()
        started.wait()
    assert not gc.isenabled()  # the other pass goes on
    release.set()
    thread.join()
    assert gc.isenabled()
    gc.disable()  # off by the user: a pass leaves it off
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
