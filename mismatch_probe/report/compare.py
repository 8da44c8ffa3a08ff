"""``probe compare``: several runs (or settings) side by side, against the first one.

The core works on ``Entry`` records (label, flat metrics, curves), so it compares runs from
different directories or, later, the settings of one precision-matrix run alike:
``compare_rows`` gives a row per key metric with each value's ratio to the first entry;
``overlay_plots`` draws the ratio histograms, position curves and F(tau) of every entry in one
figure per kind. ``run_differences`` says what differs between runs (model, prompts, sampling),
which the reports print as a warning: such runs measure different things.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
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
    # GPU names, or the CPU's kernel flags (vLLM's CPU kernels differ on AVX2, AVX-512, AMX)
    ("hardware", ("hardware", "compute")),
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
class SettingPair:
    """One setting across the runs compared (``setting`` None: runs of one setting each).

    ``runs[i]`` is run i's context restricted to the setting; ``entries[i]`` its entry,
    labelled with the run's label (the setting is the pair's title)."""

    setting: str | None
    runs: tuple[RunContext, ...]
    entries: tuple[Entry, ...]

    @property
    def rows(self) -> list[CompareRow]:
        return compare_rows(list(self.entries))

    @property
    def title(self) -> str:
        return f"setting {self.setting}" if self.setting is not None else ""


@dataclass(frozen=True)
class Comparison:
    """Loaded runs, their entries and what differs between them.

    ``runs`` / ``entries``: the first pair's (the only pair when no run holds several settings);
    ``pairs``: every setting the runs share, in the first run's order; ``unpaired``: each
    setting only some runs hold, with the labels of those runs."""

    runs: tuple[RunContext, ...]
    entries: tuple[Entry, ...]
    warnings: tuple[str, ...]
    pairs: tuple[SettingPair, ...] = ()
    unpaired: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def rows(self) -> list[CompareRow]:
        return compare_rows(list(self.entries))

    @property
    def all_pairs(self) -> tuple[SettingPair, ...]:
        return self.pairs or (SettingPair(None, self.runs, self.entries),)

    def unpaired_lines(self) -> list[str]:
        """``rollout=fp16 | train=fp32: only in a`` for each setting not every run holds."""
        return [f"{s}: only in {', '.join(labels)}" for s, labels in self.unpaired]


def default_out_dir() -> Path:
    """``reports/compare-<timestamp>/``, next to the scans' default directories."""
    return Path("reports") / f"compare-{datetime.now():%Y%m%d-%H%M%S}"


def load_comparison(run_dirs: list[Path], settings: tuple[str, ...] = ()) -> Comparison:
    """Load every run (its stored metrics); at least two are needed. When a run holds several
    settings (or ``settings`` are asked for), settings are paired by name across the runs: one
    ``SettingPair`` per setting every run holds, the others listed as ``unpaired``.

    Raises:
        ProbeError: fewer than two runs, a ``--setting`` no run holds, no setting in common.
    """
    from mismatch_probe.report.context import setting_names

    if len(run_dirs) < 2:
        raise ProbeError("compare needs at least two run directories")
    names = [setting_names(Path(d)) if Path(d).is_dir() else [] for d in run_dirs]
    if not settings and all(len(n) < 2 for n in names):
        runs = [_with_integrity(load_run(d)) for d in run_dirs]
        labels = unique_labels(runs)
        entries = tuple(
            Entry(lab, r.metrics, r.curves) for lab, r in zip(labels, runs, strict=True)
        )
        warnings = tuple(run_differences(labels, [r.run for r in runs]))
        return Comparison(tuple(runs), entries, warnings)
    return _load_pairs([Path(d) for d in run_dirs], names, settings)


def _load_pairs(
    run_dirs: list[Path], names: list[list[str]], wanted: tuple[str, ...]
) -> Comparison:
    """Settings paired by name (see ``load_comparison``); runs labelled by directory."""
    from mismatch_probe.report.context import _run_metadata

    order = list(dict.fromkeys(s for n in names for s in n))
    missing = [w for w in wanted if w not in order]
    if missing:
        raise ProbeError(f"--setting {missing[0]!r}: none of the runs holds it")
    order = [s for s in order if s in wanted] if wanted else order
    labels = _dir_labels(run_dirs)
    metas = [_run_metadata(d) for d in run_dirs]
    pairs, unpaired = [], []
    for setting in order:
        holders = [i for i, n in enumerate(names) if setting in n]
        if len(holders) < len(run_dirs):
            unpaired.append((setting, tuple(labels[i] for i in holders)))
            continue
        runs = tuple(load_run(d, setting=setting) for d in run_dirs)
        entries = tuple(
            Entry(lab, r.metrics, r.curves) for lab, r in zip(labels, runs, strict=True)
        )
        pairs.append(SettingPair(setting, runs, entries))
    if not pairs:
        held = "; ".join(
            f"{lab}: {', '.join(n) or 'none'}" for lab, n in zip(labels, names, strict=True)
        )
        raise ProbeError(f"the runs share no setting ({held})")
    warnings = tuple(run_differences(labels, metas))
    first = tuple(_with_integrity(r) for r in pairs[0].runs)  # whole runs: one pass each
    return Comparison(first, pairs[0].entries, warnings, tuple(pairs), tuple(unpaired))


def _with_integrity(run: RunContext) -> RunContext:
    """The run with its data-integrity findings, recomputed from its store."""
    from mismatch_probe.report.integrity import run_integrity

    return replace(run, integrity=run_integrity(run.run_dir, run.run))


def _dir_labels(run_dirs: list[Path]) -> list[str]:
    labels = [d.name for d in run_dirs]
    if len(set(labels)) == len(labels):
        return labels
    return [f"run {i}: {d.name}" for i, d in enumerate(run_dirs, 1)]


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


def comparison_table(entries: list[Entry], rows: list[CompareRow], title: str = "") -> Table:
    """metric | first | second | ×ratio | ...: the ratio of each later entry to the first."""
    where = f" of {title}" if title else ""
    table = Table(title=f"Key metrics{where} (×: ratio to the first run)", title_justify="left")
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
        parts.append(comparison_table(list(pair.entries), pair.rows, visible(pair.title)))
    parts += [Text(f"· {visible(line)}", style="yellow") for line in comparison.unpaired_lines()]
    from mismatch_probe.report import attribution

    labels = [e.label for e in comparison.entries]
    links = attribution.compare_rows([r.run_dir for r in comparison.runs])
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
            draw(ax, e.curves, label=e.label)
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
    body = [[f"`{row.key}`", *row_cells(row)] for row in pair.rows]
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
    links = attribution.compare_rows([r.run_dir for r in comparison.runs])
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

    store.writable_dir(out_dir, "--out")
    pairs = comparison.all_pairs
    plots = []
    for pair in pairs:
        where = out_dir if len(pairs) == 1 else out_dir / "settings" / _slug(str(pair.setting))
        plots.append(overlay_plots(list(pair.entries), where, pair.setting))
    report = out_dir / store.COMPARE_FILE
    text = comparison_markdown(comparison, plots, out_dir)
    store.write_text(report, text)
    html = write_html(text, report, "Mismatch comparison")
    plot_paths = {}
    for i, drawn in enumerate(plots):
        prefix = "plot_" if len(plots) == 1 else f"plot_{i + 1}_"
        plot_paths.update({f"{prefix}{name}": path for name, (path, _) in drawn.items()})
    return {"report": report, "html": html, **plot_paths}
