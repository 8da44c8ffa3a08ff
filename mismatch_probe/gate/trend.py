"""``probe check`` of a trend run (``probe ingest verl-log``): the bounds on one step's logged
metrics; data integrity cannot be checked, and the gate's note says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.gate.bounds import evaluate_bounds
from mismatch_probe.rundir.trend_run import NO_INTEGRITY, load_trend_run


def trend_bounds(run_dir: Path, bounds: Any, step: str | None) -> tuple[int, tuple, str]:
    """``probe check`` of a trend run: ``(step, bound results, note)`` of one step's logged
    metrics (``--step``, ``last`` by default)."""
    view = load_trend_run(run_dir)
    if not view.steps:
        raise ProbeError(f"{run_dir}: no step")
    text = step or "last"
    if text.strip() == "last":
        number = max(view.steps)
    else:
        try:
            number = int(text)
        except ValueError:
            raise ProbeError(f"--step {text!r}: expected a step number or 'last'") from None
        if number not in view.steps:
            first, last = min(view.steps), max(view.steps)
            raise ProbeError(f"--step {number}: not in the run (steps {first}..{last})")
    results = tuple(evaluate_bounds(bounds, view.steps[number]))
    note = f"step {number} of a trend run: {NO_INTEGRITY[0].lower()}{NO_INTEGRITY[1:]}"
    return number, results, note
