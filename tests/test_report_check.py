"""``probe check``: exit 0 when every bound holds, 1 when one fails, 2 on bad usage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mismatch_probe.gate.bounds import parse_bound
from mismatch_probe.report.integrity import CLEAN
from tests.cli_runner import run_probe
from tests.test_report_fixtures import uniform_run

R = 0.1  # every token: train - rollout = 0.1, so kl = -0.1 and k3_kl = e^0.1 - 1.1

CLEAN_LINE = "✔ " + CLEAN  # the data-integrity line, first


def run_main(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any) -> tuple[int, str]:
    """``probe ARGS`` in-process: (exit code, stdout + stderr)."""
    code, out, err = run_probe(args, monkeypatch, capsys)
    return code, out + err


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(uniform_run(tmp_path_factory.mktemp("check") / "run", R, [4, 6]))


def test_all_bounds_hold(run: str, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    args = ["check", run, "--max", "k3_kl=0.01", "--min", "kl=-0.2", "--min", "num_tokens=10"]
    code, out = run_main(args, monkeypatch, capsys)
    assert code == 0
    assert out.splitlines() == [
        CLEAN_LINE,
        "✔ PASS  k3_kl = 0.00517092 ≤ 0.01 (max)",
        "✔ PASS  kl = -0.1 ≥ -0.2 (min)",
        "✔ PASS  num_tokens = 10 ≥ 10 (min)",
        "all bounds hold",
    ]


def test_a_failing_bound_exits_1_and_says_by_how_much(
    run: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = ["check", run, "--max", "k3_kl=1e-3", "--max", "chi2_token=1", "--min", "kl=0"]
    code, out = run_main(args, monkeypatch, capsys)
    assert code == 1
    assert out.splitlines() == [
        CLEAN_LINE,
        "✘ FAIL  k3_kl = 0.00517092 > 0.001 (max) by 0.004171, 5.17× the bound",
        "✔ PASS  chi2_token = 0.221403 ≤ 1 (max)",
        "✘ FAIL  kl = -0.1 < 0 (min) by 0.1",
        "2 of 3 bounds failed",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max", "k3kl=1e-3"], "error: --max k3kl: unknown metric (did you mean k3_kl"),
        (
            ["--min", "prob_pearson=high"],
            "error: --min 'prob_pearson=high': 'high' is not a number",
        ),
        (["--max", "k3_kl"], "error: --max 'k3_kl': expected METRIC=VALUE"),
        (["--max", "k3_kl=nan"], "the bound must be a finite number"),
        ([], "error: no bound given"),
    ],
)
def test_bad_usage_exits_2(
    run: str, args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    code, out = run_main(["check", run, *args], monkeypatch, capsys)
    assert code == 2
    assert message in out
    assert "PASS" not in out and "FAIL" not in out


def test_missing_run_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    code, out = run_main(["check", str(tmp_path / "nope"), "--max", "kl=1"], monkeypatch, capsys)
    assert code == 2 and "is not a run directory" in out


def test_parse_bound_strips_spaces() -> None:
    bound = parse_bound(" prob_pearson = 0.99 ", "min")
    assert (bound.metric, bound.kind, bound.limit) == ("prob_pearson", "min", 0.99)
