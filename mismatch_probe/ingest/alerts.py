"""``probe watch``'s alerts: what fails on a step, and the ``--on-alert`` command.

An alert is one JSON object per step (``step_alert``): ``type`` (``bound``, ``integrity``, or
``unreadable`` for a complete step the reader refused), ``step``, ``attempt``, ``message`` (one
line), ``bounds`` (each failed ``--max``/``--min``: metric, kind, limit, value) and ``integrity``
(the step's error findings); the watch adds where it comes from (``tool``, ``run``, ``source``,
``format``). ``run_on_alert`` runs the user's command with it on stdin; a failure is one line and
the watch goes on.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from mismatch_probe import store
from mismatch_probe.gate.bounds import Bound, BoundResult, evaluate_bounds
from mismatch_probe.ingest.stepstore import StoredStep
from mismatch_probe.metrics.integrity import ERROR

ON_ALERT_TIMEOUT = 60.0  # seconds an --on-alert command may take
SIGN = {"max": ">", "min": "<"}


def step_alert(stored: StoredStep, bounds: tuple[Bound, ...]) -> dict[str, Any] | None:
    """The step's alert: the bounds that fail and its integrity errors (None: neither).

    Raises:
        ProbeError: a bound names a metric the step does not have (``probe check``'s message).
    """
    failed = []
    if bounds and stored.metrics:
        failed = [r for r in evaluate_bounds(bounds, stored.metrics) if not r.passed]
    errors = [f for f in stored.findings if f.severity == ERROR]
    if not failed and not errors:
        return None
    parts = [_failed_text(r) for r in failed] + [f"integrity error {f.check}" for f in errors]
    return {
        "type": "bound" if failed else "integrity",
        "step": stored.step,
        "attempt": stored.attempt,
        "message": "; ".join(parts),
        "bounds": [_bound_dict(r) for r in failed],
        "integrity": [f.to_dict() for f in errors],
    }


def _failed_text(res: BoundResult) -> str:
    b = res.bound
    return f"{b.metric} = {res.value:.4g} {SIGN[b.kind]} {b.limit:g} ({b.kind})"


def _bound_dict(res: BoundResult) -> dict[str, Any]:
    b = res.bound
    return {"metric": b.metric, "kind": b.kind, "limit": b.limit, "value": res.value}


def run_on_alert(command: str, alert: dict[str, Any], timeout: float = ON_ALERT_TIMEOUT) -> str:
    """Run ``command`` (a shell line) with ``alert`` as JSON on its stdin; ``""`` when it
    succeeded, else one line saying how it failed."""
    text = json.dumps(alert, allow_nan=False, sort_keys=True)
    try:
        done = subprocess.run(command, shell=True, input=text, text=True, timeout=timeout,
                              capture_output=True, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"--on-alert command still running after {timeout:g} s: stopped"
    except OSError as exc:
        return f"--on-alert command could not run ({store.os_error_reason(exc)})"
    if done.returncode:
        err = " ".join((done.stderr or "").split())[:200]
        return f"--on-alert command exited {done.returncode}" + (f": {err}" if err else "")
    return ""
