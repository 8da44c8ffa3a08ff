"""A trend run, read: per-step metrics with no token store (``probe ingest verl-log``).

``run.json`` (``kind: trend``) and ``steps.json`` are the whole run; ``load_trend_run`` reads
them into the ``TrendRun`` view that ``report.trend_run`` renders and ``gate.trend`` checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.trend import Trend, build_trend

TREND_KIND = "trend"
NO_INTEGRITY = (
    "Data integrity: not checked (a trend run holds the metrics the framework logged, not the "
    "log-probabilities the checks need)"
)
CONFIG = {"source": "the framework's own log"}  # steps.json's config: not ours to recompute


@dataclass(frozen=True)
class TrendRun:
    run_dir: Path
    run: dict[str, Any]
    steps: dict[int, dict[str, float]]
    trend: Trend | None


def is_trend_run(run_dir: Path) -> bool:
    """A run directory whose ``run.json`` says ``kind: trend``."""
    try:
        data = store.read_json(Path(run_dir) / store.RUN_FILE)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("kind") == TREND_KIND


def load_trend_run(run_dir: Path) -> TrendRun:
    try:
        run = dict(store.read_json(run_dir / store.RUN_FILE))
        raw = store.read_json(run_dir / store.STEPS_FILE)["steps"]
        steps = {int(s): {k: float(v) for k, v in m.items()} for s, m in raw.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProbeError(f"{run_dir}: an unreadable trend run ({exc})") from None
    steps = dict(sorted(steps.items()))
    return TrendRun(run_dir, run, steps, build_trend(steps, run))


def caveat(run: dict[str, Any]) -> str:
    """The V1 ``MetricsAggregator`` sentence, naming the logged metrics it reduces by name."""
    rules = run.get("v1_aggregation") or {}
    if not isinstance(rules, dict):
        return ""
    named = ", ".join(f"{m} ({r})" for m, r in sorted(rules.items()))
    return (
        "verl's V1 trainer (parameter_sync_step > 1) logs each metric reduced over a step's "
        "iterations by its name (verl/trainer/ppo/v1/utils.py MetricsAggregator): names with "
        "'max' are maxed, 'min' minned, 'sum' or 'total' summed, the rest averaged; with more "
        "than one iteration per step these are not the whole step's values"
        + (f": {named}." if named else ".")
    )
