"""Progress of generation and rescoring: rich bars on a terminal, plain lines elsewhere.

vLLM's ``LLM.generate(use_tqdm=callable)`` drives a tqdm-like object; ``vllm_progress`` returns
such a callable backed by a progress task, so both phases share one display. Where nobody watches
a terminal (CI logs, ``| tee``), rich's bars would print nothing until the end: ``make_progress``
returns a ``PlainProgress`` there, which prints a line when a phase starts, every
``PlainProgress.interval`` seconds or 10% of the phase, and when it ends, each with its rate and
ETA, and no ANSI codes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def make_progress(console: Any) -> Any:
    """Rich bars when ``console`` is a terminal, else a ``PlainProgress`` writing to it."""
    if not console.is_terminal:
        return PlainProgress(console)
    return Progress(
        TextColumn("[bold]{task.description:<12}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        # print() and libraries' writes are not routed through the bars: a library that keeps a
        # reference to sys.stdout (vLLM's log handler) must not keep one to a proxy of the bars
        redirect_stdout=False,
        redirect_stderr=False,
    )


class _RichTqdm:
    """The part of tqdm's interface that vLLM's ``_run_engine`` uses."""

    def __init__(
        self, progress: Progress, description: str, total: int, unit: str = "responses"
    ) -> None:
        self._progress = progress
        self._task = progress.add_task(description, total=total, unit=unit)
        self._start = time.perf_counter()
        self.n = 0
        self.postfix = ""

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(time.perf_counter() - self._start, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        self._progress.update(self._task, advance=n)

    def refresh(self) -> None:
        self._progress.refresh()

    def close(self) -> None:
        self._progress.refresh()


def vllm_progress(progress: Progress, description: str, total: int, unit: str = "responses") -> Any:
    """A ``use_tqdm`` callable for vLLM (and the multi-turn request loop: one ``unit`` per
    finished turn) that reports into ``progress``."""

    def factory(*args: Any, **_kwargs: Any) -> Any:
        if args:  # vLLM also wraps the iterable of prompts it adds: pass it through
            return args[0]
        return _RichTqdm(progress, description, total, unit)

    return factory


@dataclass
class _Phase:
    description: str
    total: int
    unit: str
    started: float
    done: int = 0
    last_line: float = 0.0  # when the last line of this phase was printed
    last_decile: int = 0  # the last tenth of the phase a line was printed for


class PlainProgress:
    """The part of rich's ``Progress`` the scan uses (``add_task``, ``update``, ``refresh``, a
    context manager), printed as plain lines to ``console.file`` (looked up at each line: the
    scan may point the console at another stream while engines run).

    A line when a phase starts, then whenever another tenth of it is done or ``interval``
    seconds have passed since the last line, and when it completes::

        gen bfloat16: started, 128 responses
        gen bfloat16: 64/128 responses (50%), 12.3 responses/s, elapsed 0:05, ETA 0:05
        gen bfloat16: done, 128 responses in 0:10 (12.3 responses/s)
    """

    interval = 10.0  # seconds between two lines of a phase that advances slowly

    def __init__(self, console: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._console = console
        self._clock = clock
        self._phases: list[_Phase] = []

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: int, unit: str = "", **_fields: Any) -> int:
        now = self._clock()
        self._phases.append(_Phase(description, int(total), unit, now, last_line=now))
        self._print(f"{description}: started, {total} {unit}".rstrip())
        return len(self._phases) - 1

    def update(self, task: int, advance: int = 0, **_fields: Any) -> None:
        phase = self._phases[task]
        if phase.total and phase.done >= phase.total:
            return  # finished (its line printed)
        phase.done += advance
        now = self._clock()
        decile = 10 * phase.done // phase.total if phase.total else 0
        if phase.total and phase.done >= phase.total:
            self._print(_done_line(phase, now))
        elif decile > phase.last_decile or now - phase.last_line >= self.interval:
            self._print(_progress_line(phase, now))
        else:
            return
        phase.last_line, phase.last_decile = now, decile

    def refresh(self) -> None:
        return None

    def _print(self, line: str) -> None:
        _print_line(self._console, line)


# Phases whose start says nothing new: an engine's own "gen <setting>" line follows its start at
# once (and an engine that fails to start ends in one error line, nothing before it).
SILENT_PHASES = frozenset({"engine_start", "engine_stop"})


def phase_lines(console: Any) -> Callable[[str], None] | None:
    """Where nobody watches a terminal, one plain line as each phase of a scan starts
    (``model_load: started``, ``reports: started``: the phases without a progress task of their
    own, ``SILENT_PHASES`` aside); None on a terminal, where the bars show what runs."""
    if console.is_terminal:
        return None
    return lambda phase: (
        None if phase in SILENT_PHASES else _print_line(console, f"{phase}: started")
    )


def _print_line(console: Any, line: str) -> None:
    if not getattr(console, "quiet", False):
        print(line, file=console.file, flush=True)


def _clock_text(seconds: float) -> str:
    """``0:05``, ``12:30``, ``1:02:03``."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _rate(phase: _Phase, now: float) -> float:
    return phase.done / max(now - phase.started, 1e-9)


def _rate_text(rate: float) -> str:
    """``25.0``, ``0.00027``: a slow phase's rate keeps its significant digits."""
    return f"{rate:.1f}" if rate >= 1 or rate == 0 else f"{rate:.2g}"


def _progress_line(phase: _Phase, now: float) -> str:
    rate = _rate(phase, now)
    percent = f" ({100 * phase.done // phase.total}%)" if phase.total else ""
    eta = _clock_text((phase.total - phase.done) / rate) if rate > 0 else "?"
    return (
        f"{phase.description}: {phase.done}/{phase.total} {phase.unit}{percent}, "
        f"{_rate_text(rate)} {phase.unit}/s, elapsed {_clock_text(now - phase.started)}, ETA {eta}"
    )


def _done_line(phase: _Phase, now: float) -> str:
    return (
        f"{phase.description}: done, {phase.done} {phase.unit} in "
        f"{_clock_text(now - phase.started)} ({_rate_text(_rate(phase, now))} {phase.unit}/s)"
    )
