"""Interrupts: Ctrl-C (SIGINT) and SIGTERM become one exception that says where they hit.

``handled()`` (entered by the command line) turns the first SIGINT or SIGTERM into
``Interrupted``, a ``BaseException`` that no library code catches (typer and click turn a
``KeyboardInterrupt`` into an exit code of their own before the command line sees it), so every
``finally`` on the way up runs: engines shut down, temporary files are removed. Later signals
are ignored while that happens. The pipeline names its current stage with ``stage(name)`` and
the directory it writes to with ``writing_to(path)``, so the message can say what was kept.

Test hooks: with ``MISMATCH_PROBE_STAGE_TRACE=FILE`` every stage entered is appended to FILE;
``MISMATCH_PROBE_STAGE_HOLD=STAGE`` waits (up to a minute) on entering STAGE, so that a test can
interrupt a stage shorter than the time a signal takes to arrive.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
TRACE_ENV = "MISMATCH_PROBE_STAGE_TRACE"
HOLD_ENV = "MISMATCH_PROBE_STAGE_HOLD"
HOLD_SECONDS = 60.0

_state: dict[str, Any] = {
    "stage": "startup", "out": None, "since": 0.0, "fired": None, "kept": None
}  # fmt: skip


class Interrupted(BaseException):
    """A SIGINT or SIGTERM arrived during ``stage``."""

    def __init__(self, signum: int, stage: str) -> None:
        super().__init__(f"{signal.Signals(signum).name} during {stage}")
        self.signum = signum
        self.stage = stage

    @property
    def exit_code(self) -> int:
        """128 + the signal number: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum

    def message(self) -> str:
        """``interrupted during <stage>; nothing written`` or ``...; complete files kept: ...``,
        or what a resumable run (``resumable``) says it kept."""
        describe = _state.get("kept")
        if describe is not None:
            return f"interrupted during {self.stage}; {describe()}"
        kept = kept_files()
        if not kept:
            return f"interrupted during {self.stage}; nothing written"
        names = ", ".join(str(p.relative_to(_state["out"])) for p in kept)
        return f"interrupted during {self.stage}; complete files kept: {names} (in {_state['out']})"


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Name the pipeline's current stage (``engine_start`` reads as "engine start"); it stays
    the current one until the next stage begins."""
    _state["stage"] = name.replace("_", " ")
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a", encoding="utf-8") as file:
            file.write(_state["stage"] + "\n")
    if os.environ.get(HOLD_ENV, "").replace("_", " ") == _state["stage"]:
        time.sleep(HOLD_SECONDS)
    yield


def reraise_swallowed() -> None:
    """Raise the ``Interrupted`` of a signal that already fired, if any.

    A library that catches every exception can turn ours into its own error (pydantic-core
    reports a ``SchemaError`` when the signal lands while it builds a validator inside vLLM's
    engine start). Code that turns a library's failure into a message calls this first, so the
    run still ends as interrupted, with its exit code.
    """
    fired: Interrupted | None = _state["fired"]
    if fired is not None:
        raise fired


def writing_to(out: Path, since: float) -> None:
    """The scan writes to ``out``; files there modified after ``since`` (epoch s) are its own."""
    _state["out"], _state["since"] = out, since


def resumable(describe: Callable[[], str] | None) -> None:
    """A run that keeps finished parts (a sharded scan): ``describe()`` says what was kept and
    how to continue, in place of the list of files (None: back to the files)."""
    _state["kept"] = describe


def kept_files() -> list[Path]:
    """The complete files this run wrote (final names; temporary ``.name.partial-*`` excluded)."""
    out, since = _state["out"], _state["since"]
    if out is None or not Path(out).is_dir():
        return []
    return sorted(
        p
        for p in Path(out).rglob("*")
        if p.is_file() and not p.name.startswith(".") and p.stat().st_mtime >= since
    )


@contextmanager
def handled() -> Iterator[None]:
    """Raise ``Interrupted`` at the first SIGINT or SIGTERM; ignore later ones (the first is
    being handled: engines are stopping). Previous handlers are restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.update(stage="startup", out=None, since=time.time(), fired=None, kept=None)

    def handler(signum: int, _frame: Any) -> None:
        if _state["fired"] is not None:
            return
        _state["fired"] = fired = Interrupted(signum, _state["stage"])
        raise fired

    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, handler)
    try:
        yield
    except Exception as exc:  # the signal's exception was swallowed and replaced on the way up
        fired: Interrupted | None = _state["fired"]
        if fired is not None:
            raise fired from exc
        raise
    finally:
        _state["fired"] = None
        for s, h in previous.items():
            signal.signal(s, h)
