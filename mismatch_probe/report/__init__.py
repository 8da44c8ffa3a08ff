"""The reports stage: what people read and attach to pull requests.

Public API::

    from mismatch_probe.report import write_report, render_terminal
    paths = write_report(run_dir)          # metrics.json, plots/*.png, report.md, report.html
    render_terminal(run_dir, Console())    # the terminal report

Module map: ``context`` (load a run directory), ``integrity`` (the data-integrity findings,
shown first in every report, and ``integrity.json``), ``verdicts`` (health checks as a table),
``sections`` (which metrics, grouped how, formatted how), ``terminal`` (rich), ``plots``
(matplotlib PNGs), ``markdown`` (report.md), ``html`` (report.html from the Markdown),
``comment`` (the pull-request comment), ``settings`` (a matrix run's settings side by side),
``recommend`` (the recommendation rule), ``decisions`` (its sections: recommendation, threshold
sweep, outliers, entropy), ``rescan`` (the command that re-scans one prompt),
``routing`` (the MoE section and plots, from routing.json), ``compare`` (several runs side by
side), ``check`` (bounds for CI), ``baseline`` and ``bootstrap`` (the gate against a baseline
run), ``metrics_table`` (``probe metrics``' tables), ``summary`` (the scan's last word). This is
the only package that renders (rich tables, Markdown, HTML, matplotlib). The reports read only
the run directory: no model, no tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.report.context import RunContext, load_run

if TYPE_CHECKING:
    from rich.console import Console

    from mismatch_probe.metrics import MetricsConfig
    from mismatch_probe.metrics.integrity import Integrity
    from mismatch_probe.report.compare import Entry

__all__ = [
    "RunContext",
    "load_report",
    "load_run",
    "render",
    "render_terminal",
    "write_outputs",
    "write_report",
]


def load_report(
    run_dir: Path,
    metrics_config: MetricsConfig | None = None,
    computed: Mapping[str, dict[str, Any]] | None = None,
    run: dict[str, Any] | None = None,
    order: list[str] | None = None,
    settings: tuple[str, ...] = (),
    integrity_errors: Sequence[str] = (),
    integrity: Integrity | None = None,
) -> tuple[RunContext, list[Entry]]:
    """Load what a report shows: the run (its reference setting when the store holds several)
    and, for a precision-matrix run, one ``Entry`` per setting (least mismatch first).

    Args:
        computed: setting name -> ``MetricsResult.to_json_dict()`` the caller already has (the
            scan's, default config): used instead of computing them again.
        run: the run metadata, when the caller has it in memory (the scan's finishing step,
            before it writes ``run.json``): nothing is read from a ``run.json`` on disk, which
            may be an earlier run's.
        order: the settings in the scan's order (first = the reference), with ``run``.
        settings: only these settings of a matrix run (``--setting``); the first of them in
            the scan's order is the reference. () means every setting.
        integrity_errors: integrity checks known to have found an error beside the run's own
            (the run's store is checked here; its errors turn the recommendation into
            "investigate first").
        integrity: the run's findings, when the caller computed them from this store in the
            same pass as its metrics (``probe ingest``); None: computed here.
    """
    from dataclasses import replace

    from mismatch_probe.report.integrity import run_integrity
    from mismatch_probe.report.settings import select_settings, setting_entries, setting_names

    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise ProbeError(
            f"{run_dir} is a file; probe report takes a run directory "
            "(probe metrics reads a Parquet file)"
        )
    if not run_dir.is_dir():
        raise ProbeError(f"{run_dir} is not a run directory")
    names = setting_names(run_dir, order)
    chosen = select_settings(run_dir, settings, order)
    reference = chosen[0]
    given = dict(computed or {})
    first = given.get(reference or names[0]) if names else None
    if integrity is None:
        integrity = run_integrity(run_dir, run)  # recomputed from the store
    errors = list(dict.fromkeys([*integrity_errors, *integrity.error_checks()]))
    ctx = load_run(run_dir, metrics_config, reference, first, run, errors)
    ctx = replace(ctx, integrity=integrity)
    entries = setting_entries(run_dir, metrics_config, given, names, errors, ctx.run)
    if settings and len(names) > 1:
        entries = [e for e in entries if e.label in chosen]
    return ctx, entries


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
    from mismatch_probe.report.integrity import write_integrity
    from mismatch_probe.report.markdown import render_markdown
    from mismatch_probe.report.plots import write_plots
    from mismatch_probe.report.routing import routing_markdown, write_routing_plots
    from mismatch_probe.report.settings import (
        setting_names,
        settings_markdown,
        settings_top_markdown,
    )
    from mismatch_probe.report.trend_plot import write_trend

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
    from mismatch_probe.report.trend import load_trend, render_table

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
