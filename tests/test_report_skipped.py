"""Settings a reader must see: a matrix whose settings the backend partly refused names and
counts the skipped ones (with why) in report.md, report.html, the PR comment and the terminal;
``probe compare --format pr-comment`` judges every setting of HEAD, paired or not. Views built
directly (``tests/views.py``)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from mismatch_probe.report import render
from mismatch_probe.report.comment import run_comment
from mismatch_probe.report.html import render_html
from mismatch_probe.report.markdown import render_markdown
from mismatch_probe.report.settings import settings_top_markdown
from mismatch_probe.rundir.context import Entry
from tests.views import METRICS, RUN, run_view

REASON = "fp8 weight quantization is not supported by the vLLM CPU backend"
RAN = ["rollout=fp32 | train=fp32", "rollout=fp16 | train=fp32", "rollout=bf16 | train=fp32"]
SKIPPED = [
    "rollout=fp32,quant=fp8 | train=fp32",
    "rollout=fp16,quant=fp8 | train=fp32",
    "rollout=bf16,quant=fp8 | train=fp32",
]
MATRIX_RUN = {
    **RUN,
    "setting": RAN[0],
    "settings": [*RAN, *SKIPPED],
    "rollouts": [{"setting": s.split(" | ")[0], "skipped": None} for s in RAN]
    + [{"setting": s.split(" | ")[0], "skipped": REASON} for s in SKIPPED],
}


def matrix_view() -> tuple[object, list[Entry]]:
    ctx = run_view(run=MATRIX_RUN, setting=RAN[0], settings=tuple(RAN))
    entries = [Entry(name, dict(METRICS), {}) for name in RAN]
    return ctx, entries


def assert_names_skipped(text: str) -> None:
    text = text.replace("\\|", "|")  # a Markdown table cell escapes the pipe
    for name in SKIPPED:
        assert name in text
    assert REASON in text
    assert "3 of 6 settings did not run" in text
    assert "All 3 settings pass every check" not in text


def test_view_lists_skipped_settings_with_reason() -> None:
    ctx, _ = matrix_view()
    assert ctx.skipped == tuple((name, REASON) for name in SKIPPED)  # type: ignore[attr-defined]
    assert run_view().skipped == ()


def test_report_md_and_html_name_and_count_skipped_settings() -> None:
    ctx, entries = matrix_view()
    top = settings_top_markdown(entries, RAN[0], 3, ctx.skipped)  # type: ignore[attr-defined]
    text = render_markdown(ctx, {}, Path("."), top)  # type: ignore[arg-type]
    assert_names_skipped(text)
    assert "All 3 settings that ran pass every check" in text
    html = render_html(text, Path("."), "t")
    assert_names_skipped(html.replace("&amp;", "&"))


def test_one_setting_ran_of_several_lists_the_rest() -> None:
    run = {**MATRIX_RUN, "settings": [RAN[0], *SKIPPED], "rollouts": MATRIX_RUN["rollouts"][:1]}
    run["rollouts"] = [*run["rollouts"], *MATRIX_RUN["rollouts"][3:]]
    ctx = run_view(run=run)
    text = render_markdown(ctx, {}, Path(".")).replace("\\|", "|")
    for name in SKIPPED:
        assert name in text
    assert "3 of 4 settings did not run" in text
    comment = run_comment(ctx)
    assert "3 of 4 settings did not run" in comment and REASON in comment


def test_pr_comment_names_and_counts_skipped_settings() -> None:
    ctx, entries = matrix_view()
    assert_names_skipped(run_comment(ctx, entries))  # type: ignore[arg-type]


def test_terminal_names_and_counts_skipped_settings() -> None:
    ctx, entries = matrix_view()
    console = Console(file=io.StringIO(), width=200, record=True)
    render(ctx, entries, console)  # type: ignore[arg-type]
    assert_names_skipped(console.export_text())


def test_scan_summary_counts_skipped_settings(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from mismatch_probe.report.summary import render_summary

    result = SimpleNamespace(
        out_dir=tmp_path,
        paths={},
        run={**MATRIX_RUN, "timings": {"generation": 1.0}},
        settings={name: {**METRICS, "rollout_tokens_per_s": 10.0} for name in RAN},
        skipped={name.split(" | ")[0]: REASON for name in SKIPPED},
        report=SimpleNamespace(routing={}, attribution={}),
        entries=[],  # no recommendation to show
    )
    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    render_summary(result, console)  # type: ignore[arg-type]
    assert_names_skipped(console.file.getvalue())  # type: ignore[attr-defined]
