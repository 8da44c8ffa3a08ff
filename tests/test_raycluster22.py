"""Fault 14 of issue 22: Ray's own log lines reached stderr, and a ``ray://`` address that does
not answer took about 30 s to fail. Ray's output now goes to a log file, and ``--ray-timeout``
bounds the wait. Real sockets and a real local Ray instance; no mock."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline import raycluster
from mismatch_probe.pipeline.config import ScanConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model cache of the test's own, where the Ray log goes (``logs/``)."""
    monkeypatch.setenv("MISMATCH_PROBE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and never speaks (no Ray behind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


def test_nothing_listening_fails_at_once(cache: Path, capfd: Any) -> None:
    port = free_port()
    with pytest.raises(ProbeError) as info, raycluster.connected(f"ray://127.0.0.1:{port}", 5.0):
        pass
    assert str(info.value) == (
        f"--ray ray://127.0.0.1:{port}: nothing accepts a connection at 127.0.0.1:{port} "
        "(Connection refused); check the address (--ray-timeout to wait longer)"
    )
    assert capfd.readouterr().err == ""


# A fresh process per case, as the command line runs it: Ray's logging set up in the pytest
# process would write to streams of earlier tests' captures.
CONNECT = """
import sys
from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline import raycluster
try:
    with raycluster.connected(sys.argv[1], float(sys.argv[2])):
        import ray
        print("connected" if ray.is_initialized() else "not connected")
except ProbeError as exc:
    print(f"error: {exc}")
"""


def connect(address: str, timeout: float, cache: Path) -> tuple[str, str]:
    """``(stdout, stderr)`` of a process that joins ``address`` and leaves."""
    env = {**os.environ, "MISMATCH_PROBE_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", CONNECT, address, str(timeout)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    return proc.stdout, proc.stderr


def test_local_ray_output_goes_to_a_log_file(cache: Path) -> None:
    out, err = connect("local", 60.0, cache)
    assert out == "connected\n" and err == ""  # nothing of Ray's on the terminal
    logs = list((cache / "logs").glob("*.log"))
    assert logs and any("ray" in p.read_text().lower() for p in logs)


def test_a_server_that_is_not_ray_is_given_up_after_the_timeout(
    cache: Path, silent_server: int
) -> None:
    """The port answers, Ray's client never gets a reply: bounded by the timeout (1 s), not by
    Ray's retries (5 + 10 + 15 s); Ray's lines stay in its log."""
    address = f"ray://127.0.0.1:{silent_server}"
    out, err = connect(address, 1.0, cache)
    assert out.startswith(f"error: --ray {address}: no Ray cluster answered within 1 s")
    assert out.endswith("(--ray-timeout to wait longer)\n") and err == ""


@pytest.mark.parametrize(
    ("value", "expected"), [(0.0, "must be > 0"), (float("nan"), "must be a finite number")]
)
def test_ray_timeout_is_validated(value: float, expected: str) -> None:
    with pytest.raises(ProbeError, match=f"--ray-timeout {expected}"):
        ScanConfig(ray_timeout=value)
