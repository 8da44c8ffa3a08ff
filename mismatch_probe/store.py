"""The token store: the Parquet files that are the contract between pipeline stages.

A run directory holds

* ``tokens.parquet``: one row per response token (``TOKEN_SCHEMA``). Rows of one sequence are
  contiguous and in position order, and a row group never splits a sequence when we write it;
  readers still group by ``seq_id`` (``iter_sequence_batches``) so that any Parquet file with the
  required columns works, whoever wrote it.
* ``sequences.parquet``: one row per response (``SEQUENCE_SCHEMA``).
* ``run.json``: the run metadata, also stored in both files' key-value metadata under
  ``mismatch_probe.run``.

A sharded scan writes ``tokens/`` and ``sequences/`` directories of parts instead
(``dataset``: ``tokens/shard=K/part-0.parquet``); every reader here takes a file or such a
directory alike.

Sign convention used by every later stage: ``r = train_logprob - rollout_logprob``.

This module knows nothing about vLLM or transformers; it writes and reads tables.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.dataset import part_files
from mismatch_probe.errors import ProbeError

SCHEMA_VERSION = "1"
META_KEY = b"mismatch_probe.run"
VERSION_KEY = b"mismatch_probe.schema_version"

TOKEN_SCHEMA = pa.schema(
    [
        pa.field("setting", pa.string(), nullable=False),  # e.g. "rollout=bf16 | train=fp32"
        pa.field("seq_id", pa.int64(), nullable=False),  # unique in the file
        pa.field("prompt_id", pa.int64(), nullable=False),  # line index in the prompts file
        pa.field("sample_id", pa.int32(), nullable=False),  # 0..samples_per_prompt-1
        pa.field("position", pa.int32(), nullable=False),  # 0-based in the response
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("token_text", pa.string(), nullable=False),  # decoded alone, for reports
        pa.field("rollout_logprob", pa.float32(), nullable=False),  # engine, sampled token
        pa.field("train_logprob", pa.float32(), nullable=False),  # training forward, same token
        pa.field("support_flip", pa.bool_(), nullable=False),  # top-k/top-p boundary at risk
    ]
)

SEQUENCE_SCHEMA = pa.schema(
    [
        pa.field("setting", pa.string(), nullable=False),
        pa.field("seq_id", pa.int64(), nullable=False),
        pa.field("prompt_id", pa.int64(), nullable=False),
        pa.field("sample_id", pa.int32(), nullable=False),
        pa.field("prompt_text", pa.string(), nullable=False),  # after the chat template
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("prompt_length", pa.int32(), nullable=False),  # tokens
        pa.field("response_length", pa.int32(), nullable=False),  # tokens
        pa.field("finish_reason", pa.string(), nullable=False),  # "stop" | "length" | ...
    ]
)

# The columns a metrics reader needs; any Parquet file with these can be analysed.
METRIC_COLUMNS = ("seq_id", "position", "rollout_logprob", "train_logprob")

TOKENS_FILE = "tokens.parquet"
SEQUENCES_FILE = "sequences.parquet"
RUN_FILE = "run.json"
TOKENS_DIR = "tokens"  # a sharded store's directory datasets (``dataset``)
SEQUENCES_DIR = "sequences"

ROW_GROUP_TOKENS = 65_536


def _with_metadata(schema: pa.Schema, run: dict[str, Any]) -> pa.Schema:
    return schema.with_metadata(
        {META_KEY: json.dumps(run, sort_keys=True, default=str), VERSION_KEY: SCHEMA_VERSION}
    )


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


def write_table(path: Path, table: pa.Table, schema: pa.Schema, run: dict[str, Any]) -> None:
    """Write ``table`` to ``path`` atomically, in row groups that never split a sequence.

    The file is written under a hidden temporary name and renamed when complete, so an
    interrupted write never leaves a file that looks complete; an existing file at ``path``
    stays as it was until the rename.
    """
    table = table.select(schema.names).cast(_with_metadata(schema, run))
    tmp = _tmp_path(path)
    try:
        with pq.ParquetWriter(tmp, table.schema, compression="zstd") as writer:
            for start, stop in _sequence_aligned_chunks(table, ROW_GROUP_TOKENS):
                writer.write_table(table.slice(start, stop - start))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _sequence_aligned_chunks(table: pa.Table, target: int) -> Iterator[tuple[int, int]]:
    """Row ranges of about ``target`` rows that end on a ``seq_id`` change."""
    n = table.num_rows
    if n == 0:
        yield 0, 0
        return
    seq = table.column("seq_id").to_numpy()
    start = 0
    while start < n:
        stop = min(start + target, n)
        while stop < n and seq[stop] == seq[stop - 1]:
            stop += 1
        yield start, stop
        start = stop


def write_text(path: Path, text: str) -> None:
    """Write a text file atomically (temporary name, then rename)."""
    tmp = _tmp_path(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (temporary name, then rename)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def open_parquet(path: Path, required: Sequence[str] = METRIC_COLUMNS) -> pq.ParquetFile:
    """Open a token store, checking it is readable Parquet with the ``required`` columns.

    ``path`` may be a directory of parts (``dataset.part_files``): every part is checked, and
    the first one is returned (its schema is the store's: use it for column names and metadata).
    """
    opened = [_open_part(p, required) for p in part_files(path)]
    return opened[0]


def _open_part(path: Path, required: Sequence[str]) -> pq.ParquetFile:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ProbeError(f"{path} is not a readable Parquet file ({exc})") from None
    missing = [c for c in required if c not in pf.schema_arrow.names]
    if missing:
        raise ProbeError(f"{path} lacks the column(s) {', '.join(missing)}")
    return pf


def resolve_tokens_path(path: Path) -> Path:
    """A run directory, a Parquet file or a directory of parts -> the token store's path: a run
    directory's ``tokens.parquet``, else its sharded ``tokens/`` directory."""
    if not path.is_dir():
        return path
    single, sharded = path / TOKENS_FILE, path / TOKENS_DIR
    if single.exists() or not (sharded.is_dir() or _holds_parts(path)):
        return single
    return sharded if sharded.is_dir() else path


def _holds_parts(path: Path) -> bool:
    """True for a directory that is itself a table (``shard=K`` folders or Parquet parts)."""
    return any(p.name.startswith("shard=") or p.suffix == ".parquet" for p in path.iterdir())


def read_run_metadata(path: Path) -> dict[str, Any]:
    """The run metadata stored in a token store's key-value metadata ({} if none)."""
    meta = open_parquet(path, required=()).schema_arrow.metadata or {}
    return json.loads(meta[META_KEY]) if META_KEY in meta else {}


def iter_sequence_batches(
    path: Path, columns: Sequence[str] = METRIC_COLUMNS
) -> Iterator[pa.Table]:
    """Yield tables of whole sequences, a row group (or a bounded piece of one) at a time.

    Memory stays bounded whatever the file's row-group size (see ``_chunks``). A sequence that
    continues into the next chunk is carried over, so every yielded table holds complete
    sequences. Rows of a sequence must be contiguous in the file (our writer guarantees it); a
    sequence that reappears after others is an error, since its statistics could not be
    computed in one pass.

    Yields:
        Tables with ``columns`` (plus ``seq_id``), rows in file order: each sequence's rows
        together, sequences in order of appearance (rows are not re-sorted by position).
    """
    cols = list(dict.fromkeys(["seq_id", *columns]))
    files = [_open_part(p, cols) for p in part_files(path)]
    seen: set[int] = set()
    carry: pa.Table | None = None
    try:
        for group in (chunk for pf in files for chunk in _chunks(pf, cols)):
            if carry is not None:
                group = pa.concat_tables([carry, group])
            if group.num_rows == 0:
                continue
            seq = group.column("seq_id").to_numpy()
            tail_start = _last_run_start(seq)
            complete, carry = group.slice(0, tail_start), group.slice(tail_start)
            if complete.num_rows:
                _check_contiguous(complete.column("seq_id").to_numpy(), seen, path)
                yield complete
        if carry is not None and carry.num_rows:
            _check_contiguous(carry.column("seq_id").to_numpy(), seen, path)
            yield carry
    except (pa.ArrowException, OSError) as exc:
        raise ProbeError(f"{path} is corrupt ({exc})") from None


def _chunks(pf: pq.ParquetFile, cols: list[str]) -> Iterator[pa.Table]:
    """The file as tables of at most ``2 * ROW_GROUP_TOKENS`` rows (one of our row groups fits
    whole), reading one row group at a time: no read-ahead across groups, and a foreign file's
    huge row group is decoded piece by piece."""
    for i in range(pf.num_row_groups):
        for batch in pf.iter_batches(2 * ROW_GROUP_TOKENS, row_groups=[i], columns=cols):
            yield pa.Table.from_batches([batch])


def _last_run_start(seq: Any) -> int:
    """Index where the final run of equal seq_ids begins."""
    import numpy as np

    change = np.flatnonzero(seq[1:] != seq[:-1])
    return int(change[-1] + 1) if len(change) else 0


def _check_contiguous(seq: Any, seen: set[int], path: Path) -> None:
    """Record the sequences of a batch in ``seen``; fail if one was seen in an earlier run."""
    import numpy as np

    starts = seq[np.r_[True, seq[1:] != seq[:-1]]].tolist()
    if len(set(starts)) != len(starts) or not seen.isdisjoint(starts):
        raise ProbeError(
            f"{path}: the rows of a sequence are not contiguous; sort the file by seq_id"
        )
    seen.update(starts)
