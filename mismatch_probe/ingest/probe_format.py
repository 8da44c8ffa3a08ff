"""Reader of our own token schema (format ``probe``), written by ``ingest.hook.ProbeWriter``.

``DIR/step_<N>/*.parquet``, rows of a sequence contiguous (the writer writes row-major);
read ``ROWS_PER_READ`` rows at a time, the last, maybe incomplete, sequence carried over. The
batch rows a file's metadata counts (``ROWS_KEY``) but that hold no trained token come out as
empty records, so a step whose batch trained on nothing is reported, not silently dropped.
A file of another writer is checked first: each column of ``PROBE_SCHEMA`` must have its kind
(integer, float, string) and the integer columns no nulls, so no null becomes a number.

A step written again (a trainer restarted on the same directory: another ``ATTEMPT_KEY``) keeps,
per rank, the files of the latest attempt only; ``rewrites`` lists the steps where an earlier
attempt was replaced. Files without an attempt (older writers, foreign ones) are all kept.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.batches import SeqBatch, batch_of
from mismatch_probe.ingest.hook import (
    ATTEMPT_KEY,
    FORMAT_KEY,
    FORMAT_NAME,
    FORMAT_VERSION,
    OFF_POLICY_KEY,
    OFF_POLICY_SOURCE_KEY,
    PROBE_SCHEMA,
    RANK_KEY,
    ROWS_KEY,
    STALENESS_KEY,
    VERSION_KEY,
)
from mismatch_probe.ingest.records import SeqRecord, StepRange, require_dir, unique_steps

_STEP_DIR = re.compile(r"step_(\d+)$")
_RANK_FILE = re.compile(r"rank_(\d+)_\d+\.parquet$")
ROWS_PER_READ = 65_536
# The kind each column's Arrow type must have: (test, name for the error line).
_KINDS = {
    "int": (pa.types.is_integer, "integer"),
    "float": (pa.types.is_floating, "floating-point"),
    "string": (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)
               or pa.types.is_null(t), "string"),
}  # fmt: skip
_INT_COLUMNS = [f.name for f in PROBE_SCHEMA if pa.types.is_integer(f.type)]


def _kind(t: pa.DataType) -> str:
    """The kind of a ``PROBE_SCHEMA`` column's type."""
    return "int" if pa.types.is_integer(t) else "float" if pa.types.is_floating(t) else "string"


def step_files(path: Path, steps: StepRange) -> list[tuple[int, Path]]:
    require_dir(path, "step_<N>/ directories of ProbeWriter files")
    dirs = unique_steps(sorted(
        (int(m.group(1)), p)
        for p in path.iterdir()
        if p.is_dir() and (m := _STEP_DIR.match(p.name)) and int(m.group(1)) in steps
    ))  # fmt: skip
    files = [(n, f) for n, d in dirs for f in attempts(d)[0]]
    if not files:
        raise ProbeError(f"{path}: no step_<N>/*.parquet file in the chosen steps")
    return files


def _attempt_of(file: Path) -> tuple[str, str]:
    """``(rank, attempt)`` of a file from its metadata (the name's rank, ``""`` when unknown;
    an unreadable file gets its own name, so it is kept and reported when opened)."""
    match = _RANK_FILE.match(file.name)
    try:
        meta = pq.read_schema(file).metadata or {}
    except (pa.ArrowException, OSError):
        return file.name, ""
    rank = meta.get(RANK_KEY, b"").decode(errors="replace") or (match.group(1) if match else "")
    return rank or file.name, meta.get(ATTEMPT_KEY, b"").decode(errors="replace")


def attempts(directory: Path) -> tuple[list[Path], dict[str, int]]:
    """The files of one step directory to read (per rank, the latest attempt's; files without
    an attempt all), and ``{rank: files of earlier attempts left out}``."""
    by_rank: dict[str, dict[str, list[Path]]] = {}
    for file in sorted(directory.glob("[!.]*.parquet")):
        rank, attempt = _attempt_of(file)
        by_rank.setdefault(rank, {}).setdefault(attempt, []).append(file)
    keep: list[Path] = []
    replaced: dict[str, int] = {}
    for rank, found in by_rank.items():
        dated = sorted(a for a in found if a)
        latest = dated[-1] if dated else None
        keep += [f for a, fs in found.items() if a == latest or not a for f in fs]
        earlier = sum(len(fs) for a, fs in found.items() if a and a != latest)
        if earlier:
            replaced[rank] = earlier
    return sorted(keep), replaced


def rewrites(path: Path, steps: StepRange) -> list[dict[str, Any]]:
    """The steps written again by a later attempt (a restarted trainer): ``{"step", "ranks",
    "files_replaced"}`` each, steps ascending."""
    require_dir(path, "step_<N>/ directories of ProbeWriter files")
    out = []
    for step, directory in sorted(
        (int(m.group(1)), p)
        for p in path.iterdir()
        if p.is_dir() and (m := _STEP_DIR.match(p.name)) and int(m.group(1)) in steps
    ):
        replaced = attempts(directory)[1]
        if replaced:
            ranks = sorted(replaced, key=lambda r: (not r.isdigit(), int(r) if r.isdigit() else 0))
            out.append({"step": step, "ranks": ranks, "files_replaced": sum(replaced.values())})
    return out


def _open(file: Path) -> pq.ParquetFile:
    try:
        pf = pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as exc:
        raise ProbeError(f"{file} is not a readable Parquet file ({exc})") from None
    meta = pf.schema_arrow.metadata or {}
    if meta.get(FORMAT_KEY) != FORMAT_NAME.encode():
        raise ProbeError(f"{file} was not written by ProbeWriter (no {FORMAT_NAME} marker)")
    version = meta.get(VERSION_KEY, b"?").decode(errors="replace")
    if version != FORMAT_VERSION:
        raise ProbeError(f"{file}: format version {version} (supported: {FORMAT_VERSION})")
    missing = [c for c in PROBE_SCHEMA.names if c not in pf.schema_arrow.names]
    if missing:
        raise ProbeError(f"{file} lacks the column(s) {', '.join(missing)}")
    for expected in PROBE_SCHEMA:
        test, kind = _KINDS[_kind(expected.type)]
        found = pf.schema_arrow.field(expected.name).type
        if not test(found):
            raise ProbeError(f"{file}: column {expected.name} is {found}, expected {kind}")
    return pf


def read(path: Path, steps: StepRange) -> Iterator[SeqRecord]:
    for step, file in step_files(path, steps):
        pf = _open(file)
        carry: pa.Table | None = None
        seen: set[int] = set()
        try:
            for batch in pf.iter_batches(ROWS_PER_READ, columns=PROBE_SCHEMA.names):
                table = pa.Table.from_batches([batch])
                table = pa.concat_tables([carry, table]) if carry is not None else table
                seq = table.column("sequence").to_numpy()
                seen.update(np.unique(seq).tolist())
                tail = _last_run_start(seq)
                yield from _records(table.slice(0, tail), step, file)
                carry = table.slice(tail)
        except pa.ArrowException as exc:
            raise ProbeError(f"{file} is corrupt ({exc})") from None
        if carry is not None and carry.num_rows:
            yield from _records(carry, step, file)
        yield from _untrained(pf, seen, step, file)


def read_batches(path: Path, steps: StepRange) -> Iterator[SeqBatch]:
    """``read`` in columns: each chunk of a file's rows is one ``SeqBatch`` (its sequences'
    rows are already the token rows), then the file's untrained rows as empty responses."""
    yield from _file_batches(path, steps)


def _file_batches(path: Path, steps: StepRange) -> Iterator[SeqBatch]:
    for step, file in step_files(path, steps):
        pf = _open(file)
        carry: pa.Table | None = None
        seen: set[int] = set()
        try:
            for batch in pf.iter_batches(ROWS_PER_READ, columns=PROBE_SCHEMA.names):
                table = pa.Table.from_batches([batch])
                table = pa.concat_tables([carry, table]) if carry is not None else table
                seq = table.column("sequence").to_numpy()
                seen.update(np.unique(seq).tolist())
                tail = _last_run_start(seq)
                if tail:
                    yield _columns(table.slice(0, tail), step, file)
                carry = table.slice(tail)
        except pa.ArrowException as exc:
            raise ProbeError(f"{file} is corrupt ({exc})") from None
        if carry is not None and carry.num_rows:
            yield _columns(carry, step, file)
        empty = list(_untrained(pf, seen, step, file))
        if empty:
            yield batch_of(empty)


def _columns(table: pa.Table, step: int, file: Path) -> SeqBatch:
    """The records ``_records`` yields for ``table``, as one batch (the same checks)."""
    cols = {name: table.column(name) for name in PROBE_SCHEMA.names}
    for name in _INT_COLUMNS:
        if cols[name].null_count:
            raise ProbeError(f"{file}: column {name} holds nulls (every trained token has one)")
    seq = cols["sequence"].to_numpy()
    steps = cols["step"].to_numpy()
    if np.any(steps != step):
        raise ProbeError(f"{file}: rows of step {int(steps[steps != step][0])} in step_{step}/")
    bounds = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1], True])
    starts = bounds[:-1]
    groups = cols["group"].take(pa.array(starts)).to_pylist()
    value = lambda k, t: np.asarray(cols[k].to_numpy(zero_copy_only=False), dtype=t)  # noqa: E731
    return SeqBatch(
        step=step,
        sources=[f"{file} sequence {int(i)}" for i in seq[starts]],
        prompt_keys=groups,
        lengths=np.diff(bounds).astype(np.int64),
        token_ids=value("token_id", np.int64),
        positions=value("position", np.int64),
        rollout=value("rollout_logprob", np.float64),
        train=value("train_logprob", np.float64),
    )


def _untrained(pf: pq.ParquetFile, seen: set[int], step: int, file: Path) -> Iterator[SeqRecord]:
    """An empty record per batch row (``ROWS_KEY``) that holds no trained token."""
    rows = int((pf.schema_arrow.metadata or {}).get(ROWS_KEY, b"0"))
    empty = np.zeros(0, np.int64)
    for i in sorted(set(range(rows)) - seen):
        yield SeqRecord(step, f"{file} sequence {i}", None, empty, empty, empty * 0.0, empty * 0.0)


def _last_run_start(seq: np.ndarray) -> int:
    change = np.flatnonzero(seq[1:] != seq[:-1])
    return int(change[-1] + 1) if len(change) else 0


def _records(table: pa.Table, step: int, file: Path) -> Iterator[SeqRecord]:
    if table.num_rows == 0:
        return
    cols = {name: table.column(name) for name in PROBE_SCHEMA.names}
    for name in _INT_COLUMNS:
        if cols[name].null_count:
            raise ProbeError(f"{file}: column {name} holds nulls (every trained token has one)")
    seq = cols["sequence"].to_numpy()
    steps = cols["step"].to_numpy()
    if np.any(steps != step):
        raise ProbeError(f"{file}: rows of step {int(steps[steps != step][0])} in step_{step}/")
    values = {
        k: cols[k].to_numpy(zero_copy_only=False)
        for k in ("position", "token_id", "rollout_logprob", "train_logprob")
    }
    groups = cols["group"].to_pylist()
    bounds = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1], True])
    for a, b in itertools.pairwise(bounds.tolist()):
        yield SeqRecord(
            step=step,
            source=f"{file} sequence {int(seq[a])}",
            prompt_key=groups[a],
            token_ids=values["token_id"][a:b].astype(np.int64),
            positions=values["position"][a:b].astype(np.int64),
            rollout=np.asarray(values["rollout_logprob"][a:b], dtype=np.float64),
            train=np.asarray(values["train_logprob"][a:b], dtype=np.float64),
        )


def off_policy(path: Path) -> dict[str, Any]:
    """The bound, staleness and source ``ProbeWriter`` recorded in the first file, if any."""
    files = step_files(path, StepRange())
    file = files[0][1]
    meta = _open(file).schema_arrow.metadata or {}
    bound = None
    if OFF_POLICY_KEY in meta:
        text = meta[OFF_POLICY_KEY].decode(errors="replace")
        bound = int(text) if text.strip().isascii() and text.strip().isdigit() else -1
        if bound < 0:
            raise ProbeError(
                f"{file}: {OFF_POLICY_KEY.decode()} {text!r} is not a non-negative integer"
            )
    stale = {b"true": True, b"false": False}.get(meta.get(STALENESS_KEY, b""))
    if stale is None and bound is not None:
        stale = bound > 0
    given = bound is not None or stale is not None
    source = meta.get(OFF_POLICY_SOURCE_KEY, b"").decode(errors="replace") or (
        "ProbeWriter" if given else "not given to ProbeWriter"
    )
    return {"max_off_policy_steps": bound, "source": source, "staleness": stale}
