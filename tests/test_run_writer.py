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


# --- one writer per run directory -------------------------------------------------------------


def test_two_ingests_into_one_new_out(tmp_path: Path) -> None:
    """Started at once (two processes): one writes the run, the other is refused in one line
    (by the lock while the first writes, or by the check under it once the first is done),
    and the first run is left whole."""
    import os
    import subprocess
    import sys

    from tests.ingest_fixtures import synthetic_steps, write_prime_rl

    src = write_prime_rl(tmp_path / "src", synthetic_steps([1, 2, 3], seqs=2))
    out = tmp_path / "runs" / "run"
    probe = Path(sys.executable).with_name("probe")
    env = {**os.environ, "COLUMNS": "200"}
    procs = [
        subprocess.Popen(
            [str(probe), "ingest", "prime-rl", str(src), "--out", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read() if p.stderr else "") for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    err = next(e for code, e in results if code == 2)
    assert err.count("\n") == 1 and err.startswith("error: --out ") and "Traceback" not in err
    assert "being written by another probe process" in err or "not an empty directory" in err
    run = load_run(out)
    assert run.run["kind"] == "ingest" and run.metrics["num_sequences"] == 6
    assert not [p for p in out.parent.iterdir() if p.name != out.name]  # nothing left beside


def scan_args(model: Path, out: Path) -> list[str]:
    return ["scan", "--model", str(model), "--num-prompts", "1", "--max-tokens", "2",
            "--out", str(out)]  # fmt: skip


def test_a_scan_into_a_run_being_written_is_refused(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Another writer holds ``--out`` (here this process, through its own descriptor): the
    scan stops before any engine starts, in one line naming the holder, and writes nothing."""
    import os

    from mismatch_probe.store.lock import run_lock

    out = tmp_path / "run"
    out.mkdir()
    with run_lock(out):
        code, _, err = run_probe(scan_args(tiny_model, out), monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out {out} is being written by another probe process (pid {os.getpid()}" in err
    assert sorted(p.name for p in out.iterdir()) == [".probe-lock"]


def test_a_scan_finished_since_the_first_check_is_not_replaced(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The second check, under the lock: another scan finished into ``--out`` between this
    scan's first check and its lock (simulated: run.json appears as the lock is taken)."""
    import contextlib

    from mismatch_probe.store import lock

    out = tmp_path / "run"
    taken = lock.run_lock

    @contextlib.contextmanager
    def finished_meanwhile(run_dir: Path, what: str = "--out") -> Any:
        (Path(run_dir) / store.RUN_FILE).write_text('{"theirs": 1}')
        with taken(run_dir, what) as path:
            yield path

    monkeypatch.setattr(lock, "run_lock", finished_meanwhile)
    code, _, err = run_probe(scan_args(tiny_model, out), monkeypatch, capsys)
    assert code == 2 and f"--out {out} holds a run already (run.json)" in err, err
    assert json.loads((out / store.RUN_FILE).read_text()) == {"theirs": 1}
    assert not (out / store.TOKENS_FILE).exists()


def test_a_sharded_store_is_tied_part_by_part(tmp_path: Path) -> None:
    """A sharded scan's ``tokens/``: each finished shard's part, by its path in the store."""
    import pyarrow.parquet as pq

    from tests.test_report_fixtures import SETTING, token_table

    folder = tmp_path / store.TOKENS_DIR
    for shard, r in ((0, 0.01), (1, 0.02)):
        part = folder / f"shard={shard}" / "part-0.parquet"
        part.parent.mkdir(parents=True)
        pq.write_table(token_table(uniform_seqs(r, [3, 4]), SETTING), part)
        (part.parent / "_SUCCESS").write_text("{}")
    tie = store_tie(folder)
    assert tie["rows"] == 14
    assert [p["path"] for p in tie["parts"]] == ["shard=0/part-0.parquet", "shard=1/part-0.parquet"]
    assert same_store(tie, folder)
    pq.write_table(token_table(uniform_seqs(0.03, [3, 4]), SETTING), part)  # shard 1 rewritten
    assert not same_store(tie, folder)
