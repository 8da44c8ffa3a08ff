"""``probe compare``: several runs (or settings) side by side, against the first one.

The core works on ``Entry`` records (label, flat metrics, curves), so it compares runs from
different directories or, later, the settings of one precision-matrix run alike:
``compare_rows`` gives a row per key metric with each value's ratio to the first entry;
``overlay_plots`` draws the ratio histograms, position curves and F(tau) of every entry in one
figure per kind. ``run_differences`` says what differs between runs (model, prompts, sampling),
which the reports print as a warning: such runs measure different things.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.report.context import RunContext, load_run
from mismatch_probe.report.markdown import escape, table
from mismatch_probe.report.plots import (
    draw_f_tau,
    draw_position,
    draw_ratio_hist,
    new_figure,
    save,
)
from mismatch_probe.report.sections import KEY_METRICS, fmt, visible

# What must match for runs to measure the same thing: (what, path in run.json).
IDENTITY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("model", "name")),
    ("model config", ("model", "config_sha256")),
    ("prompts", ("prompts", "sha256")),  # the token ids of the prompts, as encoded
    ("prompts file", ("prompts", "path")),
    ("prompt count", ("prompts", "count")),
    ("chat template", ("prompts", "chat")),
    ("samples per prompt", ("config", "samples_per_prompt")),
    ("temperature", ("sampling", "temperature")),
    ("top_p", ("sampling", "top_p")),
    ("top_k", ("sampling", "top_k")),
    ("max tokens", ("sampling", "max_tokens")),
    ("seed", ("sampling", "seed")),
    ("log-probs mode", ("sampling", "logprobs_mode")),
)
# name -> (title, drawer) of the overlaid figures; the file is compare_<name>.png.
OVERLAYS: dict[str, tuple[str, Any]] = {
    "ratio_hist": ("Token IS ratio ρ = p_train / p_rollout, per run", draw_ratio_hist),
    "position": ("Mean |log ρ| by response position, per run", draw_position),
    "f_tau": ("F(τ): share of tokens whose ratio exceeds τ either way", draw_f_tau),
}


@dataclass(frozen=True)
class Entry:
    """One column of a comparison: a run, or one setting of a run."""

    label: str
    metrics: dict[str, float]
    curves: dict[str, Any]
    tables: dict[str, Any] = field(default_factory=dict)  # context.decision_tables


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


def _lookup(run: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        run = run.get(part, {}) if isinstance(run, dict) else {}
    return None if run == {} else run


def _short(value: Any, width: int = 24) -> str:
    """A long value (a hash, a deep path) cut to its last ``width`` characters."""
    text = str(value)
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def run_differences(labels: list[str], runs: list[dict[str, Any]]) -> list[str]:
    """One line per ``IDENTITY`` field whose value is not the same in every run."""
    lines = []
    for what, path in IDENTITY:
        values = [_lookup(run, path) for run in runs]
        if len({repr(v) for v in values}) > 1:
            pairs = zip(labels, values, strict=True)
            each = "; ".join(f"{label}: {_short(value)}" for label, value in pairs)
            lines.append(f"{what} differs ({each})")
    return lines


def unique_labels(runs: list[RunContext]) -> list[str]:
    """Settings when they tell the runs apart, else directory names, else numbers."""
    for labels in ([r.label for r in runs], [r.run_dir.name for r in runs]):
        if len(set(labels)) == len(labels):
            return labels
    return [f"run {i}: {r.run_dir.name}" for i, r in enumerate(runs, 1)]


@dataclass(frozen=True)
class Comparison:
    """Loaded runs, their entries and what differs between them."""

    runs: tuple[RunContext, ...]
    entries: tuple[Entry, ...]
    warnings: tuple[str, ...]

    @property
    def rows(self) -> list[CompareRow]:
        return compare_rows(list(self.entries))


def default_out_dir() -> Path:
    """``reports/compare-<timestamp>/``, next to the scans' default directories."""
    return Path("reports") / f"compare-{datetime.now():%Y%m%d-%H%M%S}"


def load_comparison(run_dirs: list[Path]) -> Comparison:
    """Load every run (its stored metrics); at least two are needed."""
    if len(run_dirs) < 2:
        raise ProbeError("compare needs at least two run directories")
    runs = [load_run(d) for d in run_dirs]
    labels = unique_labels(runs)
    entries = tuple(Entry(lab, r.metrics, r.curves) for lab, r in zip(labels, runs, strict=True))
    warnings = tuple(run_differences(labels, [r.run for r in runs]))
    return Comparison(tuple(runs), entries, warnings)


def _cell(key: str, value: float | None) -> str:
    return "—" if value is None else fmt(key, value)


def _ratio_cell(value: float | None) -> str:
    return "—" if value is None else f"×{value:.3g}"


def row_cells(row: CompareRow) -> list[str]:
    """First value, then (value, ratio to the first) for each later entry."""
    cells = [_cell(row.key, row.values[0])]
    for value, r in zip(row.values[1:], row.ratios[1:], strict=True):
        cells += [_cell(row.key, value), _ratio_cell(r)]
    return cells


def comparison_table(entries: list[Entry], rows: list[CompareRow]) -> Table:
    """metric | first | second | ×ratio | ...: the ratio of each later entry to the first."""
    table = Table(title="Key metrics (×: ratio to the first run)", title_justify="left")
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
    parts: list[RenderableType] = [
        Text(f"⚠ {visible(w)}", style="yellow") for w in comparison.warnings
    ]
    parts.append(comparison_table(list(comparison.entries), comparison.rows))
    from mismatch_probe.report import attribution

    labels = [e.label for e in comparison.entries]
    links = attribution.compare_rows([r.run_dir for r in comparison.runs])
    parts += [attribution.compare_table(labels, links)] if links else []
    console.print(Group(*parts))


def overlay_plots(entries: list[Entry], out_dir: Path) -> dict[str, tuple[Path, str]]:
    """One PNG per ``OVERLAYS`` kind with every entry's curve; name -> (path, title)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, (title, draw) in OVERLAYS.items():
        fig, ax = new_figure()
        for e in entries:
            draw(ax, e.curves, label=e.label)
        ax.legend(fontsize=8)
        subtitle = f"{len(entries)} runs; first: {entries[0].label}"
        written[name] = (save(fig, out_dir / f"compare_{name}.png", title, subtitle), title)
    return written


def comparison_markdown(
    comparison: Comparison, plots: dict[str, tuple[Path, str]], base: Path
) -> str:
    """``compare.md``: the runs, the warnings, the table with ratios, the overlaid plots."""
    entries, rows = list(comparison.entries), comparison.rows
    runs = [
        [escape(e.label), escape(str(r.run_dir))]
        for e, r in zip(entries, comparison.runs, strict=True)
    ]
    lines = ["# Mismatch comparison", "", *table(["run", "directory"], runs), ""]
    lines += [f"> **Warning:** {escape(w)}" for w in comparison.warnings]
    lines += [""] if comparison.warnings else []
    header = ["metric"]
    for i, e in enumerate(entries):
        header += [escape(e.label)] + ([f"× {escape(entries[0].label)}"] if i else [])
    body = [[f"`{row.key}`", *row_cells(row)] for row in rows]
    lines += ["## Key metrics", "", *table(header, body, "l" + "r" * (len(header) - 1)), ""]
    from mismatch_probe.report import attribution

    labels = [e.label for e in entries]
    links = attribution.compare_rows([r.run_dir for r in comparison.runs])
    lines += attribution.compare_markdown(labels, links)
    lines += ["## Plots", ""]
    for path, title in plots.values():
        lines += [f"![{escape(title)}]({path.relative_to(base).as_posix()})", ""]
    return "\n".join(lines)


def write_comparison(comparison: Comparison, out_dir: Path) -> dict[str, Path]:
    """Write the overlaid plots, ``compare.md`` and ``compare.html`` into ``out_dir``; returns
    their paths."""
    from mismatch_probe.report.html import write_html

    store.writable_dir(out_dir, "--out")
    plots = overlay_plots(list(comparison.entries), out_dir)
    report = out_dir / store.COMPARE_FILE
    text = comparison_markdown(comparison, plots, out_dir)
    store.write_text(report, text)
    html = write_html(text, report, "Mismatch comparison")
    plot_paths = {f"plot_{name}": path for name, (path, _) in plots.items()}
    return {"report": report, "html": html, **plot_paths}
