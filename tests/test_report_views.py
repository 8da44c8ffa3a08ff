"""Renderers on views built by hand (``tests/views.py``): exact terminal and Markdown output of
what each is handed, with no token store behind it (style guide 8 and 16)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from mismatch_probe.report import render
from mismatch_probe.report.markdown import escape, settings_section, worst_section
from mismatch_probe.report.routing import routing_markdown, summary_lines
from mismatch_probe.report.terminal import header, worst_table
from mismatch_probe.report.trend_table import render_markdown, render_table
from mismatch_probe.rundir.trend import build_trend
from tests.test_faults import ROUTING_OK
from tests.views import run_view, token

WORST = (
    token("[bold]x[/bold]", 0.3, after=" cat", seq_pos=(0, 0)),
    token(" sat", 0.9, before="The cat", after="⏎ on", flip=True, seq_pos=(2, 2)),
)


HEADER = (
    "mismatch_probe report\n"
    "  run             runs/run\n"
    "  model           tiny-llama\n"
    "  precisions      rollout=bf16 | train=fp32\n"
    "  prompts         2 from p.jsonl\n"
    "  chat template   no\n"
    "  sampling        temperature=1.0 top_p=1.0 top_k=-1\n"
    "  max tokens      16\n"
    "  log-probs       raw\n"
    "  response tokens 19\n"
    "  responses       3\n"
)
# p train = 0.4 * exp(r): 0.54 (r = 0.3) and 0.984 (r = 0.9); the second is a support flip
WORST_TABLE = (
    "Worst tokens (largest |log ρ|)                                                                      \n"  # noqa: E501
    "┏━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━┳━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━┓\n"
    "┃ # ┃ seq:pos ┃ token ⟦in context⟧                       ┃ log ρ ┃ p roll ┃ p train ┃ cause        ┃\n"  # noqa: E501
    "┡━━━╇━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━╇━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━━━┩\n"
    "│ 1 │ 0:0     │ ⟦[bold]x[/bold]⟧ cat                     │  +0.3 │    0.4 │    0.54 │ —            │\n"  # noqa: E501
    "│ 2 │ 2:2     │ The cat⟦ sat⟧⏎ on                        │  +0.9 │    0.4 │   0.984 │ support flip │\n"  # noqa: E501
    "└───┴─────────┴──────────────────────────────────────────┴───────┴────────┴─────────┴──────────────┘\n"
)  # fmt: skip
WORST_MD = [
    "| # | seq:pos | token in context | log ρ | p rollout | p train | cause |",
    "| ---: | --- | --- | ---: | ---: | ---: | --- |",
    "| 1 | 0:0 | <b>\\[bold\\]x\\[/bold\\]</b> cat | +0.3 | 0.4 | 0.5399 | — |",
    "| 2 | 2:2 | The cat<b> sat</b>⏎ on | +0.9 | 0.4 | 0.9838 | support flip |",
]
TREND_TABLE = (
    "Trend over training steps    \n"
    "┏━━━━━━┳━━━━━━━┳━━━━━━━━━━━━┓\n"
    "┃ step ┃ k3_kl ┃ chi2_token ┃\n"
    "┡━━━━━━╇━━━━━━━╇━━━━━━━━━━━━┩\n"
    "│    1 │ 0.001 │        0.5 │\n"
    "│    2 │ 0.002 │        1.5 │\n"
    "└──────┴───────┴────────────┘\n"
    "On-policy training: the ratio\n"
    "measures engine mismatch.    \n"
)  # fmt: skip


def console() -> Console:
    return Console(file=io.StringIO(), width=100, force_terminal=True, color_system=None)


def output(c: Console) -> str:
    return c.file.getvalue()  # type: ignore[attr-defined]


def test_header_exact_output() -> None:
    c = console()
    c.print(header(run_view()))
    assert output(c) == HEADER


def test_worst_tokens_exact_output() -> None:
    """Model text is never read as markup; each token's cause from what the view says of it."""
    c = console()
    c.print(worst_table(WORST))
    assert output(c) == WORST_TABLE


def test_worst_tokens_markdown_exact() -> None:
    assert worst_section(WORST)[4:8] == WORST_MD


def test_settings_section_names_the_prompts_file_only() -> None:
    lines = settings_section(run_view())
    assert "| prompts | 2 from p.jsonl |" in lines  # no absolute path of the machine
    assert "| precisions | rollout=bf16 \\| train=fp32 |" in lines


def test_the_whole_terminal_report_of_a_view() -> None:
    c = console()
    render(run_view(worst=WORST), None, c)
    text = output(c)
    assert text.startswith("✔ Data integrity: clean")
    assert HEADER in text and "⟦[bold]x[/bold]⟧ cat" in text and "support flip" in text
    assert "Recommendation: None needed: no verdict fails." in text


def test_routing_section_of_a_view() -> None:
    (line,) = summary_lines(ROUTING_OK)
    assert line == (
        "routing rollout=bf16 | train=fp32: 25.00% of tokens differ in >= 1 layer, "
        "mean Jaccard 0.8500"
    )
    text = routing_markdown(ROUTING_OK, {})
    heading = ["## MoE routing (engine vs trainer)", ""]
    assert text.splitlines()[:3] == [*heading, f"- {escape(line)}"]
    assert "![" not in text  # no plot handed, none linked


def test_trend_of_a_view() -> None:
    per_step = {1: {"k3_kl": 0.001, "chi2_token": 0.5}, 2: {"k3_kl": 0.002, "chi2_token": 1.5}}
    trend = build_trend(per_step, {"off_policy": {"staleness": False}})
    assert trend is not None and trend.crossings == {"chi2_token": [2]}
    c = console()
    c.print(render_table(trend))
    assert output(c) == TREND_TABLE
    md = render_markdown(trend, None, Path("."))
    assert f"- ❌ {escape('chi2_token (≤ 1, verl): crosses at step 2')}" in md
    assert "| 2 | 0.002 | **❌ 1.5** |" in md
