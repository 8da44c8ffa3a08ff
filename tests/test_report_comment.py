"""``--format pr-comment``: GitHub-flavoured Markdown parsed back with markdown-it-py (GFM
tables): the tables parse, model text stays inside its cell, nothing escapes its block."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

from mismatch_probe.gate.compare import load_comparison
from mismatch_probe.metrics.verdicts import HEALTH_CHECKS
from mismatch_probe.report.comment import (
    CLIP,
    COMMENT_LIMIT,
    FOOTER,
    change_cell,
    comparison_comment,
    fit,
    run_comment,
)
from mismatch_probe.report.sections import visible
from mismatch_probe.rundir import load_report, load_run
from tests.cli_runner import run_probe as run_cli
from tests.test_report_fixtures import Seq, make_run, mixed_seqs, uniform_run
from tests.test_report_html import HOSTILE, hostile_seq

ALLOWED_HTML = re.compile(r"</?(b|details|sub)>|<summary>[^<>]*</summary>")


def k3(r: float) -> float:
    return math.exp(r) - 1.0 - r


def parse(text: str) -> list[Token]:
    return MarkdownIt("commonmark").enable("table").parse(text)


def inline_text(token: Token) -> str:
    """What a reader sees of an inline token: its text and code, tags dropped."""
    kinds = ("text", "code_inline", "softbreak")
    return "".join(c.content for c in token.children or [] if c.type in kinds)


def tables(tokens: list[Token]) -> list[list[list[str]]]:
    """Every table as rows of cell texts (header row first)."""
    out: list[list[list[str]]] = []
    row: list[str] = []
    for i, tok in enumerate(tokens):
        if tok.type == "table_open":
            out.append([])
        elif tok.type == "tr_open":
            row = []
        elif tok.type in ("th_open", "td_open"):
            row.append(inline_text(tokens[i + 1]))
        elif tok.type == "tr_close":
            out[-1].append(row)
    return out


def raw_cell_counts(text: str) -> list[set[int]]:
    """For each Markdown table, the set of cell counts of its lines (one value if regular)."""
    counts: list[set[int]] = []
    previous = False
    for line in text.splitlines():
        is_row = line.startswith("|")
        if is_row and not previous:
            counts.append(set())
        if is_row:
            counts[-1].add(len(re.split(r"(?<!\\)\|", line)) - 2)
        previous = is_row
    return counts


def assert_contained(text: str) -> list[Token]:
    """The checks every comment must pass; returns its tokens."""
    assert len(text) < COMMENT_LIMIT
    tokens = parse(text)
    flat = [c for t in tokens for c in [t, *(t.children or [])]]
    assert not [t for t in flat if t.type in ("image", "link_open")]
    for t in flat:
        if t.type in ("html_inline", "html_block"):
            for piece in re.findall(r"<[^>]*>(?:[^<]*</summary>)?", t.content):
                assert ALLOWED_HTML.fullmatch(piece), piece
    blocks = [t.content.strip() for t in tokens if t.type == "html_block"]
    assert blocks.count("</details>") == sum(b.startswith("<details>") for b in blocks)
    assert all(t.level == 0 for t in tokens if t.type == "html_block")
    fences = [t for t in tokens if t.type in ("fence", "code_block")]
    assert [(t.type, t.info) for t in fences] == [("fence", "text")]
    assert fences[0].content.startswith("r = log p_train − log p_rollout")
    assert all(len(c) == 1 for c in raw_cell_counts(text))  # every row as wide as its header
    return tokens


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("comment") / "run", [*mixed_seqs(), hostile_seq()])


def test_run_comment_parses_and_model_text_stays_in_its_cell(hostile_run: Path) -> None:
    text = run_comment(load_run(hostile_run))
    tokens = assert_contained(text)
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings == [
        "Mismatch report: tiny-llama",
        "Verdicts",
        "Key metrics",
        "Threshold sweep",
        "Parity block",
        "Log-ratio histogram",
        "Worst tokens",
    ]
    worst = next(t for t in tables(tokens) if t[0][:3] == ["#", "seq:pos", "token in context"])
    assert worst[1][:3] == ["1", "3:1", visible("".join(HOSTILE[:6]))]  # the text, as text
    assert worst[1][-1] == "—"  # no flip, p = 0.3: no cause is claimed
    verdicts = next(t for t in tables(tokens) if t[0][0] == "verdict")
    assert len(verdicts) == 1 + len(HEALTH_CHECKS) and all(len(r) == 6 for r in verdicts)
    assert text.endswith(FOOTER + "\n")
    assert "<summary>Every metric (" in text and "<summary>Settings</summary>" in text


def test_huge_model_text_is_clipped(tmp_path: Path) -> None:
    lp = math.log(0.5)
    big = Seq(["x" * 200_000, " y"], [lp, lp], [lp - 2.0, lp], [False, False])
    text = run_comment(load_run(make_run(tmp_path / "run", [big])))
    assert_contained(text)
    assert "x" * (CLIP - 1) + "…" in text and "x" * CLIP not in text


def test_a_part_that_does_not_fit_is_left_out_with_a_note() -> None:
    text = fit([("A", ["a" * 9]), ("B", ["b" * 200]), ("C", ["c"])], limit=200)
    note = "*B: left out, the comment would pass 200 characters.*\n\n"
    assert text == "a" * 9 + "\n" + note + "c\n" + FOOTER + "\n"
    assert len(text) <= 200


CI = "95% CI of the change"


@pytest.mark.parametrize(
    ("key", "base", "value", "ci", "cell"),
    [
        ("k3_kl", 0.01, 0.015, (0.002, 0.008), f"↑ +50% 🔴 worse, {CI} [+0.002, +0.008]"),
        ("k3_kl", 0.02, 0.015, (-0.009, -0.001), f"↓ -25% 🟢 better, {CI} [-0.009, -0.001]"),
        ("k3_kl", 0.01, 0.015, (-0.001, 0.011), f"↑ +50% within noise, {CI} [-0.001, +0.011]"),
        ("k3_kl", 0.01, 0.015, None, "↑ +50% (no noise estimate)"),  # small runs: not judged
        ("rollout_is_eff_sample_size", 0.99, 0.98947, None, "↓ -0.0535% (no noise estimate)"),
        ("prob_pearson", 0.9, 0.99, None, "↑ +10% (no noise estimate)"),
        # signed metrics near 0: a difference, not a percentage (the "-534% worse")
        ("kl", -0.01, -0.03, (-0.025, -0.015), f"↓ -0.02 🔴 worse, {CI} [-0.025, -0.015]"),
        ("kl", 0.0006, -0.0026, (-0.004, 0.001), f"↓ -0.0032 within noise, {CI} [-0.004, +0.001]"),
        ("log_ppl_diff", 1e-4, -2e-4, None, "↓ -0.0003"),  # no better direction
        ("num_tokens", 10.0, 20.0, None, "↑ +100%"),  # a count: no better or worse
        ("f_tau_2", 0.0, 0.002, (0.001, 0.003), f"↑ +0.002 🔴 worse, {CI} [+0.001, +0.003]"),
        ("k3_kl", 0.01, 0.01, None, "= no change"),
        ("rollout_is_eff_sample_size", 1.0, 1.0 - 1e-9, None, "= no change"),  # equal as shown
        ("k3_kl", None, 0.01, None, "—"),
    ],
)
def test_change_cell(key: str, base: float | None, value: float | None, ci: Any, cell: str) -> None:
    assert change_cell(key, base, value, ci) == cell


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("pair")
    return [
        uniform_run(base / "main", 0.01, [4, 6]),
        uniform_run(base / "pr", 0.03, [4, 6, 5, 5], prompts="q.jsonl"),
    ]


def test_comparison_comment_shows_the_change_with_arrows(pair: list[Path]) -> None:
    text = comparison_comment(load_comparison(pair, intervals=True))
    tokens = assert_contained(text)
    assert text.startswith("### Mismatch: pr vs main (tiny-llama)\n")
    assert "> ⚠️ **The runs differ:** prompts file differs (main: p.jsonl; pr: q.jsonl)" in text
    key = next(t for t in tables(tokens) if t[0][0] == "metric")
    assert key[0] == ["metric", "main (baseline)", "pr", "change vs main"]
    rows = {r[0]: r[1:] for r in key[1:]}
    assert rows["num_tokens"] == ["10", "20", "↑ +100%"]
    growth = k3(0.03) / k3(0.01) - 1.0  # hand-computed: every token has r = 0.01 vs 0.03
    # 2 and 4 responses: too few for a noise estimate, so no colour
    assert rows["k3_kl"][2] == f"↑ {100 * growth:+.3g}% (no noise estimate)"
    assert rows["kl"][2] == "↓ -0.02 (no noise estimate)"  # kl = -r: -0.01 -> -0.03
    verdicts = next(t for t in tables(tokens) if t[0][0] == "check")
    assert verdicts[0][-2:] == ["main (baseline)", "pr"]
    assert all(re.fullmatch(r"(✅|❌|➖) \S+( computed)?", c) for r in verdicts[1:] for c in r[-2:])


def test_cli_prints_only_the_comment(
    pair: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = ["compare", *map(str, pair), "--out", str(tmp_path / "c"), "--format", "pr-comment"]
    code, out, _ = run_cli(args, monkeypatch, capsys)
    assert code == 0 and out == comparison_comment(load_comparison(pair, intervals=True))
    assert (tmp_path / "c" / "compare.html").is_file()  # the files are written either way
    code, out, _ = run_cli(["report", str(pair[1]), "--format", "pr-comment"], monkeypatch, capsys)
    assert code == 0 and out.startswith("### Mismatch report: tiny-llama\n")
    assert out == run_comment(load_report(pair[1])[0])
    assert "\n✅ Data integrity: clean (" in out  # one line, first after the header
    assert (pair[1] / "report.html").is_file()


def test_unknown_format_exits_2(pair: list[Path], monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    code, out, err = run_cli(["report", str(pair[0]), "--format", "html"], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert err.strip() == "error: --format: one of terminal, pr-comment, got 'html'"
