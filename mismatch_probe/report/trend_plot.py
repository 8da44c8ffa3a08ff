"""``plots/trend.png``: the trend metrics against training step (log y, each with its
threshold as a dashed line of its colour and its failing steps ringed in red), and below, the
presets' token masked fractions. Built like ``report.plots`` (Agg ``Figure``, no pyplot).

Imports ``trend_table`` (the trend's text), never the other way round: ``write_trend`` (the
report's trend section with its plot) lives here."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mismatch_probe.report.plots import DPI, drawable
from mismatch_probe.report.png import save_png
from mismatch_probe.report.trend_table import label, render_markdown
from mismatch_probe.rundir.context import RunContext
from mismatch_probe.rundir.trend import Trend, threshold_of

PLOT_NAME = "trend"
FIGSIZE = (7.5, 6.0)
OFFSET = {"token_mult_prob_error": 1.0}  # drawn as value - 1 (1.0 is identity) on a log axis


def write_trend(ctx: RunContext, plots_dir: Path, base: Path) -> tuple[str, Path | None]:
    """The trend section of a run's view (``ctx.trend``) with its plot written into
    ``plots_dir`` (linked relative to ``base``); ``("", None)`` for a run without steps."""
    if ctx.trend is None:
        return "", None
    plots_dir.mkdir(parents=True, exist_ok=True)
    plot = write_trend_plot(ctx.trend, plots_dir / f"{PLOT_NAME}.png", ctx.label)
    return render_markdown(ctx.trend, plot, base), plot


def write_trend_plot(trend: Trend, path: Path, subtitle: str) -> Path:
    from matplotlib.figure import Figure

    masked = [m for m in trend.series if m.startswith("presets/")]
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    axes = fig.subplots(2 if masked else 1, 1, sharex=True, squeeze=False)[:, 0]
    steps = np.asarray(trend.steps, dtype=float)
    top = axes[0]
    for i, metric in enumerate(m for m in trend.series if m not in masked):
        color = f"C{i}"
        shift = OFFSET.get(metric, 0.0)
        values = drawable(np.asarray(trend.series[metric], dtype=float) - shift)  # 1e300 too
        name = f"{metric} − 1" if shift else metric
        top.plot(steps, np.where(values > 0, values, np.nan), marker=".", color=color, label=name)
        check = threshold_of(metric)
        if check is not None and check.rule == "max":
            top.axhline(check.bounds[0] - shift, color=color, linestyle="--", linewidth=0.9)
        bad = [k for k, s in enumerate(trend.steps) if s in trend.failing.get(metric, set())]
        if bad:
            top.scatter(steps[bad], np.where(values[bad] > 0, values[bad], np.nan), s=60,
                        facecolors="none", edgecolors="red", linewidths=1.4)  # fmt: skip
    top.set_yscale("log")
    top.set_ylabel("value (log scale); dashed: threshold")
    top.scatter([], [], s=60, facecolors="none", edgecolors="red", label="fails its threshold")
    top.legend(fontsize=7.5, loc="best")
    if masked:
        low = axes[1]
        for metric in masked:
            low.plot(steps, drawable(trend.series[metric]), marker=".", label=label(metric))
        low.set_ylabel("share of tokens masked")
        low.set_ylim(bottom=0.0)
        low.legend(fontsize=7.5, loc="best")
    axes[-1].set_xlabel("training step")
    fig.suptitle("Mismatch against training step", fontsize=11, fontweight="bold")
    top.set_title(subtitle, fontsize=8.5, color="0.35")
    return save_png(fig, path, DPI)
