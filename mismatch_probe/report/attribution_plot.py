"""``plots/attribution.png``: one horizontal bar per link, a bar group per setting.

The bar length is the link's mean ``|r|`` (nats); the axis is logarithmic when the non-zero
values span more than ``LOG_SPAN`` (two decades). A link that is exactly zero gets no bar but a
"0" label, so it still shows. The label of each bar gives its share of the squared log-ratio.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch_probe.report.plots import DPI, FIGSIZE
from mismatch_probe.report.png import save_png

LOG_SPAN = 100.0
ROW_INCHES = 0.28  # height per bar
STAT = "mean_abs"
LABEL_ROOM_LOG, LABEL_ROOM_LINEAR = 4.0, 1.15  # x-axis end, relative to the longest bar


def _rows(data: dict[str, dict[str, Any]]) -> list[tuple[str, str, float, float]]:
    """(setting, link, mean |r|, share) top to bottom, settings in order, links in path order."""
    return [
        (setting, name, float(stats[STAT]), float(stats["share"]))
        for setting, result in data.items()
        for name, stats in result["links"].items()
    ]


def plot_attribution(data: dict[str, dict[str, Any]], path: Path) -> Path:
    """Draw and save the plot; returns ``path``."""
    from matplotlib.figure import Figure

    rows = _rows(data)
    height = max(FIGSIZE[1], 1.2 + ROW_INCHES * (len(rows) + len(data)))
    fig = Figure(figsize=(FIGSIZE[0], height), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    positive = [v for _, _, v, _ in rows if v > 0]
    log = bool(positive) and max(positive) / min(positive) > LOG_SPAN
    colours = _palette(len(data))
    zero_at = min(positive) if log and positive else 0.0  # where a "0" label sits
    y, ticks, labels = 0.0, [], []
    for i, setting in enumerate(data):
        labelled = False
        for s, name, value, share in rows:
            if s != setting:
                continue
            if value > 0:
                legend = None if labelled else setting
                ax.barh(y, value, color=colours[i], label=legend)
                labelled = True
            ax.annotate(
                f"{share:.0%}" if value > 0 else "0",
                (value if value > 0 else zero_at, y),
                xytext=(3, 0), textcoords="offset points", va="center", fontsize=7,
            )  # fmt: skip
            ticks.append(y)
            labels.append(name)
            y -= 1.0
        y -= 0.6  # gap between settings
    ax.set_yticks(ticks, labels, fontsize=8)
    if log:
        ax.set_xscale("log")
    if positive:  # room for the share labels right of the longest bar
        ax.set_xlim(right=max(positive) * (LABEL_ROOM_LOG if log else LABEL_ROOM_LINEAR))
    ax.set_xlabel("mean |r| of the link (nats)" + (", log scale" if log else ""))
    if positive:
        fig.legend(fontsize=7, loc="outside lower center", ncols=min(len(data), 2))
    fig.suptitle("Where the mismatch comes from", fontsize=11, fontweight="bold")
    ax.set_title("bar label: share of the squared log-ratio (links along the spec's path)",
                 fontsize=8.5, color="0.35")  # fmt: skip
    return save_png(fig, path, DPI)


def _palette(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]
