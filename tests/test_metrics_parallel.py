"""The metric engine on several cores: batches computed into fresh engines on any thread and
merged in file order give the serial result bit for bit, whatever the number of workers, on one
file and on the same rows split into shard parts; ``merge`` of two engines equals one engine fed
both batches (every accumulator's merge, one by one)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics import MetricsConfig, compute_metrics
from mismatch_probe.metrics.batch import batch_from_table
from mismatch_probe.metrics.stream import MetricEngine
from tests.bench.metrics import write_synthetic_store
from tests.bench.sharded_metrics import split_store


def _exact(result) -> str:
    """Every number of a result as its shortest repr: equal strings, equal bits."""
    return json.dumps(result.to_json_dict(), sort_keys=True, default=str)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 300,000 tokens in row groups of 65,536 rows (several batches), with turns."""
    path = tmp_path_factory.mktemp("parallel") / "plain.parquet"
    write_synthetic_store(path, 300_000, seed=5)
    table = pq.read_table(path)
    turn = (table.column("position").to_numpy() // 300).astype(np.int32)
    entropy = np.abs(np.sin(np.arange(table.num_rows))).astype(np.float32)
    table = table.append_column("turn", pa.array(turn)).append_column(
        "train_entropy", pa.array(entropy)
    )
    out = path.with_name("tokens.parquet")
    pq.write_table(table, out, row_group_size=65_536)
    return out


@pytest.mark.parametrize("workers", [2, 3, 7])
def test_any_number_of_workers_gives_the_serial_result_bit_for_bit(
    store: Path, workers: int
) -> None:
    serial = compute_metrics(store, workers=1)
    assert pq.ParquetFile(store).num_row_groups >= 4 and len(serial.per_turn) > 1
    assert _exact(compute_metrics(store, workers=workers)) == _exact(serial)


def test_a_sharded_store_gives_the_single_files_result_bit_for_bit(
    store: Path, tmp_path: Path
) -> None:
    split_store(store, tmp_path / "tokens", 3)
    single = _exact(compute_metrics(store, workers=1))
    assert _exact(compute_metrics(tmp_path / "tokens", workers=2)) == single
    assert _exact(compute_metrics(tmp_path / "tokens", workers=1)) == single


def test_merging_partials_equals_feeding_one_engine(store: Path) -> None:
    """Two batches: one engine updated with both vs a third engine merging each one's partial;
    every accumulator's state, attribute by attribute."""
    table = pq.read_table(store).slice(0, 50_000)
    seq = table.column("seq_id").to_numpy()
    cut = int(np.flatnonzero(seq[1:] != seq[:-1])[10]) + 1
    halves = [table.slice(0, cut), table.slice(cut)]
    config = MetricsConfig()
    serial, merged = MetricEngine(config, True), MetricEngine(config, True)
    for half in halves:
        turn = pc.cast(half.column("turn"), pa.int64()).to_numpy()
        serial.update(batch_from_table(half), turn)
        merged.merge(MetricEngine(config, True).partial(batch_from_table(half), turn))
    for mine, theirs in zip([serial.counts, *serial.parts, serial.turns],
                            [merged.counts, *merged.parts, merged.turns], strict=True):  # fmt: skip
        assert repr(_state(mine)) == repr(_state(theirs)), type(mine).__name__
    assert _exact(serial.result("x")) == _exact(merged.result("x"))


def _state(obj: object) -> object:
    """An accumulator's state as plain values (arrays as lists, nested objects walked)."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_state(v) for v in obj]
    if hasattr(obj, "__dict__"):
        return {k: _state(v) for k, v in vars(obj).items() if k != "parts"}
    return obj


def test_steps_in_one_pass_equal_each_steps_own_pass_even_unordered(tmp_path: Path) -> None:
    """A foreign store whose step 1 comes back after step 2: every step still equals
    ``compute_metrics(step=N)`` bit for bit, and the run equals ``compute_metrics``."""
    from mismatch_probe.metrics.steps import compute_by_step

    rng = np.random.default_rng(2)
    path = tmp_path / "tokens.parquet"
    with pq.ParquetWriter(path, pa.schema([("step", pa.int64()), ("seq_id", pa.int64()),
                                           ("position", pa.int32()),
                                           ("rollout_logprob", pa.float32()),
                                           ("train_logprob", pa.float32())])) as w:  # fmt: skip
        for k, step in enumerate([1, 1, 2, 2, 1, 3]):
            seq = np.repeat(np.arange(k * 50, k * 50 + 50), 40)
            rollout = -rng.exponential(1.0, len(seq))
            w.write_table(pa.table({
                "step": np.full(len(seq), step), "seq_id": seq,
                "position": np.tile(np.arange(40, dtype=np.int32), 50),
                "rollout_logprob": rollout.astype(np.float32),
                "train_logprob": (rollout + rng.normal(0, 0.05, len(seq))).astype(np.float32),
            }))  # fmt: skip
    run, steps = compute_by_step(path, workers=2)
    assert _exact(run) == _exact(compute_metrics(path, workers=1))
    assert sorted(steps) == [1, 2, 3]
    for step, flat in steps.items():
        assert repr(flat) == repr(compute_metrics(path, step=step).flat()), step


def test_ordered_map_holds_back_new_items_over_its_budget() -> None:
    """``ordered_map``'s ``budget``: no item starts while those in flight cost that much or
    more (one always runs); the results keep the items' order."""
    import threading
    import time

    from mismatch_probe.parallel import ordered_map

    lock = threading.Lock()
    running, most = [0], [0]

    def work(item: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return item * 2

    items = list(range(12))
    assert list(ordered_map(work, items, width=4, cost=lambda i: 10, budget=20)) == [
        2 * i for i in items
    ]
    assert most[0] == 2  # the third item waits for the first result
    most[0] = 0
    assert list(ordered_map(work, items, width=4, cost=lambda i: 100, budget=20)) == [
        2 * i for i in items
    ]
    assert most[0] == 1  # each item alone over the budget: one at a time
    most[0] = 0
    assert list(ordered_map(work, items, width=4)) == [2 * i for i in items]
    assert most[0] == 4


def test_token_ids_read_afterwards_equal_those_read_with_every_row(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass reads row locators in place of ``token_id`` and the worst tokens' ids after it
    (where ``store.clean_int64_column``): the same result as a pass that reads every id, on
    one file and on its shards; a null id still fails as before."""
    from mismatch_probe.metrics import stream

    split_store(store, tmp_path / "tokens", 3)
    later = [_exact(compute_metrics(p, workers=2)) for p in (store, tmp_path / "tokens")]
    assert stream.clean_int64_column([store], "token_id")
    monkeypatch.setattr(stream, "clean_int64_column", lambda *_: False)
    assert later == [_exact(compute_metrics(p, workers=2)) for p in (store, tmp_path / "tokens")]
    table = pq.read_table(store)
    ids = table.column("token_id").to_numpy().astype(object)
    ids[77] = None
    table = table.set_column(table.column_names.index("token_id"), "token_id",
                             pa.array(list(ids), pa.int32()))  # fmt: skip
    pq.write_table(table, tmp_path / "nulls.parquet", row_group_size=65_536)
    monkeypatch.undo()
    with pytest.raises(ProbeError, match="token_id holds nulls"):
        compute_metrics(tmp_path / "nulls.parquet")
