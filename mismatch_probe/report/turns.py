"""Multi-turn runs in the reports: the per-turn table (terminal, report.md, PR comment),
``plots/turns.png`` and the re-render drift with its first difference in context.

The numbers are ``metrics.json``'s ``per_turn`` rows and the flat ``rerender_*`` metrics
(``metrics.turns``); the example difference is the view's (``rundir`` reads it from the
sequences store). A run whose
trajectories all have one turn (every single-turn scan) gets none of this.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rich.table import Table

from mismatch_probe.report.markdown import escape, table
from mismatch_probe.rundir.context import RunContext

PLOT_FILE = "turns.png"
EXAMPLE_CLIP = 400  # characters of the example difference kept in a report
COLUMNS = (  # (per_turn key, header, format)
    ("turn", "turn", "{:d}"),
    ("sequences", "sequences", "{:d}"),
    ("tokens", "tokens", "{:d}"),
    ("context_tokens_mean", "context", "{:.1f}"),
    ("k3_kl", "k3", "{:.3g}"),
    ("kl", "kl", "{:.3g}"),
    ("abs_log_ratio_mean", "mean |r|", "{:.3g}"),
    ("first_token_abs_log_ratio_mean", "first-token |r|", "{:.3g}"),
    ("token_mult_prob_error", "mult. error", "{:.6g}"),
)
DRIFT_NOTE = (
    "Re-render drift: the final conversation (generated turns as decoded text) rendered with "
    "the chat template and tokenized, as a trainer that re-applies the template would, against "
    "the ids the engine sampled and saw."
)


def is_multi_turn(ctx: RunContext) -> bool:
    """True when the run holds trajectories of more than one turn."""
    return len(ctx.per_turn) > 1


def rows(ctx: RunContext) -> list[list[str]]:
    """One row of formatted cells per turn (``COLUMNS``); a missing value is ``n/a``."""
    out = []
    for row in ctx.per_turn:
        cells = []
        for key, _, form in COLUMNS:
            value = row.get(key)
            cells.append("n/a" if value is None else form.format(value))
        out.append(cells)
    return out


def drift_lines(ctx: RunContext) -> list[str]:
    """The two drift fractions in words, and the example difference (Markdown)."""
    m = ctx.metrics
    if "rerender_trajectory_fraction" not in m:
        return []
    lines = [
        f"{DRIFT_NOTE} Trajectories whose ids differ: "
        f"**{m['rerender_trajectory_fraction']:.1%}** (`rerender_trajectory_fraction`); "
        f"generated tokens that differ or have no counterpart: "
        f"**{m['rerender_token_fraction']:.2%}** (`rerender_token_fraction`).",
        "",
    ]
    example = ctx.drift_example
    if example:
        shown = escape(keep_spaces(clip(example)))
        lines += [f"First difference of an example trajectory: {shown}", ""]
    return lines


def keep_spaces(text: str) -> str:
    """Spaces Markdown and HTML would collapse shown as ␣: every space of the marked token
    (``»  «``, the engine's two-space token) and every run of two or more elsewhere."""
    marked = re.sub(r"»([^«]*)«", lambda m: "»" + m.group(1).replace(" ", "␣") + "«", text)
    return re.sub(r" {2,}", lambda m: "␣" * len(m.group(0)), marked)


def drift_text(ctx: RunContext) -> list[str]:
    """The drift in plain words (terminal)."""
    m = ctx.metrics
    if "rerender_trajectory_fraction" not in m:
        return []
    lines = [
        f"re-render drift: {m['rerender_trajectory_fraction']:.1%} of trajectories, "
        f"{m['rerender_token_fraction']:.2%} of generated tokens differ when the chat template "
        "re-renders the final conversation"
    ]
    example = ctx.drift_example
    return lines + ([f"  first difference: {clip(example)}"] if example else [])


def clip(text: str) -> str:
    return text if len(text) <= EXAMPLE_CLIP else text[: EXAMPLE_CLIP - 1] + "…"


def section_lines(ctx: RunContext, heading: str = "##") -> list[str]:
    """The per-turn table and the drift, under ``heading`` (no lines for a one-turn run)."""
    if not is_multi_turn(ctx):
        return []
    header = [escape(h) for _, h, _ in COLUMNS]  # "mean |r|": a bare pipe splits a cell
    intro = (
        f"{escape(ctx.label)}: each turn's tokens alone (turn 0 is the first generated turn; "
        "its first token follows a prefill of the whole context so far; context: trajectory "
        "tokens at the turn's start; mult. error: `token_mult_prob_error`)."
    )
    return [
        f"{heading} Per turn",
        "",
        intro,
        "",
        *table(header, rows(ctx), "r" * len(header)),
        "",
        *drift_lines(ctx),
    ]


def markdown(ctx: RunContext, plot: Path | None) -> str:
    """report.md's section (with the plot when one was written)."""
    lines = section_lines(ctx)
    if lines and plot is not None:
        lines += [f"![k3 and first-token |r| per turn](plots/{PLOT_FILE})", ""]
    return "\n".join(lines)


def terminal_table(ctx: RunContext) -> Table:
    """The per-turn table for the terminal."""
    out = Table(title="Per turn", title_justify="left", box=None, header_style="bold")
    for _, header, _ in COLUMNS:
        out.add_column(header, justify="right", no_wrap=True)
    for cells in rows(ctx):
        out.add_row(*cells)
    return out


def write_plot(ctx: RunContext, plots_dir: Path) -> Path | None:
    """``plots/turns.png`` (k3 and first-token |r| against the turn index); a stale one is
    removed from a run without turns."""
    path = plots_dir / PLOT_FILE
    if not is_multi_turn(ctx):
        path.unlink(missing_ok=True)
        return None
    from mismatch_probe.report.plots import new_figure, save, subtitle

    fig, ax = new_figure()
    turns = [row["turn"] for row in ctx.per_turn]
    _draw(ax, turns, [row["k3_kl"] for row in ctx.per_turn], "k3 (all tokens of the turn)", "o")
    first = [row["first_token_abs_log_ratio_mean"] for row in ctx.per_turn]
    _draw(ax, turns, first, "mean |r| of the turn's first token", "s")
    ax.set_xlabel("turn (0 = first generated turn)")
    ax.set_ylabel("log-ratio measure (nats)")
    ax.set_xticks(turns)
    ax.legend(fontsize=8)
    plots_dir.mkdir(parents=True, exist_ok=True)
    return save(fig, path, "Mismatch per turn", subtitle(ctx))


def _draw(ax: Any, x: list[int], y: list[float], label: str, marker: str) -> None:
    """A curve; the axis turns logarithmic while every value drawn on it is above 0."""
    ax.plot(x, y, marker=marker, label=label)
    drawn = [v for line in ax.get_lines() for v in line.get_ydata()]
    ax.set_yscale("log" if drawn and min(drawn) > 0 else "linear")
