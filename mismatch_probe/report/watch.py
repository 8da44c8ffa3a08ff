"""What ``probe watch`` shows while it follows a run: renderers of the data it hands over.

``StepRow`` is one stored step (its key metrics, verdict, worst integrity finding, lag);
``LiveView`` the state shown in a terminal (the last steps, a trend of ``k3_kl``, the worst
finding so far, the status line). ``render_live`` builds the rich ``Live`` renderable,
``plain_line`` the one line per step printed without a terminal, ``alert_line`` an alert's line.
Nothing here reads a file: ``ingest.watch`` builds the view.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from mismatch_probe.report.sections import visible

# (metric, column header) of the live table and the plain line, in order.
KEY_METRICS: tuple[tuple[str, str], ...] = (
    ("k3_kl", "k3_kl"),
    ("chi2_token", "χ² token"),
    ("token_mult_prob_error", "mult. prob. err."),
    ("f_tau_2", "ρ∉[½,2]"),
)
ROWS_SHOWN = 10
TREND_POINTS = 60
BLOCKS = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class StepRow:
    """One stored step, as shown.

    Attributes:
        step: the training step; attempt: 2... when the trainer wrote it again.
        tokens: trained tokens stored.
        metrics: its flat metrics ({} when it has none; ``note`` says why).
        alert: the alert's short text ("" when none).
        worst: the worst integrity finding, ``"error shifted_by_one"`` ("" when clean).
        lag: the off-policy lag (max policy versions), None when the logs do not say.
    """

    step: int
    attempt: int
    tokens: int
    metrics: dict[str, float]
    alert: str = ""
    worst: str = ""
    lag: float | None = None
    note: str = ""


@dataclass(frozen=True)
class LiveView:
    """The terminal view: a title, the last rows, ``k3_kl`` of the last steps, the worst
    finding so far and a status line."""

    title: str
    rows: Sequence[StepRow] = ()
    k3: Sequence[float] = ()
    worst: str = ""
    status: str = ""
    alerts: int = 0
    messages: Sequence[str] = field(default_factory=tuple)


def value(x: float | None) -> str:
    return "—" if x is None else f"{x:.4g}"


def sparkline(values: Sequence[float]) -> str:
    """``▁▃█``: each value's height on a log scale between the smallest and largest positive
    values (a non-positive value is the lowest block)."""
    logs = [math.log10(v) for v in values if v > 0]
    if not logs:
        return BLOCKS[0] * len(values)
    lo, hi = min(logs), max(logs)
    out = []
    for v in values:
        if v <= 0:
            out.append(BLOCKS[0])
            continue
        share = 0.0 if hi == lo else (math.log10(v) - lo) / (hi - lo)
        out.append(BLOCKS[min(int(share * len(BLOCKS)), len(BLOCKS) - 1)])
    return "".join(out)


def verdict(row: StepRow) -> str:
    if row.alert:
        return "ALERT"
    return "—" if not row.metrics else "ok"


def plain_line(row: StepRow) -> str:
    """``step 12: 1,024 tokens, k3_kl 3.1e-05, ... ok`` (``ALERT: ...``), one line."""
    parts = [f"step {row.step}" + (f" (attempt {row.attempt})" if row.attempt > 1 else "")]
    parts[0] += f": {row.tokens:,} tokens"
    if row.metrics:
        parts += [f"{m} {value(row.metrics.get(m))}" for m, _ in KEY_METRICS]
    elif row.note:
        parts.append(row.note)
    if row.lag is not None:
        parts.append(f"lag {row.lag:g}")
    if row.worst:
        parts.append(f"integrity {row.worst}")
    parts.append(f"ALERT: {row.alert}" if row.alert else verdict(row))
    return visible(", ".join(parts))


def alert_line(alert: dict[str, Any]) -> str:
    """``ALERT step 12: k3_kl = 0.0021 > 0.001 (max); error shifted_by_one``."""
    return visible(f"ALERT step {alert['step']}: {alert['message']}")


def render_live(view: LiveView) -> RenderableType:
    """The live view: the last steps as a table (alerts red), then the trend, the worst
    finding and the status."""
    table = Table(title=view.title, title_justify="left", title_style="bold")
    table.add_column("step", justify="right")
    table.add_column("tokens", justify="right")
    for _, header in KEY_METRICS:
        table.add_column(header, justify="right")
    table.add_column("lag", justify="right")
    table.add_column("verdict")
    for row in list(view.rows)[-ROWS_SHOWN:]:
        cells = (
            [value(row.metrics.get(m)) for m, _ in KEY_METRICS]
            if row.metrics
            else (["—"] * len(KEY_METRICS))
        )
        style = "bold red" if row.alert else ""
        label = f"{row.step}" + (f" ({row.attempt})" if row.attempt > 1 else "")
        shown = verdict(row) + (f": {row.alert}" if row.alert else "")
        table.add_row(label, f"{row.tokens:,}", *cells, value(row.lag), Text(shown, style=style))
    lines: list[RenderableType] = [table]
    if view.k3:
        trend = Text(f"k3_kl, last {len(view.k3)} steps: ")
        trend.append(sparkline(list(view.k3)[-TREND_POINTS:]), style="cyan")
        trend.append(f"  (last {value(view.k3[-1])})")
        lines.append(trend)
    worst = Text("worst integrity finding: ")
    worst.append(view.worst or "none", style="bold red" if view.worst.startswith("error") else "")
    lines.append(worst)
    lines += [Text(visible(m), style="yellow") for m in view.messages]
    lines.append(Text(visible(view.status), style="dim"))
    return Group(*lines)


class Display:
    """Where ``probe watch`` shows its steps: a rich ``Live`` view in a terminal, else one plain
    line per step (and per alert or message) on ``console``."""

    def __init__(self, console: Any, live: bool) -> None:
        self.console = console
        self.live_mode = live
        self._live: Any = None

    def __enter__(self) -> Display:
        if self.live_mode:
            from rich.live import Live

            self._live = Live(console=self.console, refresh_per_second=4, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def show(self, view: LiveView, row: StepRow | None = None, lines: Sequence[str] = ()) -> None:
        """A new state: the live view redrawn (``lines`` printed above it), or ``row``'s line
        and ``lines`` printed."""
        if self._live is not None:
            for line in lines:
                self._live.console.print(Text(line), highlight=False)
            self._live.update(render_live(view))
            return
        if row is not None:
            self.console.print(Text(plain_line(row)), highlight=False, soft_wrap=True)
        for line in lines:
            self.console.print(Text(line), highlight=False, soft_wrap=True)


def render_end(out: Any, steps: int, alerts: int, stopped: str, console: Any) -> None:
    """The last line of a watch: why it stopped, what RUN holds."""
    why = f"stopped: {stopped}; " if stopped else ""
    console.print(
        Text(visible(f"{why}{steps} steps stored, {alerts} alerts -> {out}")),
        highlight=False,
        soft_wrap=True,
    )
