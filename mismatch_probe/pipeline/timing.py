"""``Timer``: wall-clock seconds per phase of a scan (``run.json`` ``timings``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mismatch_probe import interrupt


class Timer:
    """Wall-clock seconds per phase: ``with timer("generation"): ...`` (also names the stage an
    interrupt reports). ``announce(phase)``, when set, is called as each phase starts (plain
    progress lines where nobody watches a terminal: ``progress.phase_lines``)."""

    def __init__(self, announce: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.announce = announce

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.announce is not None:
            self.announce(phase)
        start = time.perf_counter()
        try:
            with interrupt.stage(phase):
                yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def add(self, phase: str, seconds: float) -> None:
        """Count ``seconds`` to ``phase`` (time measured by the caller)."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
