"""A trend run, written (``probe ingest verl-log``): ``trend_markdown`` / ``render_trend_run``
render a ``rundir.trend_run.TrendRun`` (the trend of ``trend_table``, the V1 aggregation caveat,
and a line saying the data integrity could not be checked); ``write_trend_report`` writes its
``report.md`` and plot (``ingest.verl_log`` writes the data files first); ``render_ingest`` is
``probe ingest``'s output for a trend run or any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text

from mismatch_probe import store
from mismatch_probe.report.trend_table import render_markdown, render_table
from mismatch_probe.rundir.trend_run import NO_INTEGRITY, TrendRun, caveat


def trend_markdown(view: TrendRun, plot: Path | None) -> str:
    from mismatch_probe.report.md import escape

    source = view.run.get("source", {})
    head = [f"# Trend report: {escape(str(source.get('format', '?')))}", ""]
    head += [f"⚠️ {escape(NO_INTEGRITY)}", "", escape(caveat(view.run)), ""]
    body = render_markdown(view.trend, plot, view.run_dir) if view.trend is not None else ""
    return "\n".join([*head, body])


def write_trend_report(view: TrendRun) -> Path:
    """``report.md`` and ``plots/trend.png`` of a loaded trend run."""
    from mismatch_probe.report.trend_plot import PLOT_NAME, write_trend_plot

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


def render_ingest(result: Any, console: Any) -> None:
    """``probe ingest``'s output: a trend run's (verl-log), else ``trend.render_ingest``."""
    from mismatch_probe.report import ingested

    if not isinstance(result.report, TrendRun):
        ingested.render_ingest(result, console)
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
