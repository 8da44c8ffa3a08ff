"""A trend run: per-step metrics with no token store (``probe ingest verl-log``).

``run.json`` (``kind: trend``) and ``steps.json`` are the whole run. ``load_trend_run`` reads
them into a ``TrendRun`` view; ``trend_markdown`` / ``render_trend_run`` render it (the trend of
``report.trend``, the V1 aggregation caveat, and a line saying the data integrity could not be
checked); ``write_trend_run`` writes the three files and the plot; ``trend_bounds`` is ``probe
check`` of one step (``--step``) or the last (the logged metrics are per step only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.text import Text

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.report.trend import Trend, build_trend, render_markdown, render_table

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


def trend_markdown(view: TrendRun, plot: Path | None) -> str:
    from mismatch_probe.report.md import escape

    source = view.run.get("source", {})
    head = [f"# Trend report: {escape(str(source.get('format', '?')))}", ""]
    head += [f"⚠️ {escape(NO_INTEGRITY)}", "", escape(caveat(view.run)), ""]
    body = render_markdown(view.trend, plot, view.run_dir) if view.trend is not None else ""
    return "\n".join([*head, body])


def write_trend_run(out: Path, run: dict[str, Any], steps: dict[int, dict[str, float]]) -> None:
    """``run.json``, ``steps.json``, ``report.md`` and ``plots/trend.png`` into ``out``."""
    from mismatch_probe.report.trend import write_steps

    out.mkdir(parents=True, exist_ok=True)
    store.write_json(out / store.RUN_FILE, run)
    write_steps(out, steps, CONFIG)
    write_trend_report(load_trend_run(out))


def write_trend_report(view: TrendRun) -> Path:
    """``report.md`` and ``plots/trend.png`` of a loaded trend run."""
    from mismatch_probe.report.trend import PLOT_NAME
    from mismatch_probe.report.trend_plot import write_trend_plot

    plot = None
    if view.trend is not None:
        (view.run_dir / store.PLOTS_DIR).mkdir(exist_ok=True)
        target = view.run_dir / store.PLOTS_DIR / f"{PLOT_NAME}.png"
        plot = write_trend_plot(view.trend, target, view.run_dir.name)
    path = view.run_dir / store.REPORT_FILE
    store.write_text(path, trend_markdown(view, plot))
    return path


def render_trend_run(view: TrendRun, console: Any) -> None:
    console.print(Text(NO_INTEGRITY, style="yellow"), highlight=False)
    text = caveat(view.run)
    if text:
        console.print(Text(text, style="dim"), highlight=False)
    if view.trend is not None:
        console.print(render_table(view.trend))


def trend_bounds(run_dir: Path, bounds: Any, step: str | None) -> tuple[int, tuple, str]:
    """``probe check`` of a trend run: ``(step, bound results, note)`` of one step's logged
    metrics (``--step``, ``last`` by default)."""
    from mismatch_probe.report.check import evaluate_bounds

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


def render_ingest(result: Any, console: Any) -> None:
    """``probe ingest``'s output: a trend run's (verl-log), else ``trend.render_ingest``."""
    from mismatch_probe.report import trend

    if not isinstance(result.report, TrendRun):
        trend.render_ingest(result, console)
        return
    render_trend_run(result.report, console)
    counts, source = result.run.get("counts", {}), result.run.get("source", {})
    console.print(
        f"ingested {source.get('format')} {source.get('path')}: {counts.get('steps')} steps "
        f"({counts.get('first_step')}..{counts.get('last_step')}), {counts.get('metrics')} "
        f"rollout_corr metrics -> {result.out}",
        highlight=False,
        soft_wrap=True,
    )
