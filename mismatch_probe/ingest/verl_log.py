"""``probe ingest verl-log FILE --out RUN``: verl's ``file`` logger JSONL as a trend run.

Checked against verl 0.9.1 ``verl/utils/tracking.py`` (``FileLogger``): one line per
``Tracking.log(data, step)``, ``{"step": N, "data": {name: value}}`` written with orjson, which
writes a NaN or an infinity as ``null``; the file is ``$VERL_FILE_LOGGER_PATH`` or
``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``. We keep the ``rollout_corr/*`` metrics
(verl's ``rollout_corr_helper`` prefixes its IS, RS and off-policy metrics so: our names without
the prefix) of each step; several lines of one step are merged (a later value wins), a ``null``
is left out and counted.

The run has no token store (the log holds numbers, not log-probs): ``run.json`` (``kind``
``trend``), ``steps.json`` and ``report.md`` with the trend, which ``probe report`` re-renders
and ``probe check --step`` gates; data integrity cannot be checked and the report says so.

verl's V1 trainer (``trainer.use_v1``) runs ``parameter_sync_step`` iterations per logged step
and reduces each metric over them by its name (``verl/trainer/ppo/v1/utils.py``
``MetricsAggregator._get_aggregation_type``, reimplemented in ``v1_aggregation``): a name with
``max`` (or ``maximum``) is maxed, ``min`` minned, ``sum`` or ``total`` summed, ``lr`` and a few
named ones take the last value, the rest are averaged weighted by samples. With more than one
iteration per step, a metric whose name holds such a word is not the whole step's value (a
``..._seq_max_k2_mean`` mean is maxed); ``run.json`` ``v1_aggregation`` lists the logged ones and
the report states it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.records import StepRange

FORMAT = "verl-log"
PREFIX = "rollout_corr/"
CHECKED = "volcengine/verl 0.9.1 verl/utils/tracking.py (FileLogger), verl/trainer/ppo/v1/utils.py"
# MetricsAggregator's word rules, in its order (the first that matches decides).
WORD_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("max", "maximum"), "max"),
    (("min", "minimum"), "min"),
    (("sum", "total"), "sum"),
    (("weighted_avg", "mean", "avg", "average"), "weighted_avg"),
)


def v1_aggregation(name: str) -> str:
    """How verl's V1 ``MetricsAggregator`` reduces ``name`` over a step's iterations."""
    lower = name.lower()
    if lower.endswith(("/lr", "_lr")) or lower == "lr":
        return "last"
    if "timing_s/" in lower or "timing_per_token_ms/" in lower:
        return "time_sum"
    for words, rule in WORD_RULES:
        if any(word in lower for word in words):
            return rule
    return "weighted_avg"


def read_log(path: Path, steps: StepRange) -> tuple[dict[int, dict[str, float]], int]:
    """``({step: {metric: value}}, nulls left out)`` of the ``rollout_corr/*`` metrics."""
    if not path.is_file():
        raise ProbeError(f"{path}: no such file (verl's file logger writes one .jsonl file)")
    found: dict[int, dict[str, float]] = {}
    nulls = 0
    from mismatch_probe.ingest.records import iter_json_lines, short_repr

    for number, obj in iter_json_lines(path):
        step, data = obj.get("step"), obj.get("data")
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(data, dict):
            raise ProbeError(
                f'{path}:{number}: expected verl\'s file logger line {{"step": N, "data": '
                f"{{...}}}}, got {short_repr(obj)}"
            )
        if step not in steps:
            continue
        for key, value in data.items():
            if not isinstance(key, str) or not key.startswith(PREFIX):
                continue
            if value is None:
                nulls += 1
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # a dict of counts or a string: not a metric
            if not math.isfinite(float(value)):
                nulls += 1
                continue
            found.setdefault(step, {})[key[len(PREFIX) :]] = float(value)
    if not found:
        raise ProbeError(f"{path}: no rollout_corr/* metric in the chosen steps")
    return dict(sorted(found.items())), nulls


def ingest_verl_log(path: Path, out: Path, steps: StepRange) -> tuple[dict[str, Any], dict]:
    """Write the trend run (see the module docstring); returns ``(run, steps)``."""
    from mismatch_probe.hardware import library_versions
    from mismatch_probe.report.trend_run import write_trend_report
    from mismatch_probe.rundir.trend import Steps, build_trend, write_steps
    from mismatch_probe.rundir.trend_run import CONFIG, TREND_KIND, TrendRun

    per_step, nulls = read_log(path, steps)
    names = sorted({k for m in per_step.values() for k in m})
    run: dict[str, Any] = {
        "tool": "mismatch_probe",
        "schema_version": store.SCHEMA_VERSION,
        "kind": TREND_KIND,
        "setting": f"{FORMAT}: the rollout_corr/* metrics verl logged",
        "source": {
            "format": FORMAT,
            "path": str(path.resolve()),
            "checked_against": CHECKED,
            "steps": {"first": steps.first, "last": steps.last},
        },
        "counts": {
            "steps": len(per_step),
            "first_step": min(per_step),
            "last_step": max(per_step),
            "metrics": len(names),
            "null_values": nulls,
        },
        "v1_aggregation": {
            n: rule for n in names if (rule := v1_aggregation(f"{PREFIX}{n}")) != "weighted_avg"
        },
        "off_policy": {
            "max_off_policy_steps": None,
            "staleness": None,
            "source": "not in verl's file log",
        },
        "versions": library_versions(),
    }
    out.mkdir(parents=True, exist_ok=True)
    store.write_json(out / store.RUN_FILE, run)
    write_steps(out, Steps(CONFIG, per_step))
    write_trend_report(TrendRun(out, run, per_step, build_trend(per_step, run)))
    return run, per_step
