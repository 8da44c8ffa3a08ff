"""Faults that cover part of a run (issue 29, metrics spec section 8 amended): a share of the
sequences shifted, one step shifted or copied, most sequences copied, placeholders of -1e9. Each
check's finding holds on the sequences (and steps) it covers, with their share; a step's finding
is a finding of the run (its report line, ``probe check`` without ``--step``, the
recommendation). Unit tests on crafted stores written with pyarrow (no model, no engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe import store
from mismatch_probe.metrics import compute_metrics
from mismatch_probe.metrics.integrity import COPY_MESSAGE, ERROR, WARNING, compute_integrity
from mismatch_probe.metrics.recommend import recommend
from mismatch_probe.report.integrity import integrity_markdown
from mismatch_probe.rundir import load_report
from tests.cli_runner import run_probe

N_SEQS, LENGTH = 30, 20
SETTING = "verl-dp: a vs b"


def clean(rng: np.random.Generator) -> tuple[list[float], list[float]]:
    """A rollout side in [-3, -0.05] and a training side a little off it (at most 0)."""
    rollout = rng.uniform(-3.0, -0.05, LENGTH)
    return list(np.minimum(rollout + rng.normal(0, 0.01, LENGTH), 0.0)), list(rollout)


def sequences(faults: dict[int, str], seed: int = 0) -> tuple[list[list[float]], list[list[float]]]:
    """``N_SEQS`` sequences, sequence i with the fault ``faults.get(i)``: ``shift`` (train[t] =
    rollout[t+1]), ``copy`` (train = rollout bit for bit), ``low_train``/``low_rollout`` (one
    token at -1e9 on that side), else clean."""
    rng = np.random.default_rng(seed)
    trains, rollouts = [], []
    for i in range(N_SEQS):
        train, rollout = clean(rng)
        fault = faults.get(i)
        if fault == "shift":
            train = [*rollout[1:], -1.0]
        elif fault == "copy":
            train = list(rollout)
        elif fault == "low_train":
            train[3] = -1e9
        elif fault == "low_rollout":
            rollout[3] = -1e9
        trains.append(train)
        rollouts.append(rollout)
    return trains, rollouts


def write_run(path: Path, steps: dict[int, dict[int, str]], kind: str = "ingest") -> Path:
    """A run directory of one setting: per step (``{step: faults}``; step 0 alone: a store
    without a ``step`` column) ``N_SEQS`` sequences of ``LENGTH`` tokens."""
    path.mkdir(parents=True)
    columns: dict[str, list[Any]] = {k: [] for k in ("step", "seq", "train", "rollout")}
    for n, (step, faults) in enumerate(steps.items()):
        trains, rollouts = sequences(faults, seed=n)
        for i, (train, rollout) in enumerate(zip(trains, rollouts, strict=True)):
            columns["step"] += [step] * LENGTH
            columns["seq"] += [n * N_SEQS + i] * LENGTH
            columns["train"] += train
            columns["rollout"] += rollout
    rows = len(columns["seq"])
    data: dict[str, Any] = {
        "setting": [SETTING] * rows,
        "seq_id": pa.array(columns["seq"], pa.int64()),
        "position": pa.array(np.tile(np.arange(LENGTH), rows // LENGTH), pa.int32()),
        "rollout_logprob": pa.array(columns["rollout"], pa.float32()),
        "train_logprob": pa.array(columns["train"], pa.float32()),
    }
    if list(steps) != [0]:
        data["step"] = pa.array(columns["step"], pa.int64())
    pq.write_table(pa.table(data), path / store.TOKENS_FILE)
    run = {"kind": kind, "setting": SETTING}
    if kind == "ingest":
        run["source"] = {"format": "verl-dp"}
    store.write_json(path / store.RUN_FILE, run)
    return path


def found(path: Path, kind: str = "ingest") -> dict[str, Any]:
    """The run's findings by check, as ``integrity.json`` holds them."""
    integrity = compute_integrity(path, {"kind": kind})
    return {f.check: f for f in integrity.findings}


# --- the checks, from the sequences and steps they hold on -----------------------------------


@pytest.mark.parametrize("held", [9, 15])
def test_a_share_of_sequences_shifted(tmp_path: Path, held: int) -> None:
    """30% and 50% of the sequences shifted by one (the pooled means may not show it)."""
    run = write_run(tmp_path / "run", {0: dict.fromkeys(range(held), "shift")}, kind="scan")
    f = found(run, "scan")["shifted_by_one"]
    assert (f.severity, f.sequences, f.share, f.steps) == (ERROR, held, held / N_SEQS, None)
    share = f"{round(100 * held / N_SEQS)}% of sequences ({held} of {N_SEQS}) are shifted by one"
    assert share in f.message and "shifted by +1 token" in f.message


def test_one_shifted_sequence_of_thirty_is_not_a_finding(tmp_path: Path) -> None:
    """Below the partial rule (5% of the sequences and at least 2): 1 of 30."""
    run = write_run(tmp_path / "run", {0: {4: "shift"}}, kind="scan")
    assert found(run, "scan") == {}


def test_one_step_shifted(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", {1: {}, 2: dict.fromkeys(range(N_SEQS), "shift"), 3: {}})
    integrity = compute_integrity(run, {"kind": "ingest"})
    f = {f.check: f for f in integrity.findings}["shifted_by_one"]
    assert (f.severity, f.sequences, f.steps) == (ERROR, N_SEQS, (2,))
    assert f.share == pytest.approx(1 / 3)
    assert f.message.startswith("step 2: the training log-probs match the rollout's shifted")
    assert integrity.of_step(1) == () and integrity.of_step(3) == ()
    assert integrity.error_checks() == ["shifted_by_one"]


def test_one_step_copied(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", {1: {}, 2: dict.fromkeys(range(N_SEQS), "copy"), 3: {}})
    f = found(run)["trainer_copies_rollout"]
    assert (f.severity, f.tokens, f.sequences, f.steps) == (WARNING, 600, N_SEQS, (2,))
    assert f.message == f"step 2: {COPY_MESSAGE}"


def test_most_sequences_copied(tmp_path: Path) -> None:
    """27 of 30 sequences bit for bit: a warning with its share (not every token is)."""
    run = write_run(tmp_path / "run", {0: dict.fromkeys(range(27), "copy")})
    f = found(run)["trainer_copies_rollout"]
    assert (f.severity, f.tokens, f.sequences, f.share) == (WARNING, 27 * LENGTH, 27, 0.9)
    assert f.message.startswith("on 90% of sequences (27 of 30), the training side equals")
    # a scan's identical sides are the identity check, not a copy
    assert "trainer_copies_rollout" not in found(run, "scan")


def test_short_identical_sequences_are_no_copy(tmp_path: Path) -> None:
    """Sequences under 8 valid tokens can match by chance: two such are no finding."""
    path = tmp_path / "t.parquet"
    rng = np.random.default_rng(3)
    train, rollout = zip(*(clean(rng) for _ in range(N_SEQS)), strict=True)
    rows = [(list(t), list(r)) for t, r in zip(train, rollout, strict=True)]
    rows[0] = (rows[0][1][:7], rows[0][1][:7])
    rows[1] = (rows[1][1][:7], rows[1][1][:7])
    lengths = [len(t) for t, _ in rows]
    table = pa.table(
        {
            "seq_id": pa.array(np.repeat(np.arange(N_SEQS), lengths), pa.int64()),
            "position": pa.array(np.concatenate([np.arange(k) for k in lengths]), pa.int32()),
            "rollout_logprob": pa.array([x for _, r in rows for x in r], pa.float32()),
            "train_logprob": pa.array([x for t, _ in rows for x in t], pa.float32()),
        }
    )
    pq.write_table(table, path)
    assert compute_integrity(path, {"kind": "ingest"}).findings == ()


# --- the run's findings: report line, probe check, recommendation -----------------------------


ERROR_LINE = "Data integrity: 1 error (numbers below may not mean what they say)"
WARNING_LINE = "Data integrity: 1 warning (numbers below may not mean what they say)"
CASES = {  # steps and faults, the check, its summary line, probe check's exit code
    "30% shifted": ({0: dict.fromkeys(range(9), "shift")}, "shifted_by_one", ERROR_LINE, 1),
    "step 2 shifted": (
        {1: {}, 2: dict.fromkeys(range(N_SEQS), "shift"), 3: {}},
        "shifted_by_one",
        ERROR_LINE,
        1,
    ),
    "step 2 copied": (
        {1: {}, 2: dict.fromkeys(range(N_SEQS), "copy"), 3: {}},
        "trainer_copies_rollout",
        WARNING_LINE,
        0,
    ),
    "27 of 30 copied": (
        {0: dict.fromkeys(range(27), "copy")},
        "trainer_copies_rollout",
        WARNING_LINE,
        0,
    ),
    "-1e9 rollout": ({0: {5: "low_rollout"}}, "implausible_logprob", ERROR_LINE, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_partial_faults_reach_the_report_and_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, case: str
) -> None:
    """The report's integrity line, the recommendation (investigate first: an error, or a
    copy of the rollout side) and ``probe check``'s exit code without ``--step``."""
    steps, check, summary, code = CASES[case]
    run = write_run(tmp_path / "run", steps)
    ctx, _ = load_report(run)
    lines = integrity_markdown(ctx.integrity)
    assert lines[:3] == ["## Data integrity", "", summary]
    assert f"`{check}`" in lines[4]
    if "step" in case:
        assert f"`{check}`" in lines[4] and ": step 2: " in lines[4]
    recommendation = ctx.tables["recommendation"]
    assert recommendation["outcome"] == "investigate_first"
    assert check in recommendation["reason"]
    got, out, _ = run_probe(["check", str(run), "--max", "k3_kl=10"], monkeypatch, capsys)
    last = out.splitlines()[-1]
    assert got == code
    if code:
        assert f"; integrity error: {check} (--accept CHECK" in last
    else:
        assert last == "all bounds hold" and f"warning {check}" in out


@pytest.mark.parametrize("side", ["low_train", "low_rollout"])
def test_minus_1e9_on_either_side_is_implausible(tmp_path: Path, side: str) -> None:
    run = write_run(tmp_path / "run", {0: {5: side, 6: side}}, kind="scan")
    f = found(run, "scan")["implausible_logprob"]
    assert (f.severity, f.tokens, f.sequences, f.share) == (ERROR, 2, 2, 2 / N_SEQS)
    assert "below -10000 (lowest -1e+09)" in f.message
    if side == "low_rollout":  # k3 overflows: the flag alone turns the recommendation
        metrics = compute_metrics(run)
        flat = metrics.flat()
        assert flat["k3_kl_overflow"] == 1.0
        rec = recommend(flat, metrics.config.describe())
        assert rec.outcome == "investigate_first" and "k3_kl_overflow is set" in rec.reason


def test_a_low_but_real_logprob_is_plausible(tmp_path: Path) -> None:
    """-9000 nats (the metric engine's floor is -9999) is no placeholder."""
    run = write_run(tmp_path / "run", {0: {}}, kind="scan")
    table = pq.read_table(run / store.TOKENS_FILE)
    train = table.column("train_logprob").to_numpy().copy()
    train[3] = -9000.0
    table = table.set_column(4, "train_logprob", pa.array(train, pa.float32()))
    pq.write_table(table, run / store.TOKENS_FILE)
    assert "implausible_logprob" not in found(run, "scan")
