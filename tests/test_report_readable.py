"""Readable reports: tables whose cells hold a pipe stay tables, a share of 100% reads 100%,
a signed metric changes as a difference. Views built directly (``tests/views.py``)."""

from __future__ import annotations

import re
from pathlib import Path

from mismatch_probe.metrics.recommend import pct
from mismatch_probe.report.comment import change_cell
from mismatch_probe.report.compare import compare_rows, row_cells
from mismatch_probe.report.decisions import entropy_md
from mismatch_probe.report.html import render_html
from mismatch_probe.rundir.context import Entry
from tests.views import METRICS, run_view

ENTROPY = {
    "available": True,
    "tokens": 20,
    "bins": [
        {"q_lo": 0.0, "q_hi": 0.5, "lo": 0.0, "hi": 1.0, "count": 10, "mean_entropy": 0.5,
         "mean_abs_log_ratio": 0.01, "mean_k3": 1e-4},
        {"q_lo": 0.5, "q_hi": 1.0, "lo": 1.0, "hi": None, "count": 10, "mean_entropy": 1.5,
         "mean_abs_log_ratio": 0.02, "mean_k3": 2e-4},
    ],
}  # fmt: skip


def unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def test_entropy_table_header_escapes_its_pipes() -> None:
    ctx = run_view(curves={"log_ratio_hist": {}, "entropy": ENTROPY})
    lines = entropy_md(ctx)
    header = next(line for line in lines if line.startswith("| quantile"))
    assert unescaped_pipes(header) == 7  # six columns
    html = render_html("\n".join(lines), Path("."), "t")
    assert "<table" in html and "| quantile" not in html


def test_shares_never_read_in_exponent_form() -> None:
    assert pct(1.0) == "100%"
    assert pct(0.003) == "0.3%"
    assert pct(0.5) == "50%"
    assert pct(0.0) == "0%"
    assert "e" not in pct(1e-7)
    assert change_cell("k3_kl", 0.01, 0.02).split()[1] == "+100%"
    assert change_cell("k3_kl", 0.01, 0.3).split()[1] == "+2900%"


def test_terminal_compare_shows_a_signed_metric_change_as_a_difference() -> None:
    base = Entry("a", {**METRICS, "kl": -0.01}, {})
    head = Entry("b", {**METRICS, "kl": 0.0434, "k3_kl": 0.0246}, {})
    rows = {row.key: row_cells(row) for row in compare_rows([base, head])}
    assert rows["kl"][-1] == "Δ+0.0534"
    assert rows["k3_kl"][-1] == "×2"
