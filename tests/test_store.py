"""The token store: schema, metadata, sequence-aligned row groups, atomic writes."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe import store
from mismatch_probe.errors import ProbeError


def tokens(lengths: list[int]) -> pa.Table:
    n = sum(lengths)
    seq = np.repeat(np.arange(len(lengths)), lengths)
    return pa.table(
        {
            "setting": ["s"] * n,
            "seq_id": seq.astype(np.int64),
            "prompt_id": seq.astype(np.int64),
            "sample_id": np.zeros(n, np.int32),
            "position": np.concatenate([np.arange(k) for k in lengths]).astype(np.int32),
            "token_id": np.arange(n, dtype=np.int32),
            "token_text": [f"t{i}" for i in range(n)],
            "rollout_logprob": np.full(n, -1.0, np.float32),
            "train_logprob": np.full(n, -1.1, np.float32),
            "support_flip": np.zeros(n, bool),
        }
    )


def test_write_roundtrip_schema_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "tokens.parquet"
    store.write_table(path, tokens([3, 1, 4]), store.TOKEN_SCHEMA, {"setting": "x", "n": 1})
    table = pq.read_table(path)
    assert table.schema.remove_metadata() == store.TOKEN_SCHEMA
    assert table.num_rows == 8
    assert store.read_run_metadata(path) == {"setting": "x", "n": 1}
    assert not list(tmp_path.glob(".*partial*"))


def test_row_groups_never_split_a_sequence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "ROW_GROUP_TOKENS", 4)
    path = tmp_path / "tokens.parquet"
    store.write_table(path, tokens([3, 3, 5, 1, 2]), store.TOKEN_SCHEMA, {})
    pf = pq.ParquetFile(path)
    groups = [pf.read_row_group(i).column("seq_id").to_pylist() for i in range(pf.num_row_groups)]
    assert groups == [[0, 0, 0, 1, 1, 1], [2, 2, 2, 2, 2], [3, 4, 4]]


def test_reader_regroups_sequences_split_by_another_writer(tmp_path: Path) -> None:
    path = tmp_path / "foreign.parquet"
    pq.write_table(tokens([3, 5, 2]), path, row_group_size=2)  # splits sequences
    batches = list(store.iter_sequence_batches(path))
    assert sum(b.num_rows for b in batches) == 10
    seen = [sorted(set(b.column("seq_id").to_pylist())) for b in batches]
    flat = [s for group in seen for s in group]
    assert flat == sorted(flat) == [0, 1, 2]  # every sequence whole, in exactly one batch


def test_reader_rejects_non_contiguous_sequences(tmp_path: Path) -> None:
    path = tmp_path / "shuffled.parquet"
    table = tokens([2, 2])
    pq.write_table(table.take([0, 2, 1, 3]), path)
    with pytest.raises(ProbeError, match="not contiguous"):
        list(store.iter_sequence_batches(path))


def test_interrupted_write_leaves_no_complete_looking_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokens.parquet"
    store.write_table(path, tokens([2]), store.TOKEN_SCHEMA, {"old": True})
    monkeypatch.setattr(store, "ROW_GROUP_TOKENS", 2)
    calls = {"n": 0}
    original = pq.ParquetWriter.write_table

    def crash_on_second(self: pq.ParquetWriter, table: pa.Table, *a: object, **k: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-write
        original(self, table, *a, **k)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        store.write_table(path, tokens([2, 2, 2]), store.TOKEN_SCHEMA, {"old": False})
    assert store.read_run_metadata(path) == {"old": True}  # the earlier file is intact
    assert pq.read_table(path).num_rows == 2
    assert [p.name for p in tmp_path.iterdir()] == ["tokens.parquet"]  # no partial left


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"not parquet at all", "not a readable Parquet file"), (b"PAR1\x00\x00PAR1", "Parquet")],
)
def test_corrupt_parquet_is_a_probe_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "tokens.parquet"
    path.write_bytes(content)
    with pytest.raises(ProbeError, match=message):
        list(store.iter_sequence_batches(path))


def test_missing_columns_are_named(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"seq_id": [1], "position": [0]}), path)
    with pytest.raises(ProbeError, match="rollout_logprob, train_logprob"):
        store.open_parquet(path)


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file()


def _publish(path: Path, text: str, barrier: Any = None, replace: bool = False) -> None:
    with store.atomic_dir(path, _complete, replace=replace) as tmp:
        (tmp / "config.json").write_text(text)
        if barrier is not None:
            barrier.wait()  # both directories are written before either is published


def test_atomic_dir_two_writers_at_once(tmp_path: Path) -> None:
    """Two processes converting the same model at once (threads here) each fill their own
    hidden directory; one is published whole, the other dropped, nothing hidden is left."""
    out = tmp_path / "model"
    barrier = threading.Barrier(2)
    writers = [threading.Thread(target=_publish, args=(out, text, barrier)) for text in ("a", "b")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert (out / "config.json").read_text() in ("a", "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_atomic_dir_first_complete_stays_unless_replaced(tmp_path: Path) -> None:
    out = tmp_path / "model"
    _publish(out, "a")
    _publish(out, "b")
    assert (out / "config.json").read_text() == "a"
    _publish(out, "c", replace=True)
    assert (out / "config.json").read_text() == "c"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_atomic_dir_replaces_a_damaged_directory(tmp_path: Path) -> None:
    """A directory without what makes it complete (an interrupted removal, a damaged cache) is
    replaced by the next conversion, not kept for good."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "junk").write_text("x")
    _publish(out, "a")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_atomic_dir_removes_what_a_killed_writer_left(tmp_path: Path) -> None:
    """A writer of this host killed mid-write leaves its hidden directory; the next write removes
    it. One of a live process, or of another host, stays."""
    import subprocess

    out = tmp_path / "model"
    gone = subprocess.Popen(["true"])  # a process of this host that has exited
    gone.wait()
    host = store._HOST
    orphan = tmp_path / f".model.partial-{host}-{gone.pid}-0000abcd"
    live = tmp_path / f".model.partial-{host}-{os.getpid()}-0000abcd"
    other = tmp_path / f".model.partial-elsewhere-{gone.pid}-0000abcd"
    for directory in (orphan, live, other):
        directory.mkdir()
    _publish(out, "a")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["model", live.name, other.name])


def test_atomic_dir_failed_write_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "model"
    with pytest.raises(RuntimeError), store.atomic_dir(out, _complete) as tmp:
        (tmp / "config.json").write_text("half")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_every_leaf_but_floats_is_compressed() -> None:
    """``parquet_options`` keys compression by Parquet leaf (``name.list.element``): lists of
    ids and expert routes stay zstd, float leaves (scalars or in lists) are plain, integer
    columns LZ4_RAW and token ids zstd, both without a dictionary; text keeps one."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from mismatch_probe.store import parquet_options

    schema = pa.schema([("seq_id", pa.int64()), ("token_id", pa.int32()),
                        ("train_logprob", pa.float32()), ("setting", pa.string()),
                        ("experts", pa.list_(pa.list_(pa.int16()))),
                        ("logprobs", pa.list_(pa.float32()))])  # fmt: skip
    table = pa.table({"seq_id": [1, 2], "token_id": [5, 6], "train_logprob": [-0.5, -1.0],
                      "setting": ["bf16", "bf16"], "experts": [[[1, 2]], [[3, 4]]],
                      "logprobs": [[-0.1], [-0.2]]}, schema=schema)  # fmt: skip
    buffer = io.BytesIO()
    pq.write_table(table, buffer, **parquet_options(schema))
    group = pq.ParquetFile(io.BytesIO(buffer.getvalue())).metadata.row_group(0)
    codecs = {group.column(i).path_in_schema: group.column(i).compression
              for i in range(group.num_columns)}  # fmt: skip
    # pyarrow names the LZ4_RAW codec "LZ4" (its footer says LZ4_RAW, as DuckDB reads it)
    assert codecs == {"seq_id": "LZ4", "token_id": "ZSTD", "train_logprob": "UNCOMPRESSED",
                      "setting": "ZSTD", "experts.list.element.list.element": "ZSTD",
                      "logprobs.list.element": "UNCOMPRESSED"}  # fmt: skip
    dictionary = {group.column(i).path_in_schema
                  for i in range(group.num_columns)
                  if "RLE_DICTIONARY" in group.column(i).encodings}  # fmt: skip
    assert "setting" in dictionary and not dictionary & {"seq_id", "token_id"}


def test_row_locators_read_back_the_values_of_their_rows(tmp_path: Path) -> None:
    """``ROW_COLUMN`` on a store of two parts, several row groups each, read whole and by row
    groups: ``read_rows`` gives each located row's value, in the order asked."""
    root = tmp_path / "tokens"
    root.mkdir()
    lengths = [5, 9, 2, 30, 7, 11, 3]
    for part, offset in (("a", 0), ("b", 1000)):
        table = tokens(lengths)
        table = table.set_column(1, "seq_id", pa.array(table.column("seq_id").to_numpy() + offset))
        table = table.set_column(5, "token_id", pa.array(np.arange(table.num_rows) * 7 + offset))
        pq.write_table(table, root / f"{part}.parquet", row_group_size=10)
    cols = ["seq_id", "token_id", store.ROW_COLUMN]
    for path, groups in ((root, None), (root / "b.parquet", [1, 3])):
        parts = store.part_files(path)
        read = pa.concat_tables(store.iter_sequence_batches(path, cols, groups, parts))
        rows = read.column(store.ROW_COLUMN).to_pylist()
        assert len(set(rows)) == read.num_rows
        picked = list(np.random.default_rng(0).permutation(rows)[:12]) + rows[:1]
        want = [read.column("token_id")[rows.index(r)].as_py() for r in picked]
        assert store.read_rows(parts, picked, "token_id") == want


def test_a_clean_int64_column_by_the_footers(tmp_path: Path) -> None:
    """Integers int64 holds, no null in the row groups read; the statistics found by the leaf
    column's path, a list column before it counting its own leaf."""
    table = tokens([4, 4, 4])
    table = table.add_column(0, "lists", pa.array([[1.0]] * 12))
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=4)
    assert store.clean_int64_column([path], "token_id")
    ids = pa.array([1, 2, 3, 4, 5, 6, 7, 8, 9, None, 11, 12], pa.int32())
    at = table.column_names.index("token_id")
    pq.write_table(table.set_column(at, "token_id", ids), path, row_group_size=4)
    assert not store.clean_int64_column([path], "token_id")
    assert store.clean_int64_column([path], "token_id", [0, 1])  # the null is in group 2
    big = pa.array(range(12), pa.uint64())
    pq.write_table(table.set_column(at, "token_id", big), path, row_group_size=4)
    assert not store.clean_int64_column([path], "token_id")
