"""Headless Chromium driven over the DevTools protocol (CDP) on a pipe: no port, no package.

``--remote-debugging-pipe`` makes Chromium read JSON commands, each ended by a NUL byte, from its
file descriptor 3 and write answers and events the same way to descriptor 4. ``Browser`` opens a
page, records every request the page makes (``Network.requestWillBeSent``), and evaluates
expressions in it; the page under test itself runs no JavaScript.

``find_chromium`` finds Debian's ``chromium`` (``make test`` installs it where missing).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
TIMEOUT_S = 60.0
# A trampoline: our two pipe ends (argv[1], argv[2]) become descriptors 3 and 4, then the
# browser (argv[3:]) replaces this process. Moved above 10 first, so that neither end is
# overwritten while the other is being placed.
_WIRE = """
import fcntl, os, sys
ends = [fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in sys.argv[1:3]]
for target, fd in zip((3, 4), ends):
    os.dup2(fd, target)
for fd in {*ends, int(sys.argv[1]), int(sys.argv[2])} - {3, 4}:
    os.close(fd)
os.execv(sys.argv[3], sys.argv[3:])
"""


def find_chromium() -> str | None:
    """The path of a Chromium binary on PATH, or None."""
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class Browser:
    """One headless Chromium process with one page attached (``with Browser(path) as b``)."""

    def __init__(self, binary: str, width: int = 1366, height: int = 900) -> None:
        self.binary, self.size = binary, (width, height)
        self.events: list[dict[str, Any]] = []
        self._next_id = 0
        self._buffer = b""

    def __enter__(self) -> Browser:
        self._profile = tempfile.TemporaryDirectory(prefix="probe-chromium-")
        to_child, self._write_fd = os.pipe()
        self._read_fd, from_child = os.pipe()
        args = [
            self.binary,
            "--headless",
            "--remote-debugging-pipe",
            "--no-sandbox",  # CI containers run as root, where the sandbox cannot start
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={self._profile.name}",
            "about:blank",
        ]

        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WIRE, str(to_child), str(from_child), *args],
            pass_fds=(to_child, from_child),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child)
        os.close(from_child)
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        for domain in ("Page.enable", "Network.enable", "Runtime.enable"):
            self.call(domain, session=True)
        width, height = self.size
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):  # already gone: killed below
            self.call("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._write_fd)
        os.close(self._read_fd)
        self._profile.cleanup()

    # --- protocol ------------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        os.write(self._write_fd, json.dumps(message).encode() + b"\0")

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read_fd], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._read_fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited (code {self.proc.poll()})")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        return dict(json.loads(raw))

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send a command and wait for its answer, keeping the events that arrive meanwhile."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        self._send(message)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
            if "method" in reply:
                self.events.append(reply)

    def wait_event(self, method: str) -> dict[str, Any]:
        """The first event ``method`` (already received or still to come)."""
        deadline = time.monotonic() + TIMEOUT_S
        seen = 0
        while True:
            for event in self.events[seen:]:
                if event["method"] == method:
                    return event
            seen = len(self.events)
            reply = self._receive(deadline)
            if "method" in reply:
                self.events.append(reply)

    # --- what the tests use --------------------------------------------------------------------

    def open(self, url: str) -> None:
        """Load ``url`` and wait for its load event (images included)."""
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")

    def requests(self) -> list[str]:
        """Every URL the page requested since it was opened, data: URLs included."""
        return [
            e["params"]["request"]["url"]
            for e in self.events
            if e["method"] == "Network.requestWillBeSent"
        ]

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression evaluated in the page."""
        result = self.call(
            "Runtime.evaluate", session=True, expression=expression, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page (not only the viewport)."""
        data = self.call(
            "Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True
        )["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def pdf(self, path: Path) -> Path:
        """The page printed to PDF (A4), as a reader would print it."""
        data = self.call("Page.printToPDF", session=True, paperWidth=8.27, paperHeight=11.69)[
            "data"
        ]
        path.write_bytes(base64.b64decode(data))
        return path
