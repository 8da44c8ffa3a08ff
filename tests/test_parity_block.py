"""The parity block (metrics spec section 9) and ``probe check --exact``: on run directories the
tests write (no CPU engine is batch invariant), one whose two sides are bitwise equal and one
with a single differing token."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.metrics import compute_metrics
from mismatch_probe.metrics.parity import PARITY_KEYS
from tests.cli_runner import run_probe
from tests.test_report_fixtures import Seq, make_run, matrix_run

LENGTHS = [7, 5, 9]


def equal_seqs(seed: int = 0) -> list[Seq]:
    """Both sides the same float32 values (a batch-invariant engine's run)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in LENGTHS:
        lp = [float(x) for x in np.log(rng.uniform(0.05, 0.95, n)).astype(np.float32)]
        out.append(Seq([f"w{i}" for i in range(n)], lp, list(lp), [False] * n))
    return out


def one_differing(seqs: list[Seq], seq: int = 1, position: int = 3) -> list[Seq]:
    """``seqs`` with the training log-prob of one token moved by 0.25."""
    train = list(seqs[seq].train)
    train[position] -= 0.25
    return [s._replace(train=train) if i == seq else s for i, s in enumerate(seqs)]


def block(metrics: dict[str, float]) -> dict[str, float]:
    return {k.removeprefix("parity/"): metrics[k] for k in PARITY_KEYS}


def test_bitwise_equal_sides_give_the_clean_block(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", equal_seqs())
    metrics = compute_metrics(run).flat()
    assert block(metrics) == {
        "token_count": sum(LENGTHS), "torch_equal_fp32": 1.0, "mismatch_count": 0.0,
        "max_absdiff_fp32": 0.0, "k3_mean": 0.0, "k3_max": 0.0,
    }  # fmt: skip
    stored = json.loads((run / "metrics.json").read_text())
    assert all(key in stored for key in PARITY_KEYS)


def test_one_differing_token_is_counted(tmp_path: Path) -> None:
    seqs = one_differing(equal_seqs())
    metrics = compute_metrics(make_run(tmp_path / "run", seqs)).flat()
    got = block(metrics)
    train, rollout = np.float32(seqs[1].train[3]), np.float32(seqs[1].rollout[3])
    r = float(train) - float(rollout)
    assert got["mismatch_count"] == 1.0 and got["torch_equal_fp32"] == 0.0
    assert got["token_count"] == sum(LENGTHS)
    assert got["max_absdiff_fp32"] == float(np.abs(train - rollout))  # in float32
    assert got["k3_max"] == pytest.approx(math.expm1(r) - r, rel=1e-12)
    assert got["k3_mean"] == metrics["k3_kl"]  # the same value, bit for bit


def test_check_exact_passes_a_bitwise_equal_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    run = make_run(tmp_path / "run", equal_seqs())
    code, out, err = run_probe(["check", str(run), "--exact"], monkeypatch, capsys)
    assert code == 0, out + err
    assert f"✔ PASS  exact: 0 of {sum(LENGTHS)} tokens differ" in out
    assert "exact: bitwise equal" in out


def test_check_exact_fails_on_one_differing_token_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    seqs = one_differing(equal_seqs())
    run = make_run(tmp_path / "run", seqs)
    code, out, err = run_probe(["check", str(run), "--exact"], monkeypatch, capsys)
    assert code == 1, out + err
    train, rollout = float(np.float32(seqs[1].train[3])), float(np.float32(seqs[1].rollout[3]))
    assert f"✘ FAIL  exact: 1 of {sum(LENGTHS)} tokens differ" in out
    assert f"seq_id 1, position 3: train_logprob {train!r}, rollout_logprob {rollout!r}" in out
    # without --exact the same run passes a bound it meets: --exact is what fails it
    code, out, _ = run_probe(["check", str(run), "--max", "k3_kl=1"], monkeypatch, capsys)
    assert code == 0, out


def test_check_exact_names_the_failing_setting_of_a_matrix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    settings = {"a": equal_seqs(1), "b": one_differing(equal_seqs(2), seq=2, position=0)}
    run = matrix_run(tmp_path / "run", settings)
    code, out, err = run_probe(["check", str(run), "--exact"], monkeypatch, capsys)
    assert code == 1, out + err
    assert "✔ PASS  exact (setting a): 0 of" in out
    # setting b's seq_ids follow a's three sequences: its third sequence is seq_id 5
    assert "✘ FAIL  exact (setting b): 1 of" in out and "seq_id 5, position 0" in out


def test_the_block_is_in_the_report_and_the_pr_comment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    run = make_run(tmp_path / "run", one_differing(equal_seqs()))
    code, comment, err = run_probe(
        ["report", str(run), "--format", "pr-comment"], monkeypatch, capsys
    )
    assert code == 0, err
    assert "#### Parity block" in comment and "| `parity/mismatch_count` | 1 |" in comment
    report = (run / "report.md").read_text()
    assert "## Parity block" in report and "| `parity/torch_equal_fp32` | 0 |" in report
    code, out, err = run_probe(["metrics", str(run), "--json"], monkeypatch, capsys)
    assert code == 0, err
    assert json.loads(out)["parity/mismatch_count"] == 1


def test_exact_on_a_trend_run_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A verl-log trend run has no tokens: ``--exact`` cannot hold there, nor pass silently."""
    from tests.test_export import _verl_log

    log, out = tmp_path / "exp.jsonl", tmp_path / "trend"
    _verl_log(log)
    code, _, err = run_probe(
        ["ingest", "verl-log", str(log), "--out", str(out)], monkeypatch, capsys
    )
    assert code == 0, err
    code, _, err = run_probe(["check", str(out), "--exact"], monkeypatch, capsys)
    assert code == 2 and "it has no tokens for --exact" in err
