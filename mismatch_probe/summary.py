"""The short summary printed at the end of ``probe scan``: key numbers, phase times, paths.

The full terminal report lives with the reports stage; this is the scan's last word.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from mismatch_probe.scan import ScanResult

# (metric key, label, format) in display order.
KEY_METRICS: tuple[tuple[str, str, str], ...] = (
    ("num_tokens", "response tokens", "{:,.0f}"),
    ("num_sequences", "responses", "{:,.0f}"),
    ("k3_kl", "k3_kl  (KL estimate, k3)", "{:.3e}"),
    ("kl", "kl  (k1, rollout - train)", "{:.3e}"),
    ("chi2_token", "chi2_token", "{:.3e}"),
    ("f_tau_2", "tokens with IS ratio outside [0.5, 2]", "{:.4%}"),
    ("prob_abs_diff_max", "max |dp|", "{:.4f}"),
    ("support_flip_fraction", "support-flip tokens", "{:.4%}"),
)
PHASES = (
    "prepare",
    "engine_start",
    "generation",
    "engine_stop",
    "model_load",
    "rescoring",
    "writing",
    "metrics",
)


def render_summary(result: ScanResult, console: Console) -> None:
    """Print the setting, key metrics, phase times and written paths."""
    run = result.run
    console.print(
        f"[bold]mismatch_probe[/] {run['model']['name']}  {run['setting']}  "
        f"logprobs={run['sampling']['logprobs_mode']}  T={run['sampling']['temperature']}"
    )
    console.print(_metrics_table(result.metrics))
    console.print(_timings_line(run["timings"]))
    for name, path in result.paths.items():
        console.print(f"  {name:<10} {path}", highlight=False, soft_wrap=True)


def _metrics_table(metrics: dict[str, Any]) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, label, fmt in KEY_METRICS:
        if key in metrics:
            table.add_row(label, fmt.format(metrics[key]))
    return table


def _timings_line(timings: dict[str, float]) -> str:
    parts = [f"{p} {timings[p]:.1f}s" for p in PHASES if p in timings]
    return "time: " + ", ".join(parts) + f"  (total {sum(timings.values()):.1f}s)"
