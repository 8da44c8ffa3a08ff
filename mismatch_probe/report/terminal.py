"""The terminal report (rich): header, verdicts, grouped tables, log-ratio histogram, worst tokens.

Colour carries meaning only (green pass, red fail, magenta support flip); every verdict also
says PASS/FAIL in words, so the report reads the same with ``NO_COLOR`` (rich honours it).
Model text goes into ``rich.text.Text`` objects, never into markup, so a token such as
``[bold]`` prints as itself.
"""

from __future__ import annotations

import math
from typing import Any

from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from mismatch_probe.metrics.verdicts import FAIL, PASS, Verdict, evaluate
from mismatch_probe.report import turns
from mismatch_probe.report.integrity import integrity_text
from mismatch_probe.report.sections import (
    fmt,
    metric_groups,
    preset_rows,
    prob_text,
    settings_rows,
    show_blank,
    visible,
)
from mismatch_probe.rundir.context import RunContext, WorstToken

STATUS_STYLE = {PASS: ("✔", "green"), FAIL: ("✘", "bold red"), "n/a": ("·", "dim")}
CAUSE_STYLE = {"support flip": "magenta", "—": "dim"}  # by the first cause named
HIST_WIDTH = 40
HIST_ROWS = 24
EIGHTHS = " ▏▎▍▌▋▊▉█"


def header(ctx: RunContext) -> Text:
    """The run directory and what was measured, one fact per line."""
    rows = [("run", str(ctx.run_dir)), *settings_rows(ctx.run, ctx.label, ctx.metrics)]
    text = Text("mismatch_probe report\n", style="bold")
    for name, value in rows:
        text.append(f"  {name:<16}", style="bold")
        text.append(f"{visible(str(value))}\n")
    text.rstrip()
    return text


def verdict_table(verdicts: list[Verdict]) -> Table:
    """One row per health check: mark and status, what is checked, the healthy range, value."""
    table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 2, 0, 0))
    for _ in range(4):
        table.add_column()
    table.add_column(style="dim")
    for v in verdicts:
        mark, style = STATUS_STYLE[v.status]
        value = "not computed" if v.value is None else f"{v.value:.4g}"
        source = f"{v.check.metric} ({v.check.source})"
        table.add_row(Text(f"{mark} {v.status}", style=style), v.check.label,
                      v.check.threshold, value, source)  # fmt: skip
    return table


def metric_table(title: str, keys: list[str], metrics: dict[str, float]) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in keys:
        table.add_row(key, fmt(key, metrics[key]))
    return table


def preset_table(ctx: RunContext) -> Table | None:
    rows = preset_rows(ctx.metrics, ctx.config)
    if not rows:
        return None
    table = Table(title="Presets: what each correction would do", title_justify="left")
    table.title_style = "bold"
    for name in ("preset", "correction"):
        table.add_column(name)
    for name in ("tokens masked", "seqs masked", "ESS"):
        table.add_column(name, justify="right")
    for name, correction, values in rows:
        table.add_row(name, correction, *(f"{v:.4g}" for v in values))
    return table


def _hist_rows(hist: dict[str, Any]) -> list[tuple[str, int]]:
    """``[(range label, count)]`` over the non-empty span, merged to at most ``HIST_ROWS``."""
    counts = hist["counts"]
    lo, hi, n = hist["lo"], hist["hi"], len(counts)
    nonzero = [i for i, c in enumerate(counts) if c]
    rows = []
    if hist.get("underflow"):
        rows.append((f"r < {lo:+.3f}", int(hist["underflow"])))
    if nonzero:
        first, last = nonzero[0], nonzero[-1]
        step = max(1, math.ceil((last - first + 1) / HIST_ROWS))
        width = (hi - lo) / n
        for i in range(first, last + 1, step):
            j = min(i + step, last + 1)
            label = f"{lo + i * width:+.3f} … {lo + j * width:+.3f}"
            rows.append((label, int(sum(counts[i:j]))))
    if hist.get("overflow"):
        rows.append((f"r > {hi:+.3f}", int(hist["overflow"])))
    return rows


def _bar(count: int, top: int) -> str:
    """A bar whose length is ``log(1 + count)``, in eighths of a character."""
    if count <= 0:
        return ""
    eighths = max(1, round(8 * HIST_WIDTH * math.log1p(count) / math.log1p(top)))
    return "█" * (eighths // 8) + EIGHTHS[eighths % 8].strip()


def histogram(hist: dict[str, Any]) -> Text:
    """The log-ratio histogram as unicode bars (length on a log scale, counts printed)."""
    rows = _hist_rows(hist)
    top = max((c for _, c in rows), default=1)
    text = Text("log-ratio r = log p_train − log p_rollout  (bar ∝ log(1 + tokens))\n")
    text.stylize("bold", 0, len("log-ratio"))
    for label, count in rows:
        text.append(f"  {label:>17} │")
        text.append(f"{_bar(count, top):<{HIST_WIDTH}}", style="cyan")
        text.append(f"│ {count:,}\n")
    text.rstrip()
    return text


def _context(tok: WorstToken) -> Text:
    """``before⟦token⟧after``: the brackets find the token where styles are off."""
    text = Text(visible(tok.before), style="dim")
    text.append("⟦")
    text.append(visible(show_blank(tok.text)), style="bold reverse")
    text.append("⟧")
    text.append(visible(tok.after), style="dim")
    return text


def worst_table(worst: tuple[WorstToken, ...]) -> Table:
    """The tokens of largest ``|r|``: where, which text, by how much, and why."""
    table = Table(title="Worst tokens (largest |log ρ|)", title_justify="left", expand=True)
    table.title_style = "bold"
    table.add_column("#", justify="right")
    table.add_column("seq:pos")
    table.add_column("token ⟦in context⟧", ratio=1)
    table.add_column("log ρ", justify="right")
    table.add_column("p roll", justify="right")
    table.add_column("p train", justify="right")
    table.add_column("cause")
    for i, tok in enumerate(worst, 1):
        table.add_row(
            str(i),
            f"{tok.seq_id}:{tok.position}",
            _context(tok),
            f"{tok.log_ratio:+.3g}",
            prob_text(tok.rollout_logprob, 3),
            prob_text(tok.train_logprob, 3),
            Text(tok.cause, style=CAUSE_STYLE.get(tok.cause.split(",")[0], "")),
        )
    return table


def report_renderables(ctx: RunContext) -> list[RenderableType]:
    """Every part of the terminal report, in order."""
    from mismatch_probe.report import decisions

    tables = [metric_table(title, keys, ctx.metrics) for title, keys in metric_groups(ctx.metrics)]
    parts: list[RenderableType] = [integrity_text(ctx.integrity)] if ctx.integrity else []
    parts += [header(ctx), decisions.recommendation_rich(ctx.tables, ctx.setting)]
    parts += [Text(), verdict_table(evaluate(ctx.metrics))]
    parts += [Text(), Columns(tables)]
    presets = preset_table(ctx)
    if presets is not None:
        parts.append(presets)
    parts += decisions.sweep_rich(ctx.tables)
    parts += [Text(), histogram(ctx.curves["log_ratio_hist"]), Text()]
    if ctx.worst:
        parts.append(worst_table(ctx.worst))
    outliers = decisions.outliers_rich(ctx)
    if outliers is not None:
        parts.append(outliers)
    if turns.is_multi_turn(ctx):
        parts += [Text(), turns.terminal_table(ctx)]
        parts += [Text(visible(line)) for line in turns.drift_text(ctx)]
    return parts


def render_run(ctx: RunContext, console: Console) -> None:
    """Print the terminal report of a loaded run."""
    console.print(Group(*report_renderables(ctx)))
