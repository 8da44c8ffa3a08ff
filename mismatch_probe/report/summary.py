"""What ``probe scan`` prints: the settings judged, the reference setting's report, phase times,
paths (``render_scan``).

A precision matrix (or a scan with a setting skipped) leads with its settings: the grid, failing
first, one recommendation per setting in it (spec section 7), the key numbers in the same order
(``rundir.order``, as every other output lists them) and the settings that did not run; then the
reference setting's full terminal report (``terminal``). A single setting's report comes first
and its summary row last. It reads a scan's result through the ``ScanOutcome`` protocol
(``records.ScanResult`` fits it), so the reports stage imports nothing from the scan above it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from mismatch_probe import store
from mismatch_probe.report import attribution
from mismatch_probe.report.grid import (
    TERMINAL_STYLE,
    grid_table,
    headline,
    judge,
    recommendations_of,
)
from mismatch_probe.report.routing import summary_lines
from mismatch_probe.report.sections import fmt, visible
from mismatch_probe.rundir.context import Entry, RunContext
from mismatch_probe.rundir.order import in_setting_order


class ScanOutcome(Protocol):
    """What the summary shows of a scan."""

    out_dir: Path
    paths: dict[str, Path]
    run: dict[str, Any]  # run.json
    settings: dict[str, dict[str, float]]  # setting name -> flat metrics
    skipped: dict[str, str]  # rollout setting name -> reason
    report: RunContext  # the reference setting's view (its routing and attribution numbers)
    entries: list[Entry]  # one per setting of a matrix (their recommendations), [] for one


# (metric key, column header, format) in display order; None: the reports' own format
# (``sections.fmt``), so a metric reads the same in the summary as in the grid above it.
KEY_METRICS: tuple[tuple[str, str, str | None], ...] = (
    ("num_tokens", "tokens", None),
    ("k3_kl", "k3_kl", None),
    ("kl", "kl", None),
    ("chi2_token", "chi2_token", None),
    ("f_tau_2", "f_tau_2", None),
    ("prob_abs_diff_max", "max |dp|", None),
    ("support_flip_fraction", "flips", None),
    ("rollout_tokens_per_s", "rollout tok/s", "{:.1f}"),
)
PHASES = (
    "prepare",
    "engine_start",
    "generation",
    "forced_scoring",
    "attribution_prefill",
    "shards",
    "engine_stop",
    "model_load",
    "rescoring",
    "attribution_rescoring",
    "writing",
    "route_capture",
    "metrics",
    "reports",
)


def render_scan(result: ScanOutcome, console: Console) -> None:
    """Everything ``probe scan`` prints on stdout, in order: for a matrix, the data integrity,
    the settings judged (``render_summary``), then the reference setting's report, then the
    times and paths; a single setting's report first, then its summary."""
    from dataclasses import replace

    from mismatch_probe.report.integrity import integrity_text
    from mismatch_probe.report.terminal import render_run

    if leads_with_settings(result):
        ctx = result.report
        if ctx.integrity is not None:  # first, before every setting judged (spec section 8)
            console.print(integrity_text(ctx.integrity), highlight=False)
            ctx = replace(ctx, integrity=None)  # said once
        render_summary(result, console)
        note = (
            f"The report below describes one setting, {ctx.label}; every setting is judged above."
        )
        console.print(Text(visible(note), style="italic"), highlight=False)
        render_run(ctx, console)
    else:
        render_run(result.report, console)
        render_summary(result, console)
    render_tail(result, console)


def leads_with_settings(result: ScanOutcome) -> bool:
    """The scan judged several settings, or some asked for did not run."""
    return len(result.settings) > 1 or bool(result.skipped)


def render_summary(result: ScanOutcome, console: Console) -> None:
    """Print the settings (in the settings' order, ``rundir.order``) with the grid and each
    setting's recommendation when there are several, the skipped ones, the lowest mismatch and
    what routing replay removed (an MoE scan)."""
    run = result.run
    sampling = run["sampling"]
    console.print(
        f"[bold]mismatch_probe[/] {_safe(run['model']['name'])}  "
        f"logprobs={sampling['logprobs_mode']}  "
        f"T={sampling['temperature']} top_p={sampling['top_p']} top_k={sampling['top_k']}"
    )
    ranked = in_setting_order(result.settings.items(), lambda i: i[0], lambda i: i[1])
    asked = [str(s) for s in run.get("settings") or result.skipped]
    skipped = [
        (s, result.skipped[s.split(" | ")[0]]) for s in asked if s.split(" | ")[0] in result.skipped
    ]
    if len(ranked) > 1 or skipped:
        judged = judge(list(result.settings.items()), recommendations_of(result.entries))
        style = "bold red" if any(j.failing for j in judged) else "bold green"
        console.print(Text(visible(headline(judged, skipped)), style=style))
        console.print(grid_table(judged))
    console.print(settings_table(ranked))
    for name, reason in result.skipped.items():
        console.print(f"[yellow]skipped[/] {_safe(name)}: {_safe(reason)}", highlight=False)
    if len(ranked) > 1:
        best, metrics = min(ranked, key=lambda item: item[1]["k3_kl"])
        console.print(
            f"lowest mismatch: [bold]{_safe(best)}[/] (k3_kl {fmt('k3_kl', metrics['k3_kl'])}, "
            f"{metrics['rollout_tokens_per_s']:.1f} rollout tok/s)",
            highlight=False,
        )
    for line in summary_lines(result.report.routing):  # routing replay's effect, across settings
        console.print(Text(visible(line)), highlight=False)


def render_tail(result: ScanOutcome, console: Console) -> None:
    """The attribution summary, phase times and the paths written."""
    run = result.run
    attribution.render(result.report.attribution, console)
    console.print(_timings_line(run["timings"]), highlight=False)
    for name, path in result.paths.items():
        if not name.startswith("plot_"):
            console.print(Text(f"  {name:<10} {visible(str(path))}"), soft_wrap=True)
    if any(name.startswith("plot_") for name in result.paths):
        plots = visible(str(result.out_dir / store.PLOTS_DIR))
        console.print(Text(f"  {'plots':<10} {plots}/"))


def settings_table(ranked: list[tuple[str, dict[str, Any]]]) -> Table:
    """One row per setting (the order given): its verdict (``grid.Judged``), then
    ``KEY_METRICS``."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("setting", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for _, header, _ in KEY_METRICS:
        table.add_column(header, justify="right", no_wrap=True)
    for judged in (judge([item])[0] for item in ranked):
        metrics = judged.metrics
        cells = [_cell(key, form, metrics) for key, _, form in KEY_METRICS]
        mark, style = TERMINAL_STYLE[judged.status]
        verdict = Text(f"{mark} {judged.summary()}", style=style)
        table.add_row(Text(visible(judged.setting)), verdict, *cells)
    return table


def _cell(key: str, form: str | None, metrics: dict[str, float]) -> str:
    if key not in metrics:
        return "-"
    return form.format(metrics[key]) if form else fmt(key, metrics[key])


def _safe(text: Any) -> str:
    """Text from a file or a model, inert inside rich markup."""
    return escape(visible(str(text)))


def _timings_line(timings: dict[str, float]) -> str:
    parts = [f"{p} {timings[p]:.1f}s" for p in PHASES if p in timings]
    return "time: " + ", ".join(parts) + f"  (total {sum(timings.values()):.1f}s)"
