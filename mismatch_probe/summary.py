"""The short summary printed at the end of ``probe scan``: key numbers, phase times, paths.

The full terminal report lives with the reports stage; this is the scan's last word.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from mismatch_probe.scan import ScanResult

# (metric key, column header, format) in display order.
KEY_METRICS: tuple[tuple[str, str, str], ...] = (
    ("num_tokens", "tokens", "{:,.0f}"),
    ("k3_kl", "k3_kl", "{:.2e}"),
    ("kl", "kl", "{:.2e}"),
    ("chi2_token", "chi2_token", "{:.2e}"),
    ("f_tau_2", "ratio outside [0.5,2]", "{:.3%}"),
    ("prob_abs_diff_max", "max |dp|", "{:.4f}"),
    ("support_flip_fraction", "flips", "{:.2%}"),
    ("rollout_tokens_per_s", "rollout tok/s", "{:.1f}"),
)
PHASES = (
    "prepare",
    "engine_start",
    "generation",
    "forced_scoring",
    "shards",
    "engine_stop",
    "model_load",
    "rescoring",
    "writing",
    "route_capture",
    "metrics",
    "reports",
)


def render_summary(result: ScanResult, console: Console) -> None:
    """Print the settings (least mismatch first), skips, recommendation, times and paths."""
    run = result.run
    sampling = run["sampling"]
    console.print(
        f"[bold]mismatch_probe[/] {run['model']['name']}  logprobs={sampling['logprobs_mode']}  "
        f"T={sampling['temperature']} top_p={sampling['top_p']} top_k={sampling['top_k']}"
    )
    ranked = sorted(result.settings.items(), key=lambda item: item[1]["k3_kl"])
    console.print(settings_table(ranked))
    for name, reason in result.skipped.items():
        console.print(f"[yellow]skipped[/] {name}: {reason}", highlight=False)
    if len(ranked) > 1:
        best, metrics = ranked[0]
        console.print(
            f"lowest mismatch: [bold]{best}[/] (k3_kl {metrics['k3_kl']:.2e}, "
            f"{metrics['rollout_tokens_per_s']:.1f} rollout tok/s)",
            highlight=False,
        )
    from mismatch_probe.routing.report import load, summary_lines

    for line in summary_lines(load(result.out_dir)):
        console.print(line, highlight=False)
    console.print(_timings_line(run["timings"]), highlight=False)
    for name, path in result.paths.items():
        if not name.startswith("plot_"):
            console.print(f"  {name:<10} {path}", highlight=False, soft_wrap=True)
    if any(name.startswith("plot_") for name in result.paths):
        console.print(f"  {'plots':<10} {result.out_dir / 'plots'}/", highlight=False)


def settings_table(ranked: list[tuple[str, dict[str, Any]]]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("setting", no_wrap=True)
    for _, header, _ in KEY_METRICS:
        table.add_column(header, justify="right", no_wrap=True)
    for name, metrics in ranked:
        cells = [fmt.format(metrics[key]) if key in metrics else "-" for key, _, fmt in KEY_METRICS]
        table.add_row(name, *cells)
    return table


def _timings_line(timings: dict[str, float]) -> str:
    parts = [f"{p} {timings[p]:.1f}s" for p in PHASES if p in timings]
    return "time: " + ", ".join(parts) + f"  (total {sum(timings.values()):.1f}s)"
