"""Vectorised JSONL: a file of one JSON object per line as an Arrow table, then numpy arrays.

``read_columns`` parses a whole file in compiled code (``_lines.c``, built with the package):
the named fields' values on every line as flat numpy arrays, every other field validated and
skipped. It accepts only lines Python's ``json`` reads, and gives the values ``json`` gives
(``_lines.c`` says how, floats to the last bit); for anything else, or where the package was
built without a C compiler, it answers None and the caller tries the next reader.

``read_table`` parses a whole file with pyarrow's JSON reader against an explicit schema (fields
outside it are skipped unparsed), so no Python object is built per token; ``read_table_shaped``
does the same with the schema a file's first line implies. Each answers None wherever the
reference reader (``records.iter_json_lines`` and the format's record function) must decide
instead, so that the fast path only ever gives the values the reference reader gives:

* a line pyarrow cannot parse as the schema says (bad JSON, another type, a non-object line);
* what pyarrow reads and Python's ``json`` refuses or reads otherwise: ``Inf``, ``-Inf``,
  ``-NaN`` (not JSON), the integer ``-0`` (0 for ``json``, -0.0 for pyarrow), a byte-order
  mark, two objects on one line;
* blank lines, lines of spaces or carriage returns (line numbers would differ), text that is
  not UTF-8;
* an optional field spelt only with escapes (``"id\\u0078"``): each optional field the schema
  does not name is parsed as a null column, so any value of it fails the parse;
* a file of ``MAX_FAST_BYTES`` or more (pyarrow's block size is an int32).

The readers then read that file record by record, with the same messages as ever.

``prefetched`` runs a per-file function on every core, in file order, a bounded number of files
ahead: at most ``2 x`` the workers, and no new file while those in flight hold
``PREFETCH_BYTES`` of JSONL or more (memory: a file's bytes and its Arrow table, for the few
files in flight, whatever the number of steps).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.json as pj

from mismatch_probe.ingest.batches import SeqBatch, from_records
from mismatch_probe.ingest.records import SeqRecord
from mismatch_probe.parallel import ordered_map

_lines: ModuleType | None
try:
    from mismatch_probe.ingest import _lines
except ImportError:  # the package was built without a C compiler: pyarrow's reader only
    _lines = None

T = TypeVar("T")
COMPILED = _lines is not None
# read_columns' kinds of field: the _lines constant and the values' dtype
KINDS: dict[str, tuple[str, Any]] = {
    "int": ("INT", np.int64),  # an integer (int64) on every line
    "float": ("FLOAT", np.float64),  # a number on every line
    "int_list": ("INT_LIST", np.int64),  # a list of integers on every line
    "bool_list": ("BOOL_LIST", np.bool_),  # a list of true / false
    "float_list": ("FLOAT_LIST", np.float64),  # a list of numbers (null: NaN)
    "absent": ("ABSENT", None),  # on no line (where it is, another reader decides)
}
Column = tuple[np.ndarray, np.ndarray | None]  # (values [V], offsets [lines + 1] of a list)
MIN_BLOCK = 1 << 20
MAX_FAST_BYTES = (1 << 31) - 2  # pyarrow's block size (an int32) must exceed the file; and
# a larger file is not held whole by the compiled reader either (the reference reader streams)
PREFETCH_BYTES = 512 << 20
_BOM = b"\xef\xbb\xbf"
_SPACES = b" \t"
_INTEGER_MINUS_ZERO = re.compile(rb"-0[,\]}\s]")  # -0 as a value (not -0.5, -0.0, -0e0)


def read_columns(
    file: Path, fields: Mapping[str, str | tuple[str, int]]
) -> dict[str, Column] | None:
    """Each of ``fields`` (name -> a kind of ``KINDS``, or ``(kind, wrap)``: the value inside
    ``wrap`` one-element lists, ``[[...]]`` for a list of wrap 1) on every line of ``file``,
    parsed in compiled code: ``{name: (values, offsets)}`` (offsets None for a scalar). None where
    Python's ``json`` would refuse a line or read it otherwise, a value is not of its kind, the
    file has no line, or the package has no compiled reader (the module docstring)."""
    if _lines is None:
        return None
    try:
        if file.stat().st_size >= MAX_FAST_BYTES:
            return None  # as for pyarrow's reader: the reference reader streams it
        data = file.read_bytes()
    except OSError:
        return None
    return parse_columns(data, fields)


def parse_columns(
    data: bytes, fields: Mapping[str, str | tuple[str, int]]
) -> dict[str, Column] | None:
    """``read_columns`` of a file's bytes."""
    if _lines is None:
        return None
    kinds = {name: (kind, 0) if isinstance(kind, str) else kind for name, kind in fields.items()}
    spec = tuple((name, getattr(_lines, KINDS[k][0]), wrap) for name, (k, wrap) in kinds.items())
    parsed = _lines.columns(data, spec)
    if parsed is None:
        return None
    _, found = parsed
    return {
        name: (np.frombuffer(values, KINDS[kinds[name][0]][1]),
               None if offsets is None else np.frombuffer(offsets, np.int64))
        for name, (values, offsets) in found.items()
    }  # fmt: skip


def first_object(file: Path) -> dict[str, Any] | None:
    """``json`` of the file's first line where it is an object, else None."""
    try:
        with file.open("rb") as fh:
            first = json.loads(fh.readline())
    except (OSError, ValueError):
        return None
    return first if isinstance(first, dict) else None


def read_table(
    file: Path, schema: pa.Schema, optional: Mapping[str, tuple[pa.DataType, ...]] | None = None
) -> pa.Table | None:
    """``file`` parsed against ``schema`` (plus each ``optional`` field that occurs in the file,
    with the first of its types that parses), one row per line; None: see the module docstring.
    """
    data = _text(file)
    if data is None:
        return None
    optional = optional or {}
    found = [name for name in optional if f'"{name}"'.encode() in data]
    absent = [name for name in optional if name not in found]
    choices: list[list[tuple[str, pa.DataType]]] = [[]]
    for name in found:
        choices = [[*c, (name, t)] for c in choices for t in optional[name]]
    for extra in choices:
        table = _parse(data, pa.schema([*schema, *extra]), absent)
        if table is not None:
            return _one_row_per_line(table, data)
    return None


def read_table_shaped(
    file: Path, shape: Callable[[dict[str, Any]], pa.Schema | None], fields: Iterable[str]
) -> pa.Table | None:
    """``file`` parsed against the schema its first line implies, ``shape(first object)``: one
    parse, for formats whose fields come in several shapes (a list or a one-element list of it,
    a number or a string) that stay the same from line to line. None: see the module
    docstring, and where ``shape`` answers None; each of ``fields`` (the optional fields
    ``shape`` may name) that it does not name must be absent or null on every line."""
    data = _text(file)
    if data is None:
        return None
    try:
        first = json.loads(data[: data.find(b"\n")] if b"\n" in data else data)
    except ValueError:
        return None
    if not isinstance(first, dict):
        return None
    schema = shape(first)
    if schema is None:
        return None
    table = _parse(data, schema, [name for name in fields if name not in schema.names])
    return _one_row_per_line(table, data) if table is not None else None


def _text(file: Path) -> bytes | None:
    """The file's bytes, or None where the reference reader must read it (see the module
    docstring) or it cannot be read."""
    try:
        if file.stat().st_size >= MAX_FAST_BYTES:
            return None
        data = file.read_bytes()
    except OSError:
        return None
    if b"\r" in data or data.startswith(_BOM) or not _utf8(data):
        return None
    return None if _lenient(data) or _blank_line(data) else data


def _lenient(data: bytes) -> bool:
    """Whether ``data`` holds a value pyarrow reads and ``json`` refuses: ``Inf`` or ``-Inf``
    (``Infinity`` is JSON's too), ``-NaN``. (The integer ``-0``, which pyarrow reads as -0.0:
    ``_one_row_per_line``.)"""
    infinite = any(not data.startswith(b"inity", at + 3) for at in _values_at(data, b"Inf"))
    return infinite or next(_values_at(data, b"-NaN"), None) is not None


def _values_at(data: bytes, token: bytes) -> Iterator[int]:
    """Where ``token`` (or ``-token``) starts a value: after ``[``, ``,`` or ``:`` and spaces.
    One pass for its first letter first (no ``I`` or ``N`` at all in most logs)."""
    if data.find(token.lstrip(b"-")[:1]) < 0:
        return
    at = data.find(token)
    while at >= 0:
        start = at - 1 if data.endswith(b"-", 0, at) else at
        while start and data[start - 1] in _SPACES:
            start -= 1
        if start and data[start - 1] in b"[,:":
            yield at
        at = data.find(token, at + 1)


def _blank_line(data: bytes) -> bool:
    """Whether a line is empty or only spaces (the reference reader skips it: the numbers of
    the lines after it would differ). A look at each line's first byte."""
    start, end = 0, len(data)
    while start < end:
        stop = data.find(b"\n", start)
        stop = end if stop < 0 else stop
        if data[start] in b" \t\n" and not data[start:stop].strip(_SPACES):
            return True
        start = stop + 1
    return False


def _utf8(data: bytes) -> bool:
    if data.isascii():
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _parse(data: bytes, schema: pa.Schema, absent: Iterable[str] = ()) -> pa.Table | None:
    """``data`` against ``schema`` and each ``absent`` field as a null column (a value there
    fails the parse), which is then dropped."""
    absent = list(absent)
    full = pa.schema([*schema, *((name, pa.null()) for name in absent)])
    read = pj.ReadOptions(use_threads=False, block_size=max(MIN_BLOCK, len(data) + 1))
    parse = pj.ParseOptions(explicit_schema=full, unexpected_field_behavior="ignore")
    try:
        table = pj.read_json(pa.BufferReader(data), read_options=read, parse_options=parse)
    except (pa.ArrowException, ValueError):
        return None
    return table.drop_columns(absent) if absent else table


def _one_row_per_line(table: pa.Table, data: bytes) -> pa.Table | None:
    """``table`` if it has a row for every line (two objects on one line give more) and no
    -0.0 that was the integer ``-0`` (0 for ``json``), else None."""
    lines = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
    if table.num_rows != lines:
        return None
    if _has_negative_zero(table) and _INTEGER_MINUS_ZERO.search(data) is not None:
        return None
    return table


def _has_negative_zero(table: pa.Table) -> bool:
    """Whether a float of ``table`` (in lists too) is -0.0."""
    for column in table.columns:
        array = column.combine_chunks()
        while pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
            array = array.flatten()
        if pa.types.is_floating(array.type):
            floats = array.fill_null(1.0).to_numpy(zero_copy_only=False)
            zero = floats == 0.0
            if zero.any() and np.signbit(floats[zero]).any():
                return True
    return False


def flat_list(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """A list column -> ``(values [V], offsets [rows + 1])``; floats' nulls as NaN. None when a
    row is null (a missing field) or an integer/boolean value is null."""
    if column.null_count:
        return None
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if isinstance(array, pa.ChunkedArray):  # an empty table
        array = pa.array([], column.type)
    offsets = np.asarray(array.offsets.to_numpy(), dtype=np.int64)
    values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    offsets = offsets - offsets[0]
    if pa.types.is_floating(values.type):
        return np.asarray(values.to_numpy(zero_copy_only=False), np.float64), offsets
    if values.null_count:
        return None
    return values.to_numpy(zero_copy_only=False), offsets


def masked(
    mask: np.ndarray, offsets: np.ndarray, empty_ok: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The tokens a flat ``[V]`` bool mask keeps, per row of ``offsets``: ``(keep [K] indices,
    counts [rows], positions [K])``, each position counted from the row's first kept token.
    None when a row keeps no token, unless ``empty_ok`` (``[rows]`` bool) allows it there."""
    rows = len(offsets) - 1
    keep = np.flatnonzero(mask)
    kept_before = np.zeros(len(mask) + 1, np.int64)  # kept tokens before each flat index
    np.cumsum(mask, out=kept_before[1:])
    counts = kept_before[offsets[1:]] - kept_before[offsets[:-1]]
    empty = counts == 0
    if empty.any() and (empty_ok is None or not empty_ok[empty].all()):
        return None
    starts = np.cumsum(counts) - counts  # each row's first entry in keep (rows of none: unused)
    first = keep[np.minimum(starts, len(keep) - 1)] if len(keep) else np.zeros(rows, np.int64)
    return keep, counts, keep - np.repeat(first, counts)


def group_keys(table: pa.Table, name: str, rows: int) -> list[str | None] | None:
    """``records.group_key`` of each row's ``name`` field (None where absent or empty)."""
    if name not in table.column_names:
        return [None] * rows
    column = table.column(name)
    if pa.types.is_string(column.type):
        return [v or None for v in column.to_pylist()]
    if pa.types.is_integer(column.type):
        return [None if v is None else str(v) for v in column.to_pylist()]
    return None


def file_batches(
    files: list[tuple[int, Path]],
    fast: Callable[[Path, int], SeqBatch | None],
    records: Callable[[Path, int], Iterable[SeqRecord]],
) -> Iterator[SeqBatch]:
    """Each ``(step, file)``'s batch by the fast reader, ``fast(file, step)`` (the next files
    parsed on other cores while a batch is written: ``prefetched``); where it answers None,
    the reference reader's ``records(file, step)``, a line at a time in the file's turn,
    gathered into batches (``batches.from_records``)."""
    for (step, file), batch in zip(files, prefetched(files, fast), strict=True):
        yield from [batch] if batch is not None else from_records(records(file, step))


def prefetched(items: Iterable[tuple[int, Path]], fn: Callable[[Path, int], T]) -> Iterator[T]:
    """``fn(file, step)`` of each item, in order, on every core (``parallel.ordered_map``), no
    new file while those in flight hold ``PREFETCH_BYTES`` or more."""
    return ordered_map(lambda item: fn(item[1], item[0]), items,
                       cost=lambda item: _size(item[1]), budget=PREFETCH_BYTES)  # fmt: skip


def _size(file: Path) -> int:
    try:
        return file.stat().st_size
    except OSError:
        return 0
