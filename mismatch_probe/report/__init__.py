"""The reports stage: what people read and attach to pull requests.

Public API::

    from mismatch_probe.report import render, write_outputs
    ctx, entries = rundir.load_report(run_dir)   # the view (rundir builds it, report renders it)
    render(ctx, entries, Console())             # the terminal report
    paths = write_outputs(ctx, entries, out_dir, data_paths)  # plots/*.png, report.md, .html

Every renderer takes what it is handed (a ``rundir.RunContext`` view, its ``Entry`` list, a
``gate.compare.Comparison``, a ``gate.baseline.Gate``) and writes output; none reads the run
directory to find out what to say (``tests/test_layers.py`` checks it). The data files
(``metrics.json``, ``integrity.json``, ...) are ``rundir.write_data``'s, written before this.

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

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from mismatch_probe import store
from mismatch_probe.rundir.context import Entry, RunContext

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["render", "write_outputs"]


def write_outputs(
    ctx: RunContext,
    entries: list[Entry] | None,
    out_dir: Path,
    data: Mapping[str, Path] | None = None,
) -> dict[str, Path]:
    """Write ``plots/<name>.png`` (the routing, per-turn, attribution and trend plots too, where
    the run has them), ``report.md`` and ``report.html`` (the same report in one self-contained
    file) of the view ``ctx`` into ``out_dir``; with ``entries`` (the settings of a matrix run)
    the report ends with them side by side.

    Args:
        data: the data files already written (``rundir.write_data``), listed with the outputs.

    Returns:
        ``{"metrics": ..., "report": ..., "integrity": ..., "html": ..., "plot_<name>": ...}``
    """
    from mismatch_probe.report import attribution, layers, turns
    from mismatch_probe.report.html import write_html
    from mismatch_probe.report.markdown import render_markdown
    from mismatch_probe.report.plots import write_plots
    from mismatch_probe.report.png import kept
    from mismatch_probe.report.routing import routing_markdown, write_routing_plots
    from mismatch_probe.report.settings import settings_markdown, settings_top_markdown
    from mismatch_probe.report.trend_plot import write_trend

    out = store.writable_dir(Path(out_dir), "run directory")
    written = dict(data or {})
    plots_dir = out / store.PLOTS_DIR
    with kept() as pngs:  # the PNGs drawn, for the HTML to embed
        plots = write_plots(ctx, plots_dir)
        routing_plots = write_routing_plots(ctx.routing, plots_dir)
        extra_plots = dict(routing_plots)
        turns_plot = turns.write_plot(ctx, plots_dir)
        if turns_plot is not None:
            extra_plots["plot_turns"] = turns_plot
        attribution_plot = attribution.write_plot(ctx.attribution, plots_dir)
        extra_plots.update({k: written[k] for k in ("attribution",) if k in written})
        extra_plots.update({"plot_attribution": attribution_plot} if attribution_plot else {})
        layers_plot = layers.write_plot(ctx.layers, plots_dir)  # --layers
        extra_plots.update({k: written[k] for k in ("layers",) if k in written})
        extra_plots.update({"plot_layers": layers_plot} if layers_plot else {})
        trend, trend_plot = write_trend(ctx, plots_dir, out)
        if trend_plot:
            extra_plots["plot_trend"] = trend_plot
        matrix = entries if entries and len(entries) > 1 else None
        top = (
            settings_top_markdown(matrix, ctx.label, len(ctx.settings), ctx.skipped)
            if matrix
            else None
        )
        sections = [
            render_markdown(ctx, plots, out, top),
            turns.markdown(ctx, turns_plot),
            settings_markdown(matrix, out) if matrix else "",
            routing_markdown(ctx.routing, routing_plots),
            attribution.markdown_section(ctx.attribution, attribution_plot, out),
            layers.markdown_section(ctx.layers, layers_plot, out),
            trend,
        ]
        text = "\n".join(section for section in sections if section)
        paths = {k: written[k] for k in ("metrics",) if k in written}
        paths["report"] = out / store.REPORT_FILE
        paths.update({k: written[k] for k in ("integrity",) if k in written})
        store.write_text(paths["report"], text)
        model = ctx.run.get("model", {}).get("name", ctx.label)
        paths["html"] = write_html(text, paths["report"], f"Mismatch report: {model}", pngs)
    plot_paths = {f"plot_{name}": path for name, (path, _) in plots.items()}
    return {**paths, **plot_paths, **extra_plots}


def render(ctx: RunContext, entries: list[Entry] | None, console: Console) -> None:
    """For a matrix run every setting judged first, then the terminal report (of the reference
    setting, which its header names), the trend of an ingested run and the attribution."""
    from dataclasses import replace

    from rich.text import Text

    from mismatch_probe.report import attribution, layers
    from mismatch_probe.report.integrity import integrity_text
    from mismatch_probe.report.sections import visible
    from mismatch_probe.report.settings import render_settings
    from mismatch_probe.report.terminal import render_run
    from mismatch_probe.report.trend_table import render_table

    if entries and len(entries) > 1:
        if ctx.integrity is not None:  # first, before every setting judged (spec section 8)
            console.print(integrity_text(ctx.integrity), highlight=False)
            ctx = replace(ctx, integrity=None)  # said once
        render_settings(entries, console, ctx.skipped)
        note = (
            f"The report below describes one setting, {ctx.label}; every setting is judged above."
        )
        console.print(Text(visible(note), style="italic"), highlight=False)
    else:
        from mismatch_probe.report.grid import skipped_lines

        for line in skipped_lines(ctx.skipped):  # settings asked for that did not run
            console.print(Text(visible(line), style="yellow"), highlight=False)
    render_run(ctx, console)
    if ctx.trend is not None:
        console.print(render_table(ctx.trend))
    attribution.render(ctx.attribution, console)
    layers.render(ctx.layers, console)
