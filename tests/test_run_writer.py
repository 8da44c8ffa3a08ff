"""A run directory's answers come from the store it holds (issue 29): ``metrics.json`` tied to
its token store (row count and each Parquet part's fingerprint), recomputed when the store was
replaced; and one writer per run directory (``store.lock.run_lock`` held by scan and ingest)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe import store
from mismatch_probe.metrics import compute_metrics
from mismatch_probe.rundir import load_run
from mismatch_probe.store.fingerprint import STORE_KEY, same_store, store_tie
from tests.cli_runner import run_probe
from tests.test_report_fixtures import make_run, uniform_run, uniform_seqs

SENTINEL = 0.123456  # a k3_kl no store below gives: seen only when metrics.json is reused


def edit_k3(run: Path, value: float, tie: bool = True) -> None:
    data = json.loads((run / store.METRICS_FILE).read_text())
    data["k3_kl"] = value
    if not tie:
        data.pop(STORE_KEY)
    store.write_json(run / store.METRICS_FILE, data)


def test_metrics_json_is_reused_only_for_its_own_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    run = uniform_run(tmp_path / "run", 0.01, [4, 6])
    tie = json.loads((run / store.METRICS_FILE).read_text())[STORE_KEY]
    assert tie["rows"] == 10 and [p["path"] for p in tie["parts"]] == [store.TOKENS_FILE]
    assert same_store(tie, run / store.TOKENS_FILE)
    edit_k3(run, SENTINEL)  # the tie still holds: metrics.json is what the run says
    assert load_run(run).metrics["k3_kl"] == SENTINEL

    # tokens.parquet replaced by another run's store (same rows, other log-probs)
    other = make_run(tmp_path / "other", uniform_seqs(0.5, [4, 6]), metrics=False)
    (other / store.TOKENS_FILE).replace(run / store.TOKENS_FILE)
    assert store_tie(run / store.TOKENS_FILE)["rows"] == 10
    assert not same_store(tie, run / store.TOKENS_FILE)
    fresh = compute_metrics(run).flat()["k3_kl"]
    assert fresh > 0.1 and load_run(run).metrics["k3_kl"] == fresh
    code, out, _ = run_probe(["check", str(run), "--max", "k3_kl=0.1"], monkeypatch, capsys)
    assert code == 1 and out.splitlines()[-1] == "1 of 1 bounds failed"  # the store's numbers
    code, _, _ = run_probe(["report", str(run)], monkeypatch, capsys)
    rewritten = json.loads((run / store.METRICS_FILE).read_text())
    assert code == 0 and rewritten["k3_kl"] == fresh
    assert same_store(rewritten[STORE_KEY], run / store.TOKENS_FILE)


def test_metrics_json_without_a_tie_is_recomputed(tmp_path: Path) -> None:
    """Written by an older version or by hand: nothing says which store it came from."""
    run = uniform_run(tmp_path / "run", 0.01, [4, 6])
    good = load_run(run).metrics["k3_kl"]
    edit_k3(run, SENTINEL, tie=False)
    assert load_run(run).metrics["k3_kl"] == good


def test_a_fingerprint_sees_a_rewrite_of_equal_size(tmp_path: Path) -> None:
    """Same rows, same schema, one log-prob changed: another footer (column statistics)."""
    a = make_run(tmp_path / "a", uniform_seqs(0.01, [4, 6]), metrics=False)
    b = make_run(tmp_path / "b", uniform_seqs(0.02, [4, 6]), metrics=False)
    tie_a, tie_b = (store_tie(r / store.TOKENS_FILE) for r in (a, b))
    assert tie_a["rows"] == tie_b["rows"] and tie_a != tie_b
    assert tie_a == store_tie(a / store.TOKENS_FILE)  # stable
