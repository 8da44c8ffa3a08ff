"""Readable reports: tables whose cells hold a pipe stay tables, a share of 100% reads 100%,
a signed metric changes as a difference. Views built directly (``tests/views.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


def test_setting_is_named_by_its_parts() -> None:
    from mismatch_probe.errors import ProbeError
    from mismatch_probe.rundir.context import match_settings

    names = [
        "rollout=fp32 | train=fp32",
        "rollout=bf16 | train=fp32",
        "rollout=bf16,kv=fp8 | train=fp32",
    ]
    assert match_settings(["kv=fp8"], names) == (names[2],)
    assert match_settings(["rollout=fp32"], names) == (names[0],)
    assert match_settings(["kv=fp8,rollout=bf16"], names) == (names[2],)
    assert match_settings([names[1]], names) == (names[1],)  # a whole name: itself
    assert match_settings(["kv=fp16"], names) == ("kv=fp16",)  # none: said by the caller
    with pytest.raises(ProbeError, match="names 2 settings"):
        match_settings(["rollout=bf16"], names)


def test_report_setting_accepts_parts(tmp_path: Path) -> None:
    from mismatch_probe.rundir.loader import select_settings
    from tests.test_report_fixtures import matrix_run, uniform_seqs

    fp32, fp8 = "rollout=fp32 | train=fp32", "rollout=bf16,kv=fp8 | train=fp32"
    run = matrix_run(tmp_path / "m", {fp32: uniform_seqs(0.0, [4]), fp8: uniform_seqs(0.1, [4])})
    assert select_settings(run, ("kv=fp8",)) == [fp8]


def test_threshold_sweep_says_it_shows_truncation() -> None:
    from mismatch_probe.report.decisions import sweep_rich
    from mismatch_probe.report.plots import PLOTS

    rows = [
        {"family": "token_tis", "threshold": t, "token_fraction": 0.1, "seq_fraction": 0.2}
        for t in (2.0, 5.0)
    ]
    (table,) = sweep_rich({"threshold_sweep": rows})
    assert "truncated" in str(table.title)
    assert "truncates" in PLOTS["threshold_sweep"][0]


def test_run_json_that_is_no_run_is_refused(tmp_path: Path) -> None:
    import json

    from mismatch_probe.errors import ProbeError
    from mismatch_probe.rundir.data import read_run

    (tmp_path / "run.json").write_text("[]")
    with pytest.raises(ProbeError, match="not an object"):
        read_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"schema_version": "7", "setting": "x"}))
    with pytest.raises(ProbeError, match="schema_version '7'"):
        read_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"schema_version": "1", "setting": "x"}))
    assert read_run(tmp_path)["setting"] == "x"


def test_interrupted_report_names_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A signal after the plots are written: the message names them, never "nothing written"."""
    import signal

    from mismatch_probe import interrupt
    from mismatch_probe.pipeline import publish
    from tests.cli_runner import run_probe
    from tests.test_report_fixtures import matrix_run, uniform_seqs

    run = matrix_run(tmp_path / "r", {"rollout=fp32 | train=fp32": uniform_seqs(0.01, [4, 6])})
    real = publish.write_outputs

    def then_interrupted(*args: object, **kwargs: object) -> object:
        real(*args, **kwargs)  # type: ignore[arg-type]
        raise interrupt.Interrupted(signal.SIGINT, "reports")

    monkeypatch.setattr(publish, "write_outputs", then_interrupted)
    code, _, err = run_probe(["report", str(run)], monkeypatch, capsys)
    assert code == 130
    assert "nothing written" not in err
    assert "complete files kept:" in err and "report.md" in err


def test_models_prepare_says_what_it_prepared() -> None:
    from mismatch_probe.models import default_model_dir, prepared_message

    path = default_model_dir()
    assert prepared_message(path, False).startswith("SmolLM2-135M-Instruct prepared: ")
    reused = prepared_message(path, True)
    assert "already prepared" in reused and str(path) in reused and "probe scan" in reused


def test_rerender_drift_keeps_the_two_space_token_visible() -> None:
    from mismatch_probe.report.turns import drift_lines

    metrics = {**METRICS, "rerender_trajectory_fraction": 0.5, "rerender_token_fraction": 0.1}
    ctx = run_view(metrics=metrics, drift_example="def f():»  «return 1")
    text = "\n".join(drift_lines(ctx))
    assert "»␣␣«" in text
    html = render_html(text, Path("."), "t")
    assert "»␣␣«" in html


def test_html_tables_never_split_a_number() -> None:
    """``overflow-wrap: anywhere`` let the grid's columns shrink below a number's width (6
    significant digits split mid-digit at 1280 px): numbers (right-aligned cells) stay whole."""
    html = render_html(
        "| a | b |\n|:--|--:|\n| rollout=bf16 \\| train=fp32 | 0.0123456 |", Path("."), "t"
    )
    assert "overflow-wrap: anywhere" not in html
    assert 'td[style*="right"] { white-space: nowrap; }' in html
    assert 'style="text-align:right"' in html  # the cells the rule above applies to


def test_k3_by_setting_is_titled_for_what_it_draws(tmp_path: Path) -> None:
    from mismatch_probe.metrics.verdicts import HEALTH_CHECKS
    from mismatch_probe.report.plots import write_k3_by_setting

    entries = [Entry("a", dict(METRICS), {}), Entry("b", {**METRICS, "k3_kl": 0.5}, {})]
    path, title = write_k3_by_setting(entries, tmp_path / "k3.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    has_bound = any(c.metric == "k3_kl" and c.bounds for c in HEALTH_CHECKS)
    assert ("verdict bounds" in title) == has_bound
    assert "none-needed bound" in title
