"""Attribution in the reports: ``attribution.json``, a terminal table, a report.md section, the
dominant source in words, and the links of several runs side by side (``probe compare``).

The numbers come from ``metrics.attribution`` over the token store alone (``probe report``
recomputes them and rewrites ``attribution.json``); the views read that file back. A run
scanned without ``--attribute`` has no rung columns and gets no attribution output at all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from mismatch_probe import store
from mismatch_probe.metrics.attribution import LINKS, compute_attribution
from mismatch_probe.report.markdown import escape, table

ATTRIBUTION_FILE = "attribution.json"
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


def compute(run_dir: Path) -> Attribution:
    """Attribution of every setting from ``tokens.parquet`` ({} without rung columns)."""
    return compute_attribution(store.resolve_tokens_path(Path(run_dir)))


def load(run_dir: Path) -> Attribution:
    """``attribution.json`` when present (else computed from the store), settings in the
    scan's order and links in path order (the file's keys are sorted)."""
    path = Path(run_dir) / ATTRIBUTION_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        return compute(run_dir)
    order = _setting_order(Path(run_dir))
    settings = sorted(data, key=lambda s: order.index(s) if s in order else len(order))
    return {s: _in_path_order(data[s]) for s in settings}


def _setting_order(run_dir: Path) -> list[str]:
    try:
        names = json.loads((run_dir / store.RUN_FILE).read_text()).get("settings", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str)]


def _in_path_order(result: dict[str, Any]) -> dict[str, Any]:
    links = result.get("links", {})
    ordered = {link.name: links[link.name] for link in LINKS if link.name in links}
    return {**result, "links": ordered}


def write(run_dir: Path, data: Attribution) -> dict[str, Path]:
    """Write ``attribution.json`` and ``plots/attribution.png``; remove stale ones when a run
    has no attribution (an earlier ``--attribute`` scan into the same directory)."""
    from mismatch_probe.report.attribution_plot import plot_attribution

    json_path, plot_path = run_dir / ATTRIBUTION_FILE, run_dir / "plots" / PLOT_FILE
    if not data:
        json_path.unlink(missing_ok=True)
        plot_path.unlink(missing_ok=True)
        return {}
    store.write_json(json_path, data)
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    return {"attribution": json_path, "plot_attribution": plot_attribution(data, plot_path)}


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


def render(run_dir: Path, console: Any) -> None:
    view = terminal_view(load(run_dir))
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


def outputs(run_dir: Path) -> tuple[dict[str, Path], str]:
    """Recompute from the store, write the files; returns (paths, report.md section)."""
    data = compute(run_dir)
    paths = write(run_dir, data)
    return paths, markdown_section(data, paths.get("plot_attribution"), run_dir)


def compare_rows(run_dirs: list[Path]) -> list[list[str]]:
    """``[link, share of run 1, share of run 2, ...]`` (each run's first setting; "—" when a
    link does not apply), plus a row naming each run's dominant link; [] when no run has any."""
    firsts = [next(iter(load(d).values()), None) for d in run_dirs]
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
