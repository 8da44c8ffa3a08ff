"""``probe compare``: two runs whose metric ratios are known by hand."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mismatch_probe import cli, store
from mismatch_probe.errors import ProbeError
from mismatch_probe.gate.compare import load_comparison, run_differences
from mismatch_probe.report.compare import OVERLAYS, compare_rows
from mismatch_probe.rundir import Entry, load_run
from tests.test_report_fixtures import SETTING, run_metadata, token_table, uniform_run, uniform_seqs


def k3(r: float) -> float:
    return math.exp(r) - 1.0 - r


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("compare")
    a = uniform_run(base / "a", 0.01, [4, 6])
    b = uniform_run(base / "b", 0.03, [4, 6, 5, 5], model="other-llama", prompts="q.jsonl")
    return [a, b]


def test_ratios_to_the_first_run(runs: list[Path]) -> None:
    comparison = load_comparison(runs)
    assert [e.label for e in comparison.entries] == ["a", "b"]  # same setting: directory names
    rows = {row.key: row for row in compare_rows(list(comparison.entries))}
    assert rows["num_tokens"].values == (10.0, 20.0)
    assert rows["num_tokens"].ratios == (1.0, 2.0)
    assert rows["kl"].ratios[1] == pytest.approx(3.0, rel=1e-4)  # kl = -r
    assert rows["log_ratio_abs_mean"].ratios[1] == pytest.approx(3.0, rel=1e-4)
    assert rows["k3_kl"].ratios[1] == pytest.approx(k3(0.03) / k3(0.01), rel=1e-3)
    assert rows["f_tau_2"].ratios == (None, None)  # 0 in the first run: no ratio


def test_warning_says_what_differs(runs: list[Path]) -> None:
    assert load_comparison(runs).warnings == (
        "model differs (a: tiny-llama; b: other-llama)",
        "prompts file differs (a: p.jsonl; b: q.jsonl)",
    )
    same = [run_metadata(SETTING), run_metadata(SETTING)]
    assert run_differences(["x", "y"], same) == []


def test_core_takes_entries_of_any_origin() -> None:
    curves: dict[str, Any] = {}
    rows = compare_rows([Entry("fp32", {"kl": 0.5}, curves), Entry("bf16", {"kl": 2.0}, curves)])
    assert [(r.key, r.values, r.ratios) for r in rows] == [("kl", (0.5, 2.0), (1.0, 4.0))]


def test_settings_inside_one_run(tmp_path: Path) -> None:
    """A precision-matrix store: one Entry per setting, compared like separate runs."""
    first = token_table(uniform_seqs(0.01, [4, 6]), "rollout=fp16 | train=fp32")
    second = token_table(uniform_seqs(0.03, [5]), "rollout=bf16 | train=fp32")
    second = second.set_column(1, "seq_id", pc.add(second.column("seq_id"), 10))
    run = tmp_path / "matrix"
    run.mkdir()
    tokens = pa.concat_tables([first, second])
    store.write_table(run / store.TOKENS_FILE, tokens, store.TOKEN_SCHEMA, {})
    contexts = [
        load_run(run, setting=s) for s in ("rollout=fp16 | train=fp32", "rollout=bf16 | train=fp32")
    ]
    entries = [Entry(c.label, c.metrics, c.curves) for c in contexts]
    rows = {r.key: r for r in compare_rows(entries)}
    assert [e.label for e in entries] == ["rollout=fp16 | train=fp32", "rollout=bf16 | train=fp32"]
    assert rows["num_tokens"].values == (10.0, 5.0)
    assert rows["kl"].ratios[1] == pytest.approx(3.0, rel=1e-4)
    assert contexts[1].worst[0].seq_id == 10


def test_one_run_is_not_a_comparison(runs: list[Path]) -> None:
    with pytest.raises(ProbeError, match="at least two"):
        load_comparison(runs[:1])


def test_cli_writes_table_plots_and_markdown(
    runs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    out = tmp_path / "cmp"
    monkeypatch.setattr(sys, "argv", ["probe", "compare", *map(str, runs), "--out", str(out)])
    cli.main()
    printed = capsys.readouterr().out
    assert "⚠ model differs (a: tiny-llama; b: other-llama)" in printed
    assert re.search(r"num_tokens\s+│\s+10 │\s+20 │\s+×2 │", printed)
    text = (out / "compare.md").read_text()
    assert "> **Warning:** model differs (a: tiny-llama; b: other-llama)" in text
    assert "| metric | a | b | × a |" in text
    assert "| `num_tokens` | 10 | 20 | ×2 |" in text
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert links == [f"compare_{name}.png" for name in OVERLAYS]
    for link in links:
        assert (out / link).read_bytes()[:4] == b"\x89PNG"
