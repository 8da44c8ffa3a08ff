"""The trend section of an ingested run, written: a Markdown section and a rich table of a
``rundir.trend.Trend`` (key metrics against training step, failing values marked, the steps
where a metric starts failing listed, the staleness note). The plot is ``trend_plot``'s.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

from mismatch_probe import store
from mismatch_probe.rundir.trend import Trend, threshold_of

MAX_ROWS = 40  # table rows; longer runs show the crossings, the ends and evenly spaced steps


def shown_steps(trend: Trend) -> list[int]:
    """At most ``MAX_ROWS`` steps: both ends, every crossing, then evenly spaced ones."""
    steps = trend.steps
    if len(steps) <= MAX_ROWS:
        return steps
    keep = {steps[0], steps[-1], *(s for c in trend.crossings.values() for s in c)}
    room = max(MAX_ROWS - len(keep), 0)
    stride = max(1, len(steps) // (room + 1))
    keep.update(steps[::stride][:room])
    return sorted(keep)


def label(metric: str) -> str:
    if metric.startswith("presets/"):
        return f"{metric.split('/')[1]} masked"
    return metric


def cell(trend: Trend, metric: str, index: int) -> tuple[str, bool]:
    """The value at ``trend.steps[index]`` (4 significant digits) and whether it fails."""
    step = trend.steps[index]
    return f"{trend.series[metric][index]:.4g}", step in trend.failing.get(metric, set())


def crossing_lines(trend: Trend) -> list[str]:
    """``chi2_token (≤ 1): crosses at step 12, 40`` for each metric that ever fails."""
    out = []
    for metric, steps in trend.crossings.items():
        check = threshold_of(metric)
        if steps and check is not None:
            where = ", ".join(str(s) for s in steps)
            out.append(f"{metric} ({check.threshold}, {check.source}): crosses at step {where}")
    return out


def render_markdown(trend: Trend, plot: Path | None, base: Path) -> str:
    """``## Trend over training steps``: note, crossings, plot, table (failing cells bold ❌)."""
    from mismatch_probe.report.markdown import escape, table

    lines = ["## Trend over training steps", "", escape(trend.note), ""]
    if trend.rewritten:
        lines += [escape(trend.rewritten), ""]
    crossings = crossing_lines(trend)
    lines += [f"- ❌ {escape(c)}" for c in crossings] or ["- every threshold holds at every step"]
    lines.append("")
    if plot is not None:
        lines += [f"![Key metrics against training step]({plot.relative_to(base).as_posix()})", ""]
    shown = shown_steps(trend)
    if len(shown) < len(trend.steps):
        lines += [
            f"{len(shown)} of {len(trend.steps)} steps shown ({store.STEPS_FILE} has all).",
            "",
        ]
    metrics = list(trend.series)
    rows = []
    for step in shown:
        i = trend.steps.index(step)
        cells = [f"**❌ {v}**" if bad else v for v, bad in (cell(trend, m, i) for m in metrics)]
        rows.append([str(step), *cells])
    header = ["step", *(f"`{escape(label(m))}`" for m in metrics)]
    return "\n".join([*lines, *table(header, rows, "r" * len(header)), ""])


def render_table(trend: Trend) -> Table:
    """The rich version of the table: failing values red, the note as the caption."""
    caption = " ".join(n for n in (trend.note, trend.rewritten) if n)
    table = Table(title="Trend over training steps", title_justify="left", caption=caption,
                  caption_justify="left", title_style="bold")  # fmt: skip
    table.add_column("step", justify="right")
    for metric in trend.series:
        table.add_column(label(metric), justify="right")
    for step in shown_steps(trend):
        i = trend.steps.index(step)
        values = [cell(trend, m, i) for m in trend.series]
        table.add_row(str(step), *(Text(v, style="bold red" if bad else "") for v, bad in values))
    return table
