"""``probe ingest`` measures the token store's row groups as they are written (``run._Measuring``,
``store.written_sequence_batches``): the metrics of the run and of each step, and the integrity
findings, are those a pass reading the finished store gives, bit for bit; a failure on either
side stops the other and leaves no run and no thread behind."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest import IngestConfig, run_ingest
from mismatch_probe.ingest.run import measure
from mismatch_probe.metrics import steps as steps_module
from tests.ingest_fixtures import Seq, write_nemo_rl, write_prime_rl

WRITERS = {"prime-rl": write_prime_rl, "nemo-rl": write_nemo_rl}
ROW_GROUP = 1_000  # small row groups: steps over several, a sequence over more than a chunk


def _steps(seed: int) -> dict[int, list[Seq]]:
    """Four steps of responses up to 2,600 tokens (one of 5,000: over two read chunks of
    2 * ROW_GROUP rows), a few non-finite log-probs (nulls in the store)."""
    rng = np.random.default_rng(seed)
    out = {}
    for step in (1, 2, 4, 7):
        batch = []
        for i in range(9):
            n = 5_000 if (step, i) == (2, 4) else int(rng.integers(50, 2_600))
            rollout = np.log(rng.uniform(0.05, 0.95, n))
            train = np.minimum(rollout + rng.normal(0.0, 0.02 * step, n), -1e-6)
            if i == 3:
                rollout[5], train[7] = math.nan, -math.inf
            prompt = rng.integers(1, 200, 4).tolist()
            batch.append(Seq(prompt, rng.integers(1, 200, n).tolist(), rollout.tolist(),
                             train.tolist()))  # fmt: skip
        out[step] = batch
    return out


def _assert_holds(written: object, want: object, where: str = "") -> None:
    """``written`` (``metrics.json``) holds ``want`` (the report adds to some records)."""
    if isinstance(want, dict):
        assert isinstance(written, dict), where
        for key, value in want.items():
            _assert_holds(written[key], value, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(written, list) and len(written) == len(want), where
        for i, (a, b) in enumerate(zip(written, want, strict=True)):
            _assert_holds(a, b, f"{where}[{i}]")
    else:
        assert repr(written) == repr(want), where


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("ingest-")}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_measured_as_written_equals_the_store_read_back(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "ROW_GROUP_TOKENS", ROW_GROUP)
    src = WRITERS[fmt](tmp_path / "src", _steps(seed=len(fmt)))
    out = tmp_path / "run"
    result = run_ingest(IngestConfig(fmt, src, out))
    tokens = out / store.TOKENS_FILE
    assert store.open_parquet(tokens).num_row_groups > 8  # steps over several row groups
    run = json.loads((out / store.RUN_FILE).read_text())
    whole, steps, integrity = measure(tokens, run)  # reading the finished store back
    assert repr(result.metrics) == repr(whole.flat())
    assert repr(result.steps) == repr(steps) and sorted(steps) == [1, 2, 4, 7]
    written = json.loads((out / "metrics.json").read_text())
    _assert_holds(written, json.loads(json.dumps(whole.to_json_dict(), default=str)))
    assert json.loads((out / "integrity.json").read_text()) == integrity.to_json_dict()
    assert run["counts"]["null_logprobs"] > 0  # the non-finite log-probs: nulls
    assert not _threads()


def test_a_failing_pass_stops_the_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of the metric pass reaches the writer at its next row group: the ingest fails
    with it, leaves no ``--out`` and no thread."""
    monkeypatch.setattr(store, "ROW_GROUP_TOKENS", ROW_GROUP)
    src = write_prime_rl(tmp_path / "src", _steps(seed=3))
    seen = []
    partials = steps_module._step_partials

    def failing(engine, table):  # type: ignore[no-untyped-def]
        seen.append(table.num_rows)
        if len(seen) == 2:
            raise ProbeError("the pass failed here")
        return partials(engine, table)

    monkeypatch.setattr(steps_module, "_step_partials", failing)
    with pytest.raises(ProbeError, match="the pass failed here"):
        run_ingest(IngestConfig("prime-rl", src, tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert not _threads()


def test_bad_input_late_stops_the_pass(tmp_path: Path) -> None:
    """A malformed line in the last step, found after the pass has measured the steps before
    it: the reader's error, no ``--out``, no thread."""
    src = write_prime_rl(tmp_path / "src", _steps(seed=4))
    last = src / "token_exports" / "step_7" / "rank_0.jsonl"
    with last.open("a") as fh:
        fh.write('{"schema_version": 1, "token_ids": [1, 2\n')
    with pytest.raises(ProbeError, match="step_7"):
        run_ingest(IngestConfig("prime-rl", src, tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert not _threads()


def _open_under(root: Path) -> list[str]:
    """Files under ``root`` this process still holds open."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("no /proc/self/fd to list open files on this system")
    targets = []
    for fd in fds.iterdir():
        try:
            targets.append(str(fd.readlink()))
        except OSError:
            continue
    return [t for t in targets if t.startswith(str(root))]


def test_an_interrupt_while_reading_stops_the_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt (``interrupt.Interrupted``, a BaseException) in the reading, with tables
    waiting for the pass: it propagates, the pass stops without computing them, both files
    are closed and removed, no thread is left."""
    from mismatch_probe.ingest.writer import RunStoreWriter
    from mismatch_probe.interrupt import Interrupted

    monkeypatch.setattr(store, "ROW_GROUP_TOKENS", ROW_GROUP)
    src = write_prime_rl(tmp_path / "src", _steps(seed=5))
    add = RunStoreWriter.add_batch
    batches = []

    def interrupted(self, batch):  # type: ignore[no-untyped-def]
        batches.append(batch.step)
        if len(batches) == 3:
            raise Interrupted(2, "reading")
        return add(self, batch)

    monkeypatch.setattr(RunStoreWriter, "add_batch", interrupted)
    with pytest.raises(Interrupted):
        run_ingest(IngestConfig("prime-rl", src, tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert not _open_under(tmp_path) and not _threads()


def test_a_failing_pass_closes_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass's error raised in the writer's thread, at a row group: the writer writes
    nothing twice and closes both files."""
    monkeypatch.setattr(store, "ROW_GROUP_TOKENS", ROW_GROUP)
    src = write_prime_rl(tmp_path / "src", _steps(seed=6))

    def failing(engine, table):  # type: ignore[no-untyped-def]
        raise ProbeError("the pass failed at once")

    monkeypatch.setattr(steps_module, "_step_partials", failing)
    with pytest.raises(ProbeError, match="failed at once"):
        run_ingest(IngestConfig("prime-rl", src, tmp_path / "run"))
    assert not _open_under(tmp_path) and not _threads()


def test_no_trained_token_ends_the_pass(tmp_path: Path) -> None:
    """Every sample masked out (NeMo-RL's ``sample_loss_mask`` 0): no row group reaches the
    pass; the error names the path, no thread is left."""
    src = write_nemo_rl(tmp_path / "src", _steps(seed=7))
    for file in src.glob("*.jsonl"):
        text = file.read_text()
        assert '"sample_loss_mask": [1.0]' in text
        file.write_text(text.replace('"sample_loss_mask": [1.0]', '"sample_loss_mask": [0.0]'))
    with pytest.raises(ProbeError, match="no trained token"):
        run_ingest(IngestConfig("nemo-rl", src, tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert not _open_under(tmp_path) and not _threads()
