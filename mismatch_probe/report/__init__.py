"""The reports stage: what people read and attach to pull requests.

Public API::

    from mismatch_probe.report import write_report, render_terminal
    paths = write_report(run_dir)          # metrics.json, plots/*.png, report.md, report.html
    render_terminal(run_dir, Console())    # the terminal report

Module map: ``integrity`` (the data-integrity findings, shown first in every report),
``sections`` (which metrics, grouped how, formatted how), ``terminal`` (rich), ``plots``
(matplotlib PNGs), ``markdown`` (report.md), ``md`` (escaping, tables), ``html`` (report.html
from the Markdown), ``comment`` (the pull-request comment), ``settings`` and ``grid`` (a matrix
run's settings side by side, every setting judged), ``decisions`` (the recommendation, threshold
sweep, outliers, entropy), ``routing`` (the MoE section and plots), ``attribution`` and
``attribution_plot``, ``turns`` (per turn), ``trend_table`` and ``trend_plot`` (an ingested
run's trend), ``compare`` (several runs side by side), ``gate`` (``probe check``'s output),
``metrics_table`` (``probe metrics``' tables), ``summary`` (the scan's last word), ``ingested``
(``probe ingest``'s). This is the only package that renders (rich tables, Markdown, HTML,
matplotlib). What it renders is loaded by ``rundir`` (the run view), computed by ``gate`` (the
gate, a comparison) and ``metrics`` (the rules: verdicts, recommendation): no model, no
tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mismatch_probe import store
from mismatch_probe.rundir.context import Entry, RunContext
from mismatch_probe.rundir.loader import load_report

if TYPE_CHECKING:
    from rich.console import Console

    from mismatch_probe.metrics import MetricsConfig

__all__ = [
    "render",
    "render_terminal",
    "write_outputs",
    "write_report",
]


def write_outputs(ctx: RunContext, entries: list[Entry] | None = None) -> dict[str, Path]:
    """Write ``integrity.json`` (when ``ctx`` has the findings), ``metrics.json``,
    ``plots/<name>.png`` (the routing plots too, for an MoE run), ``report.md`` and
    ``report.html`` (the same report in one self-contained file) of a loaded run; with
    ``entries`` (the settings of a matrix run) the report ends with them side by side.

    Returns:
        ``{"metrics": ..., "integrity": ..., "report": ..., "html": ..., "plot_<name>": ...}``
    """
    from mismatch_probe.report import attribution, turns
    from mismatch_probe.report.html import write_html
    from mismatch_probe.report.markdown import render_markdown
    from mismatch_probe.report.plots import write_plots
    from mismatch_probe.report.routing import routing_markdown, write_routing_plots
    from mismatch_probe.report.settings import settings_markdown, settings_top_markdown
    from mismatch_probe.report.trend_plot import write_trend
    from mismatch_probe.rundir.context import setting_names
    from mismatch_probe.rundir.integrity import write_integrity

    run_dir = store.writable_dir(ctx.run_dir, "run directory")
    paths = {"metrics": run_dir / store.METRICS_FILE, "report": run_dir / store.REPORT_FILE}
    if ctx.integrity is not None:
        paths["integrity"] = write_integrity(run_dir, ctx.integrity)
    names = setting_names(run_dir, ctx.run.get("settings")) if ctx.setting is not None else []
    if not names or ctx.setting == names[0]:  # metrics.json holds the scan's first setting
        store.write_json(paths["metrics"], ctx.json_dict())
    else:
        del paths["metrics"]
    plots = write_plots(ctx, run_dir / store.PLOTS_DIR)
    extra_plots = write_routing_plots(run_dir)
    turns_plot = turns.write_plot(ctx, run_dir / store.PLOTS_DIR)
    if turns_plot is not None:
        extra_plots["plot_turns"] = turns_plot
    attribution_plots, attribution_md = attribution.outputs(run_dir)
    extra_plots.update(attribution_plots)
    trend, trend_plot = write_trend(ctx)
    if trend_plot:
        extra_plots["plot_trend"] = trend_plot
    matrix = entries if entries and len(entries) > 1 else None
    top = settings_top_markdown(matrix, ctx.label, len(names)) if matrix else None
    sections = [
        render_markdown(ctx, plots, top),
        turns.markdown(ctx, turns_plot),
        settings_markdown(matrix, run_dir) if matrix else "",
        routing_markdown(run_dir),
        attribution_md,
        trend,
    ]
    text = "\n".join(section for section in sections if section)
    store.write_text(paths["report"], text)
    model = ctx.run.get("model", {}).get("name", ctx.label)
    paths["html"] = write_html(text, paths["report"], f"Mismatch report: {model}")
    plot_paths = {f"plot_{name}": path for name, (path, _) in plots.items()}
    return {**paths, **plot_paths, **extra_plots}


def render(ctx: RunContext, entries: list[Entry] | None, console: Console) -> None:
    """For a matrix run every setting judged first, then the terminal report (of the reference
    setting, which its header names)."""
    from dataclasses import replace

    from rich.text import Text

    from mismatch_probe.report import attribution
    from mismatch_probe.report.integrity import integrity_text
    from mismatch_probe.report.sections import visible
    from mismatch_probe.report.settings import render_settings
    from mismatch_probe.report.terminal import render_run
    from mismatch_probe.report.trend_table import render_table
    from mismatch_probe.rundir.trend import load_trend

    if entries and len(entries) > 1:
        if ctx.integrity is not None:  # first, before every setting judged (spec section 8)
            console.print(integrity_text(ctx.integrity), highlight=False)
            ctx = replace(ctx, integrity=None)  # said once
        render_settings(entries, console)
        note = (
            f"The report below describes one setting, {ctx.label}; every setting is judged above."
        )
        console.print(Text(visible(note), style="italic"), highlight=False)
    render_run(ctx, console)
    trend = load_trend(ctx.run_dir, ctx.run, ctx.config)
    if trend is not None:
        console.print(render_table(trend))
    attribution.render(ctx.run_dir, console)


def write_report(
    run_dir: Path, metrics_config: MetricsConfig | None = None, settings: tuple[str, ...] = ()
) -> dict[str, Path]:
    """Load ``run_dir`` (recomputing the metrics if ``metrics_config`` differs from the stored
    one) and write its reports; see ``write_outputs``."""
    return write_outputs(*load_report(run_dir, metrics_config, settings=settings))


def render_terminal(
    run_dir: Path, console: Console, metrics_config: MetricsConfig | None = None
) -> None:
    """Print the terminal report of ``run_dir`` on ``console``."""
    render(*load_report(run_dir, metrics_config), console)
