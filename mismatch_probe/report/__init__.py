"""The reports stage: what people read and attach to pull requests.

Public API::

    from mismatch_probe.report import write_report, render_terminal
    paths = write_report(run_dir)          # metrics.json, plots/*.png, report.md
    render_terminal(run_dir, Console())    # the terminal report

Module map: ``context`` (load a run directory), ``verdicts`` (health checks as a table),
``sections`` (which metrics, grouped how, formatted how), ``terminal`` (rich), ``plots``
(matplotlib PNGs), ``markdown`` (report.md), ``compare`` (several runs side by side),
``check`` (bounds for CI). The reports read only the run directory: no model, no tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mismatch_probe import store
from mismatch_probe.report.context import METRICS_FILE, RunContext, load_run

if TYPE_CHECKING:
    from rich.console import Console

    from mismatch_probe.metrics import MetricsConfig
    from mismatch_probe.report.compare import Entry

REPORT_FILE = "report.md"
PLOTS_DIR = "plots"

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
    run_dir: Path, metrics_config: MetricsConfig | None = None
) -> tuple[RunContext, list[Entry]]:
    """Load what a report shows: the run (its reference setting when the store holds several)
    and, for a precision-matrix run, one ``Entry`` per setting (least mismatch first)."""
    from mismatch_probe.report.settings import setting_entries, setting_names

    run_dir = Path(run_dir)
    names = setting_names(run_dir)
    reference = names[0] if len(names) > 1 else None
    return load_run(run_dir, metrics_config, reference), setting_entries(run_dir, metrics_config)


def write_outputs(ctx: RunContext, entries: list[Entry] | None = None) -> dict[str, Path]:
    """Write ``metrics.json``, ``plots/<name>.png`` and ``report.md`` of a loaded run; with
    ``entries`` (the settings of a matrix run) the report ends with them side by side.

    Returns:
        ``{"metrics": ..., "report": ..., "plot_<name>": ...}`` paths.
    """
    from mismatch_probe.report.markdown import render_markdown
    from mismatch_probe.report.plots import write_plots
    from mismatch_probe.report.settings import settings_markdown

    paths = {"metrics": ctx.run_dir / METRICS_FILE, "report": ctx.run_dir / REPORT_FILE}
    store.write_json(paths["metrics"], ctx.json_dict())
    plots = write_plots(ctx, ctx.run_dir / PLOTS_DIR)
    from mismatch_probe.routing.report import routing_markdown

    text = render_markdown(ctx, plots)
    if entries:
        text += "\n" + settings_markdown(entries, ctx.run_dir)
    routing = routing_markdown(ctx.run_dir)
    text += "\n" + routing if routing else ""
    from mismatch_probe.report import attribution

    attribution_paths, attribution_md = attribution.outputs(ctx.run_dir)
    text += "\n" + attribution_md if attribution_md else ""
    store.write_text(paths["report"], text)
    plot_paths = {f"plot_{name}": path for name, (path, _) in plots.items()}
    return {**paths, **plot_paths, **attribution_paths}


def render(ctx: RunContext, entries: list[Entry] | None, console: Console) -> None:
    """The terminal report, then the settings side by side for a matrix run."""
    from mismatch_probe.report import attribution
    from mismatch_probe.report.settings import render_settings
    from mismatch_probe.report.terminal import render_run

    render_run(ctx, console)
    if entries:
        render_settings(entries, console)
    attribution.render(ctx.run_dir, console)


def write_report(run_dir: Path, metrics_config: MetricsConfig | None = None) -> dict[str, Path]:
    """Load ``run_dir`` (recomputing the metrics if ``metrics_config`` differs from the stored
    one) and write its reports; see ``write_outputs``."""
    return write_outputs(*load_report(run_dir, metrics_config))


def render_terminal(
    run_dir: Path, console: Console, metrics_config: MetricsConfig | None = None
) -> None:
    """Print the terminal report of ``run_dir`` on ``console``."""
    render(*load_report(run_dir, metrics_config), console)
