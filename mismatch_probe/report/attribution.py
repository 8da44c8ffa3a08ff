"""Attribution in the reports: a terminal table, a report.md section, the plot, the dominant
source in words, and the links of several runs side by side (``probe compare``).

The numbers are the view's (``RunContext.attribution``: computed by ``metrics.attribution`` from
the token store when the scan finishes, read back from ``attribution.json`` by
``rundir.attribution``). A run scanned without ``--attribute`` has none and gets no attribution
output at all.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from mismatch_probe.metrics.attribution import LINKS
from mismatch_probe.report.markdown import escape, table

PLOT_FILE = "attribution.png"
LINK_WORDS = {link.name: link.words for link in LINKS}
COLUMNS = (  # (stat, header, format)
    ("k3", "k3", "{:.3g}"),
    ("mean_abs", "mean |r|", "{:.3g}"),
    ("p99_abs", "p99 |r|", "{:.3g}"),
    ("max_abs", "max |r|", "{:.3g}"),
    ("bitwise_identical_fraction", "bitwise =", "{:.1%}"),
    ("share", "share", "{:.1%}"),
)
PATH_NOTE = (
    "Links follow the attribution spec's path: L0 engine decode → L1 engine prefill (batched) "
    "→ L2 engine prefill (one sequence per step) → L3 transformers at the rollout dtype → "
    "L4 transformers at the training dtype (→ routing replay, → L5 stale checkpoint); another "
    "order of rungs would split the total differently. share = mmean(r²) of a link over the sum "
    "for all links: cross terms are left out, so shares describe magnitudes, not a variance split."
)
Attribution = dict[str, dict[str, Any]]  # setting -> {"links": {...}, "dominant": ...}


def write_plot(data: Attribution, plots_dir: Path) -> Path | None:
    """``plots/attribution.png``; a stale one is removed when the run has no attribution (an
    earlier ``--attribute`` scan into the same directory)."""
    from mismatch_probe.report.attribution_plot import plot_attribution

    path = plots_dir / PLOT_FILE
    if not data:
        path.unlink(missing_ok=True)
        return None
    plots_dir.mkdir(parents=True, exist_ok=True)
    return plot_attribution(data, path)


def _dtype(setting: str, side: str) -> str:
    match = re.search(rf"{side}=(\w+)", setting)
    return match.group(1) if match else "?"


def dominant_line(setting: str, result: dict[str, Any]) -> str:
    """e.g. ``dominant source: engine vs transformers kernels at bf16, 54% of the squared
    log-ratio``."""
    name = result.get("dominant")
    if name is None:
        return "dominant source: none (every link is exactly zero)"
    words = LINK_WORDS.get(name, name)
    rollout, train = _dtype(setting, "rollout"), _dtype(setting, "train")
    detail = {
        "kernels": f" at {rollout}",
        "precision": f" ({rollout} vs {train})",
        "batch": f" at {rollout}",
    }.get(name, "")
    share = result["links"][name]["share"]
    return f"dominant source: {words}{detail}, {share:.0%} of the squared log-ratio"


def terminal_table(data: Attribution) -> Table:
    """setting | link | k3 | mean |r| | p99 |r| | max |r| | bitwise = | share."""
    out = Table(
        title="Attribution (links along the spec's path)",
        title_justify="left",
        box=None,
        pad_edge=False,
        header_style="bold",
    )
    out.add_column("setting", no_wrap=True)
    out.add_column("link", no_wrap=True)
    for _, header, _ in COLUMNS:
        out.add_column(header, justify="right", no_wrap=True)
    for setting, result in data.items():
        for i, (name, stats) in enumerate(result["links"].items()):
            cells = [fmt.format(stats[key]) for key, _, fmt in COLUMNS]
            out.add_row(setting if i == 0 else "", name, *cells)
    return out


def terminal_view(data: Attribution) -> list[RenderableType]:
    """The table, one dominant-source line per setting, and the path note ([] when empty)."""
    if not data:
        return []
    lines = [Text(f"{s}: {dominant_line(s, r)}") for s, r in data.items()]
    return [terminal_table(data), *lines, Text(PATH_NOTE, style="dim")]


def render(data: Attribution, console: Any) -> None:
    view = terminal_view(data)
    if view:
        console.print(Group(*view))


def markdown_section(data: Attribution, plot: Path | None, base: Path) -> str:
    """``## Attribution``: the path note, one table per setting, the dominant source, the plot."""
    if not data:
        return ""
    lines = ["## Attribution", "", escape(PATH_NOTE), ""]
    header = ["link", "what it isolates", *(escape(h) for _, h, _ in COLUMNS)]
    for setting, result in data.items():
        rows = [
            [f"`{name}`", escape(LINK_WORDS.get(name, name))]
            + [fmt.format(stats[key]) for key, _, fmt in COLUMNS]
            for name, stats in result["links"].items()
        ]
        lines += [f"### {escape(setting)}", "", escape(dominant_line(setting, result)), ""]
        lines += [*table(header, rows, "ll" + "r" * len(COLUMNS)), ""]
    if plot is not None:
        lines += [f"![attribution]({plot.relative_to(base).as_posix()})", ""]
    return "\n".join(lines)


def compare_rows(runs: list[Attribution]) -> list[list[str]]:
    """``[link, share of run 1, share of run 2, ...]`` (each run's first setting; "—" when a
    link does not apply), plus a row naming each run's dominant link; [] when no run has any."""
    firsts = [next(iter(data.values()), None) for data in runs]
    if not any(firsts):
        return []
    rows = []
    for link in LINKS:
        cells = [_share_cell(f, link.name) for f in firsts]
        if any(c != "—" for c in cells):
            rows.append([link.name, *cells])
    rows.append(["dominant", *((f or {}).get("dominant") or "—" for f in firsts)])
    return rows


def _share_cell(result: dict[str, Any] | None, link: str) -> str:
    stats = (result or {}).get("links", {}).get(link)
    return "—" if stats is None else f"{stats['share']:.1%} (k3 {stats['k3']:.3g})"


def compare_table(labels: list[str], rows: list[list[str]]) -> Table:
    out = Table(title="Attribution: share of each link (k3)", title_justify="left")
    out.add_column("link")
    for label in labels:
        out.add_column(label, justify="right")
    for row in rows:
        out.add_row(*row)
    return out


def compare_markdown(labels: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    header = ["link", *(escape(label) for label in labels)]
    body = [[f"`{row[0]}`", *row[1:]] for row in rows]
    return ["## Attribution", "", escape(PATH_NOTE), "", *table(header, body), ""]
