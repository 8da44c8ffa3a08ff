"""Every setting of a precision-matrix run judged: the setting x verdict grid and the matrix
table in the terminal, report.md, report.html and the PR comment; ``probe report --setting``."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from mismatch_probe.report.grid import (
    grid_markdown,
    grid_table,
    headline,
    judge,
    matrix_markdown,
    matrix_table,
)
from mismatch_probe.report.html import render_html
from tests.cli_runner import run_probe
from tests.test_report_fixtures import matrix_run, uniform_seqs

FP32, BF16, FP8 = (
    "rollout=fp32 | train=fp32",
    "rollout=bf16 | train=fp32",
    "rollout=bf16,kv=fp8 | train=fp32",
)
SETTINGS = [
    (FP32, {"num_tokens": 100.0, "k3_kl": 0.0, "kl": 0.0, "chi2_token": 0.0, "f_tau_2": 0.0,
            "prob_abs_diff_max": 0.0}),
    (BF16, {"num_tokens": 100.0, "k3_kl": 5e-5, "kl": -0.01, "chi2_token": 0.02, "f_tau_2": 0.005,
            "prob_abs_diff_max": 0.2}),
    (FP8, {"num_tokens": 100.0, "k3_kl": 0.004, "kl": -0.2, "chi2_token": 0.5, "f_tau_2": 0.027,
           "prob_abs_diff_max": 0.566}),
]  # fmt: skip


def printed(*renderables: Any) -> list[str]:
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    for r in renderables:
        console.print(r)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    return [line.rstrip() for line in out.splitlines()]


def test_failing_settings_and_checks_come_first_in_the_terminal() -> None:
    judged = judge(SETTINGS)
    assert headline(judged) == f"1 of 3 settings fail a check: {FP8}."
    assert printed(grid_table(judged)) == [
        "Verdicts of every setting (3 settings, failing first)",
        "",
        " setting                            verdict           kl   f_tau_2   max|dp|       χ²",
        " " + "─" * 84,
        f" {FP8}   ✘ FAIL 3/4    ✘ -0.2   ✘ 0.027   ✘ 0.566    ✔ 0.5",
        f" {FP32}          ✔ PASS           ✔ 0       ✔ 0       ✔ 0      ✔ 0",
        f" {BF16}          ✔ PASS       ✔ -0.01   ✔ 0.005     ✔ 0.2   ✔ 0.02",
        "",  # IS checks: computed by no setting, left out
        "healthy when: kl |x| ≤ 0.1, f_tau_2 ≤ 0.01, max|dp| ≤ 0.5, χ² ≤ 1",
    ]


def test_matrix_table_one_row_per_setting_no_ratios() -> None:
    lines = printed(matrix_table(judge(SETTINGS)))
    assert lines[0] == "Key numbers of every setting (the grid's order)"
    assert lines[2] == (
        "┃ setting                          ┃ verdict    ┃ tokens ┃ k3_kl ┃    kl ┃ chi2_token ┃"
        " f_tau_2 ┃ max |dp| ┃"
    )
    assert lines[4:7] == [  # the grid's order: failing first, then least k3_kl
        f"│ {FP8} │ ✘ FAIL 3/4 │    100 │ 0.004 │  -0.2 │        0.5 │   0.027 │    0.566 │",
        f"│ {FP32:<32} │ ✔ PASS     │    100 │     0 │     0 │          0 │       0 │        0 │",
        f"│ {BF16:<32} │ ✔ PASS     │    100 │ 5e-05 │ -0.01 │       0.02 │   0.005 │      0.2 │",
    ]
    assert not any("×" in line for line in lines)  # no ratio to a near-zero identity


def test_markdown_grid_and_matrix_table() -> None:
    judged = judge(SETTINGS)
    assert grid_markdown(judged) == [
        "| setting | verdict | `kl` \\|x\\| ≤ 0.1 | `f_tau_2` ≤ 0.01 | `prob_abs_diff_max` ≤ 0.5 "
        "| `chi2_token` ≤ 1 |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        "| rollout=bf16,kv=fp8 \\| train=fp32 | ❌ FAIL 3/4 | ❌ FAIL -0.2 | ❌ FAIL 0.027 "
        "| ❌ FAIL 0.566 | ✅ PASS 0.5 |",
        "| rollout=fp32 \\| train=fp32 | ✅ PASS | ✅ PASS 0 | ✅ PASS 0 | ✅ PASS 0 | ✅ PASS 0 |",
        "| rollout=bf16 \\| train=fp32 | ✅ PASS | ✅ PASS -0.01 | ✅ PASS 0.005 | ✅ PASS 0.2 "
        "| ✅ PASS 0.02 |",
    ]
    assert matrix_markdown(judged) == [
        "| setting | verdict | `num_tokens` | `k3_kl` | `kl` | `chi2_token` | `f_tau_2` "
        "| `prob_abs_diff_max` |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| rollout=bf16,kv=fp8 \\| train=fp32 | ❌ FAIL 3/4 | 100 | 0.004 | -0.2 | 0.5 | 0.027 "
        "| 0.566 |",
        "| rollout=fp32 \\| train=fp32 | ✅ PASS | 100 | 0 | 0 | 0 | 0 | 0 |",
        "| rollout=bf16 \\| train=fp32 | ✅ PASS | 100 | 5e-05 | -0.01 | 0.02 | 0.005 | 0.2 |",
    ]


def test_html_verdicts_are_words_with_a_class() -> None:
    html = render_html("\n".join(grid_markdown(judge(SETTINGS))), Path("."), "t")
    assert '<td><span class="verdict fail">FAIL</span> 3/4</td>' in html
    assert '<td style="text-align:right"><span class="verdict pass">PASS</span> 0.02</td>' in html
    assert "✅" not in html and "❌" not in html
    assert ".verdict.fail { color: #cf222e;" in html
    assert "th code, td code { white-space: nowrap; overflow-wrap: normal; }" in html


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The identity first (r = 0), bf16 (r = 0.01), bf16 with an fp8 KV cache (r = -0.8: every
    token's ratio outside [0.5, 2], so f_tau_2 = 1 fails)."""
    seqs = {FP32: uniform_seqs(0.0, [4, 6]), BF16: uniform_seqs(0.01, [4, 6])}
    seqs[FP8] = uniform_seqs(-0.8, [4, 6])
    return matrix_run(tmp_path_factory.mktemp("grid") / "m", seqs)


def test_report_judges_every_setting_at_the_top(
    matrix: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    code, out, _ = run_probe(["report", str(matrix)], monkeypatch, capsys)
    assert code == 0
    assert out.splitlines()[0].startswith("✔ Data integrity: clean")  # integrity first
    assert out.splitlines()[1] == f"1 of 3 settings fail a check: {FP8}."
    text = (matrix / "report.md").read_text()
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads[:3] == [
        "## Every setting judged",
        "## Key numbers of every setting (the grid's order)",
        "## Settings",
    ]
    assert f"*The sections below describe one setting, {FP32.replace('|', chr(92) + '|')}" in text
    assert (
        "| precisions | rollout=fp32 \\| train=fp32 (one of 3 settings; every setting is judged "
        "in the grid) |" in text
    )
    lines = text.splitlines()
    first_row = lines[next(i for i, line in enumerate(lines) if line.startswith("| --- |")) + 1]
    assert first_row.startswith("| rollout=bf16,kv=fp8 \\| train=fp32 | ❌ FAIL 4/8 |")
    html = (matrix / "report.html").read_text()
    assert html.index("Every setting judged") < html.index("<h2>Verdicts</h2>")
    assert '<span class="verdict fail">FAIL</span> 4/8' in html


def test_report_setting_limits_the_report(
    matrix: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = ["report", str(matrix), "--setting", FP8, "--setting", BF16, "--format", "pr-comment"]
    code, out, _ = run_probe(args, monkeypatch, capsys)
    assert code == 0
    assert "**Verdicts of rollout=bf16 \\| train=fp32:**" in out  # the first chosen, scan order
    assert "**1 of 2 settings fail a check: rollout=bf16,kv=fp8 \\| train=fp32.**" in out
    # a selection is titled as one, never as every setting
    chosen = "#### The 2 settings chosen with --setting judged (of 3 in the run)"
    assert chosen in out and "Every setting judged" not in out
    assert out.index(chosen) < out.index("#### Verdicts")
    assert "rollout=fp32" not in out
    # metrics.json keeps describing the scan's first setting
    assert "k3_kl" in (matrix / "metrics.json").read_text()
    metrics = (matrix / "metrics.json").read_text()
    assert re.search(r'"k3_kl": 0\.0[,\n]', metrics)


def test_matrix_report_in_chromium(
    matrix: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Headless Chromium (no emoji font needed): verdicts read PASS/FAIL in colour, and no
    metric name in a header or cell wraps mid-word."""
    from tests.browser import Browser, find_chromium

    binary = find_chromium()
    if binary is None:
        pytest.fail("no Chromium: the report must be checked in a browser")
    run_probe(["report", str(matrix)], monkeypatch, capsys)
    with Browser(binary, width=700) as b:  # a narrow window squeezes the tables
        b.open((matrix / "report.html").resolve().as_uri())
        fails = b.evaluate(
            "JSON.stringify(Array.from(document.querySelectorAll('.verdict.fail')).map("
            "e => [e.textContent, getComputedStyle(e).color]))"
        )
        wrapped = b.evaluate(
            "JSON.stringify(Array.from(document.querySelectorAll('th code, td code')).filter("
            "e => e.getClientRects().length > 1).map(e => e.textContent))"
        )
    import json

    assert json.loads(fails) and all(
        t == "FAIL" and c == "rgb(207, 34, 46)" for t, c in json.loads(fails)
    )
    assert json.loads(wrapped) == []


def scan_outcome(matrix: Path) -> Any:
    """What ``probe scan`` hands its renderer for ``matrix`` (``records.ScanResult``'s fields),
    the view and entries loaded from the run directory, the settings in the scan's order."""
    from types import SimpleNamespace

    from mismatch_probe.rundir import load_report

    ctx, entries = load_report(matrix)
    by_name = {e.label: {**e.metrics, "rollout_tokens_per_s": 10.0} for e in entries}
    return SimpleNamespace(
        out_dir=matrix,
        paths={},
        run={
            "model": {"name": "m"},
            "sampling": {"logprobs_mode": "raw", "temperature": 1.0, "top_p": 1.0, "top_k": -1},
            "timings": {"generation": 1.0},
        },
        settings={name: by_name[name] for name in (FP32, BF16, FP8)},
        skipped={},
        report=ctx,
        entries=entries,
    )


def scan_lines(matrix: Path) -> list[str]:
    from mismatch_probe.report.summary import render_scan

    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    render_scan(scan_outcome(matrix), console)
    return [line.rstrip() for line in console.file.getvalue().splitlines()]  # type: ignore[attr-defined]


def test_scan_leads_with_every_setting_judged(matrix: Path) -> None:
    """A matrix scan opens with the grid (failing first, a recommendation for every setting in
    it, the fp8 one's too), then the key numbers, then the reference setting's report."""
    from mismatch_probe.report.grid import recommendation_cell

    lines = scan_lines(matrix)
    assert lines[0].startswith("✔ Data integrity: clean")  # integrity first, said once
    assert sum("Data integrity" in line for line in lines) == 1
    assert lines[1].startswith("mismatch_probe m ")
    assert lines[2] == f"1 of 3 settings fail a check: {FP8}."
    assert lines[3] == "Verdicts of every setting (3 settings, failing first)"
    header = next(line for line in lines if line.lstrip().startswith("setting"))
    assert header.split()[-1] == "recommendation"
    _, entries = __import__("mismatch_probe.rundir", fromlist=["x"]).load_report(matrix)
    for e in entries:
        cell = recommendation_cell(e.tables["recommendation"])
        row = next(line for line in lines if line.lstrip().startswith(e.label))  # the grid's
        assert cell and row.endswith(cell)
    grid_end = lines.index(next(line for line in lines if line.startswith("healthy when:")))
    reference = next(i for i, line in enumerate(lines) if line.startswith("Recommendation for"))
    assert grid_end < reference  # the details after every setting judged
    assert not any(line.startswith("✔ PASS") for line in lines[:grid_end])
    summary = next(line for line in lines[grid_end:] if line.startswith(FP8))  # key numbers
    assert summary.split()[-8:-2] == ["10", "0.2493", "0.8", "-0.7981", "1", "0.2753"]


EXPECTED = [FP8, FP32, BF16]  # failing first, then least k3_kl (neither the scan's nor k3's)


def listings(lines: list[str]) -> list[list[str]]:
    """Each run of consecutive lines that open with a setting (a table's rows, a list's items;
    HTML tags and table borders aside): the settings they name, in order."""
    names = sorted(EXPECTED, key=len, reverse=True)
    found: list[list[str]] = [[]]
    for line in lines:
        text = re.sub(r"<[^>]*>", "", line).lstrip(" │|>\n").replace("\\|", "|")
        hit = next((n for n in names if text.startswith(n)), None)
        if hit is None:
            found.append([])
        else:
            found[-1].append(hit)
    return [f for f in found if len(f) > 1]


def test_one_setting_order_everywhere(
    matrix: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The scan's output, probe report's terminal, report.md, report.html and the PR comment
    list the settings in one order (``rundir.order``) in every table and list of them."""
    from mismatch_probe import cli

    # no line wraps: a listed item is one line
    monkeypatch.setattr(cli, "_stdout_console", lambda: Console(width=300))
    code, terminal, _ = run_probe(["report", str(matrix)], monkeypatch, capsys)
    assert code == 0
    code, comment, _ = run_probe(
        ["report", str(matrix), "--format", "pr-comment"], monkeypatch, capsys
    )
    assert code == 0
    html = (matrix / "report.html").read_text()
    html_rows = [row for table in html.split("<table")[1:] for row in table.split("<tr")]
    outputs = {
        "scan": scan_lines(matrix),
        "report terminal": terminal.splitlines(),
        "report.md": (matrix / "report.md").read_text().splitlines(),
        "report.html": html_rows,
        "pr comment": comment.splitlines(),
    }
    for name, lines in outputs.items():
        found = listings(lines)
        assert len(found) >= 2, name  # the grid and the key numbers at least
        assert all(f == EXPECTED for f in found), (name, found)
    md = (matrix / "report.md").read_text()
    assert md.index("## Every setting judged") < md.index("**Recommendation for")
    assert comment.index("Every setting judged") < comment.index("**Recommendation for")


def test_setting_order_from_the_store_before_run_json(tmp_path: Path) -> None:
    """A scan writes its reports before run.json: the scan's order comes from the run metadata
    in the token store, not the alphabet (bf16 < fp32 would make bf16 the reference)."""
    from mismatch_probe import store
    from mismatch_probe.rundir.context import setting_names

    seqs = {FP32: uniform_seqs(0.0, [4]), BF16: uniform_seqs(0.01, [4])}
    run = matrix_run(tmp_path / "m", seqs)
    (run / store.RUN_FILE).unlink()
    assert setting_names(run) == [FP32, BF16]
