"""The one writer of a run directory: an exclusive lock held for as long as it writes.

A scan, an ingest or a watch into ``--out`` takes ``run_lock(out)`` before it writes anything
there and keeps it until its last file is in place; a second writer into the same directory is
refused at once, in one line, instead of replacing the first run's files (metrics spec section
8's companion rule: a finished run is never swapped out from under its writer). Readers
(``probe report``, ``probe check``, ``probe compare``) take no lock: every file is published
atomically (``store.atomic``), so they see the last complete state.

The lock is ``flock`` on ``<run_dir>/.probe-lock`` (a hidden name, skipped by Parquet dataset
readers): the kernel releases it when the holding process exits, however it exits, so a killed
writer never leaves a directory locked. The file records the holder (host, pid, command) for the
message a refused writer prints; the file itself is left in place (removing it would race with a
writer that has just opened it).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mismatch_probe.errors import ProbeError

LOCK_FILE = ".probe-lock"


def _holder(path: Path) -> str:
    """Who holds the lock, as the lock file records it (``""`` when unreadable)."""
    try:
        data = json.loads(path.read_text())
        return f" (pid {int(data['pid'])} on {data['host']}: {data['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


@contextmanager
def run_lock(run_dir: Path, what: str = "--out") -> Iterator[Path]:
    """Hold the exclusive writer's lock of ``run_dir`` (which must exist) for the block.

    Args:
        run_dir: the run directory about to be written.
        what: how the message names the directory (``--out``, ``RUN``).

    Yields:
        The lock file's path.

    Raises:
        ProbeError: another process writes into ``run_dir`` now (it is named).
    """
    path = Path(run_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ProbeError(
                f"{what} {run_dir} is being written by another probe process{_holder(path)}; "
                "wait for it to finish, or choose another directory"
            ) from None
        command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command[:200]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def is_locked(run_dir: Path) -> bool:
    """Whether a writer holds ``run_dir``'s lock now (a reader may say "still being written")."""
    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
