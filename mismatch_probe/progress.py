"""Progress bars (rich) for generation and rescoring.

vLLM's ``LLM.generate(use_tqdm=callable)`` drives a tqdm-like object; ``vllm_progress`` returns
such a callable backed by a rich ``Progress`` task, so both phases share one display.
"""

from __future__ import annotations

import time
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def make_progress(console: Any) -> Progress:
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

    def __init__(self, progress: Progress, description: str, total: int) -> None:
        self._progress = progress
        self._task = progress.add_task(description, total=total, unit="responses")
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


def vllm_progress(progress: Progress, description: str, total: int) -> Any:
    """A ``use_tqdm`` callable for vLLM that reports into ``progress``."""

    def factory(*args: Any, **_kwargs: Any) -> Any:
        if args:  # vLLM also wraps the iterable of prompts it adds: pass it through
            return args[0]
        return _RichTqdm(progress, description, total)

    return factory
