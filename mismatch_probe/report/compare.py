"""``probe compare``: several runs (or settings) side by side, against the first one.

Renders a ``gate.compare.Comparison`` (the runs loaded, paired by setting, and what differs
between them). It works on ``Entry`` records (label, flat metrics, curves), so it shows runs from
different directories or the settings of one precision-matrix run alike: ``compare_rows`` gives a
row per key metric with each value's ratio to the first entry; ``overlay_plots`` draws the ratio
histograms, position curves and F(tau) of every entry in one figure per kind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from mismatch_probe import store
from mismatch_probe.gate.compare import Comparison, SettingPair
from mismatch_probe.report.markdown import escape, table
from mismatch_probe.report.plots import (
    draw_f_tau,
    draw_position,
    draw_ratio_hist,
    new_figure,
    save,
)
from mismatch_probe.report.sections import KEY_METRICS, SIGNED, fmt, visible
from mismatch_probe.rundir.context import Entry

# name -> (title, drawer) of the overlaid figures; the file is compare_<name>.png.
OVERLAYS: dict[str, tuple[str, Any]] = {
    "ratio_hist": ("Token IS ratio ρ = p_train / p_rollout, per run", draw_ratio_hist),
    "position": ("Mean |log ρ| by response position, per run", draw_position),
    "f_tau": ("F(τ): share of tokens whose ratio exceeds τ either way", draw_f_tau),
}


@dataclass(frozen=True)
class CompareRow:
    """A key metric across entries; ``ratios[i] = values[i] / values[0]`` (None if undefined)."""

    key: str
    meaning: str
    values: tuple[float | None, ...]
    ratios: tuple[float | None, ...]


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def compare_rows(entries: list[Entry]) -> list[CompareRow]:
    """A row per ``KEY_METRICS`` key that at least one entry has."""
    rows = []
    for key, meaning in KEY_METRICS:
        values = tuple(e.metrics.get(key) for e in entries)
        if any(v is not None for v in values):
            ratios = tuple(ratio(v, values[0]) for v in values)
            rows.append(CompareRow(key, meaning, values, ratios))
    return rows


def _cell(key: str, value: float | None) -> str:
    return "—" if value is None else fmt(key, value)


def _ratio_cell(value: float | None) -> str:
    return "—" if value is None else f"×{value:.3g}"


def _difference_cell(value: float | None, base: float | None) -> str:
    return "—" if value is None or base is None else f"Δ{value - base:+.3g}"


def row_cells(row: CompareRow) -> list[str]:
    """First value, then (value, ratio to the first) for each later entry; a signed metric's
    (``sections.SIGNED``, near 0, either sign) change is its difference, ``Δ-0.02``."""
    base = row.values[0]
    cells = [_cell(row.key, base)]
    for value, r in zip(row.values[1:], row.ratios[1:], strict=True):
        change = _difference_cell(value, base) if row.key in SIGNED else _ratio_cell(r)
        cells += [_cell(row.key, value), change]
    return cells


def comparison_table(entries: list[Entry], rows: list[CompareRow], title: str = "") -> Table:
    """metric | first | second | ×ratio | ...: the ratio of each later entry to the first."""
    where = f" of {title}" if title else ""
    table = Table(
        title=f"Key metrics{where} (×: ratio to the first run; Δ: difference, signed metrics)",
        title_justify="left",
    )
    table.add_column("metric")
    for i, e in enumerate(entries):
        table.add_column(Text(visible(e.label)), justify="right")
        if i:
            table.add_column("×", justify="right")
    for row in rows:
        table.add_row(row.key, *row_cells(row))
    return table


def render_comparison(comparison: Comparison, console: Console) -> None:
    """The warnings (if any) and the comparison table."""
    from mismatch_probe.report.integrity import runs_text

    labels = [e.label for e in comparison.entries]
    integrity = runs_text(
        [(lab, r.integrity) for lab, r in zip(labels, comparison.runs, strict=True)]
    )
    parts: list[RenderableType] = [integrity] if integrity else []
    parts += [Text(f"⚠ {visible(w)}", style="yellow") for w in comparison.warnings]
    if comparison.pairs:
        n = len(comparison.pairs)
        parts.append(Text(f"{n} setting{'s' if n > 1 else ''} paired by name", style="bold"))
    for pair in comparison.all_pairs:
        rows = compare_rows(list(pair.entries))
        parts.append(comparison_table(list(pair.entries), rows, visible(pair.title)))
    parts += [Text(f"· {visible(line)}", style="yellow") for line in comparison.unpaired_lines()]
    from mismatch_probe.report import attribution

    labels = [e.label for e in comparison.entries]
    links = attribution.compare_rows([r.attribution for r in comparison.runs])
    parts += [attribution.compare_table(labels, links)] if links else []
    console.print(Group(*parts))


def overlay_plots(
    entries: list[Entry], out_dir: Path, setting: str | None = None, what: str = "runs"
) -> dict[str, tuple[Path, str]]:
    """One PNG per ``OVERLAYS`` kind with every entry's curve; name -> (path, title).
    ``what`` the entries are (``runs``, ``settings``) and ``setting`` (the one the runs are
    compared on) go into the subtitle."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, (title, draw) in OVERLAYS.items():
        fig, ax = new_figure()
        for e in entries:
            draw(ax, e.curves, label=visible(e.label))  # a control character: no glyph
        ax.legend(fontsize=8)
        subtitle = f"{len(entries)} {what}; first: {entries[0].label}"
        subtitle = visible(f"{setting}: {subtitle}" if setting else subtitle)
        written[name] = (save(fig, out_dir / f"compare_{name}.png", title, subtitle), title)
    return written


def _key_metrics_lines(pair: SettingPair, heading: str) -> list[str]:
    entries = list(pair.entries)
    header = ["metric"]
    for i, e in enumerate(entries):
        header += [escape(e.label)] + ([f"× {escape(entries[0].label)}"] if i else [])
    body = [[f"`{row.key}`", *row_cells(row)] for row in compare_rows(entries)]
    return [heading, "", *table(header, body, "l" + "r" * (len(header) - 1)), ""]


def comparison_markdown(
    comparison: Comparison, plots: list[dict[str, tuple[Path, str]]], base: Path
) -> str:
    """``compare.md``: the runs (directory names, no absolute path), the warnings, a table with
    ratios per setting paired (and the settings only some runs hold), the overlaid plots
    (``plots[i]``: pair i's)."""
    runs = [
        [escape(e.label), escape(r.run_dir.name)]
        for e, r in zip(comparison.entries, comparison.runs, strict=True)
    ]
    from mismatch_probe.report.integrity import runs_markdown

    lines = ["# Mismatch comparison", ""]
    lines += runs_markdown(
        [(e.label, r.integrity) for e, r in zip(comparison.entries, comparison.runs, strict=True)]
    )
    lines += [*table(["run", "directory"], runs), ""]
    lines += [f"> **Warning:** {escape(w)}" for w in comparison.warnings]
    lines += [""] if comparison.warnings else []
    pairs = comparison.all_pairs
    if comparison.pairs:
        lines += [f"{len(pairs)} setting(s) paired by name, each compared on its own.", ""]
    for pair in pairs:
        where = f" of {escape(pair.title)}" if pair.setting is not None else ""
        lines += _key_metrics_lines(pair, f"## Key metrics{where}")
    if comparison.unpaired:
        lines += ["## Settings only some runs hold", ""]
        lines += [f"- {escape(line)}" for line in comparison.unpaired_lines()] + [""]
    from mismatch_probe.report import attribution

    labels = [e.label for e in comparison.entries]
    links = attribution.compare_rows([r.attribution for r in comparison.runs])
    lines += attribution.compare_markdown(labels, links)
    lines += ["## Plots", ""]
    for pair, drawn in zip(pairs, plots, strict=True):
        if pair.setting is not None and len(pairs) > 1:
            lines += [f"### {escape(pair.title)}", ""]
        for path, title in drawn.values():
            lines += [f"![{escape(title)}]({path.relative_to(base).as_posix()})", ""]
    return "\n".join(lines)


def _slug(text: str) -> str:
    """A setting as a directory name: ``rollout=bf16,kv=fp8_train=fp32``."""
    return re.sub(r"[^A-Za-z0-9=.,-]+", "_", text).strip("_") or "setting"


def write_comparison(comparison: Comparison, out_dir: Path) -> dict[str, Path]:
    """Write the overlaid plots (``settings/<setting>/`` for each of several settings paired),
    ``compare.md`` and ``compare.html`` into ``out_dir``; returns their paths."""
    from mismatch_probe.report.html import write_html
    from mismatch_probe.report.png import kept

    store.writable_dir(out_dir, "--out")
    pairs = comparison.all_pairs
    with kept() as pngs:  # the PNGs drawn, for the HTML to embed
        plots = []
        for pair in pairs:
            where = out_dir if len(pairs) == 1 else out_dir / "settings" / _slug(str(pair.setting))
            plots.append(overlay_plots(list(pair.entries), where, pair.setting))
        report = out_dir / store.COMPARE_FILE
        text = comparison_markdown(comparison, plots, out_dir)
        store.write_text(report, text)
        html = write_html(text, report, "Mismatch comparison", pngs)
    plot_paths = {}
    for i, drawn in enumerate(plots):
        prefix = "plot_" if len(plots) == 1 else f"plot_{i + 1}_"
        plot_paths.update({f"{prefix}{name}": path for name, (path, _) in drawn.items()})
    return {"report": report, "html": html, **plot_paths}
