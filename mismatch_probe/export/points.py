"""A run's steps as ``StepPoint`` s, read from its directory: a watched run's ``steps.jsonl``
(the last line of each step: metrics, findings, histogram, lag), else ``steps.json`` with the
integrity findings per step and each step's histogram from one metrics pass over the step
(``compute_metrics(..., step=N)``, the row groups of that step only). A trend run (``probe ingest
verl-log``: no token store) has its logged metrics only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.export.spec import StepPoint
from mismatch_probe.metrics.integrity import Finding

STEPS_LOG = "steps.jsonl"  # ``ingest.stepstore.STEPS_LOG`` (a lower rank cannot import it)


def run_points(run_dir: Path) -> Iterator[StepPoint]:
    if not run_dir.is_dir():
        raise ProbeError(f"{run_dir} is not a run directory")
    if (run_dir / STEPS_LOG).is_file():
        yield from _logged(run_dir / STEPS_LOG)
        return
    steps = _steps(run_dir)
    if not _has_tokens(run_dir):
        yield from (StepPoint(s, m) for s, m in steps.items())
        return
    from mismatch_probe.metrics import compute_metrics
    from mismatch_probe.rundir.integrity import run_integrity

    integrity = run_integrity(run_dir)
    tokens = store.resolve_tokens_path(run_dir)
    for step, metrics in steps.items():
        hist = compute_metrics(tokens, step=step).curves["log_ratio_hist"]
        yield StepPoint(step, metrics, hist, integrity.of_step(step))


def _has_tokens(run_dir: Path) -> bool:
    tokens = store.resolve_tokens_path(run_dir)
    return tokens.exists()


def _steps(run_dir: Path) -> dict[int, dict[str, float]]:
    """``steps.json`` (recomputed from the store by the trend reader when missing)."""
    path = run_dir / store.STEPS_FILE
    try:
        data = store.read_json(path)
        return {int(s): {k: float(v) for k, v in m.items()} for s, m in data["steps"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    if not _has_tokens(run_dir):
        raise ProbeError(f"{run_dir} has no steps.json and no token store: nothing per step")
    from mismatch_probe.metrics import MetricsConfig
    from mismatch_probe.rundir.trend import steps_of

    found = steps_of(store.resolve_tokens_path(run_dir), None, MetricsConfig().describe())
    if found is None or not found.per_step:
        raise ProbeError(f"{run_dir} has no training steps (a scan, not an ingested run)")
    return found.per_step


def _logged(path: Path) -> Iterator[StepPoint]:
    last: dict[int, dict] = {}
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                data = json.loads(line)
                last[int(data["step"])] = data
    for step in sorted(last):
        data = last[step]
        if not data["metrics"]:
            continue
        findings = tuple(Finding.from_dict(f) for f in data.get("findings") or ())
        yield StepPoint(step, data["metrics"], data.get("log_ratio_hist"), findings,
                        data.get("lag"))  # fmt: skip
