"""The run directory's writer lock: one writer at a time, released however the writer ends."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.store.lock import is_locked, run_lock

HOLD = """
import sys, time
from pathlib import Path
from mismatch_probe.store.lock import run_lock
with run_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_writer_is_refused_and_named(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert is_locked(tmp_path)
        refused = rf"being written by another probe process \(pid {holder.pid} on "
        with pytest.raises(ProbeError, match=refused), run_lock(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the killed writer's lock: the next writer gets it
    deadline = time.monotonic() + 10
    while is_locked(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    with run_lock(tmp_path):
        assert is_locked(tmp_path)
    assert not is_locked(tmp_path)


def test_a_second_holder_in_the_same_process_is_refused(tmp_path: Path) -> None:
    """Two holders inside one process are refused too (flock is per open file description)."""
    refused = pytest.raises(ProbeError, match="being written by another probe process")
    with run_lock(tmp_path), refused, run_lock(tmp_path):
        pass
