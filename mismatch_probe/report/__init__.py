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

REPORT_FILE = "report.md"
PLOTS_DIR = "plots"

__all__ = ["RunContext", "load_run", "render_terminal", "write_outputs", "write_report"]


def write_outputs(ctx: RunContext) -> dict[str, Path]:
    """Write ``metrics.json``, ``plots/<name>.png`` and ``report.md`` of a loaded run.

    Returns:
        ``{"metrics": ..., "report": ..., "plot_<name>": ...}`` paths.
    """
    from mismatch_probe.report.markdown import render_markdown
    from mismatch_probe.report.plots import write_plots

    paths = {"metrics": ctx.run_dir / METRICS_FILE, "report": ctx.run_dir / REPORT_FILE}
    store.write_json(paths["metrics"], ctx.json_dict())
    plots = write_plots(ctx, ctx.run_dir / PLOTS_DIR)
    paths["report"].write_text(render_markdown(ctx, plots))
    return {**paths, **{f"plot_{name}": path for name, (path, _) in plots.items()}}


def write_report(run_dir: Path, metrics_config: MetricsConfig | None = None) -> dict[str, Path]:
    """Load ``run_dir`` (recomputing the metrics if ``metrics_config`` differs from the stored
    one) and write its reports; see ``write_outputs``."""
    return write_outputs(load_run(run_dir, metrics_config))


def render_terminal(
    run_dir: Path, console: Console, metrics_config: MetricsConfig | None = None
) -> None:
    """Print the terminal report of ``run_dir`` on ``console``."""
    from mismatch_probe.report.terminal import render_run

    render_run(load_run(run_dir, metrics_config), console)
