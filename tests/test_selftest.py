"""``probe selftest`` on the tiny model: one real scan, every fault of the table against its
detector (the selftest's own table; ``make test`` runs it here)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from mismatch_probe.report.selftest import render_selftest
from mismatch_probe.selftest import FAULTS, SelftestResult, run_selftest
from tests.cli_runner import run_probe

pytestmark = pytest.mark.engine

# Rows whose detector branch issue29 adds (implausible_logprob; per-sequence holds of
# shifted_by_one): they cannot hold before it is merged; then this set becomes empty.


@pytest.fixture(scope="module")
def result(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> SelftestResult:
    work = tmp_path_factory.mktemp("selftest")
    return run_selftest(tiny_model, work, Console(file=io.StringIO()))


def test_every_fault_is_caught_by_its_detector(result: SelftestResult) -> None:
    assert [r.fault for r in result.rows] == list(FAULTS)
    seen = {r.fault.name: r.seen for r in result.rows}
    held = {r.fault.name for r in result.rows if r.held}
    assert held == {f.name for f in FAULTS}, seen
    assert seen["clean control"] == "no finding; probe check passes"
    assert "the rollout side flatter" in seen["temperature gap, T=0.7"]  # trainer sharper
    assert "the rollout side sharper" in seen["temperature gap, T=1.3"]
    assert seen["trainer copies rollout"] == "trainer_copies_rollout (warning)"
    assert seen["rounded to fp16"].startswith("equal store: exit 0; rounded: exit 1")
    assert seen["one setting past a bound"].endswith(
        "failing: rollout=fp32 | train=fp32 (faulty copy)"
    )
    assert result.passed and result.tokens >= 100


def test_the_table_says_what_held(result: SelftestResult) -> None:
    rows = [(r.fault.name, r.fault.injected, r.fault.expect, r.seen, r.held) for r in result.rows]
    console = Console(file=io.StringIO(), width=240)
    render_selftest(rows, result.model, result.tokens, console)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "must be caught by" in text and "probe check --exact" in text
    assert f"all {len(FAULTS)} rows hold" in text
    missed = [(*row[:4], False) if i == 0 else row for i, row in enumerate(rows)]
    render_selftest(missed, result.model, result.tokens, console)
    assert f"1 of {len(FAULTS)} rows do not hold" in console.file.getvalue()  # type: ignore[attr-defined]


def test_out_must_be_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    (tmp_path / "x").write_text("")
    code, _, err = run_probe(["selftest", "--out", str(tmp_path)], monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"error: --out {tmp_path}: exists and is not an empty directory"
    ]
