"""Arrow columns as numpy arrays, read from their buffers, and numpy arrays as Arrow columns.

pyarrow's own conversions (``to_numpy``, ``np.asarray`` of an Arrow array, ``pa.array`` of
numpy values, ``pa.scalar``, a compute call given a Python scalar) import pandas the first
time one runs in a process: a fixed cost of every fresh ``probe metrics`` or ``probe ingest``
that no stage needs (``make bench metrics_duckdb`` and ``ingest_duckdb`` record whether it
was paid, ``pandas_imported``; ``tests/test_store_arrays.py`` checks that it is not). The
stages on the store's path call these helpers instead: ``numpy_of`` gives ``to_numpy``'s
values and dtypes, ``arrow_of`` and ``arrow_strings`` the arrays ``pa.array`` would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

_NUMPY: dict[pa.DataType, type[np.generic]] = {
    pa.int8(): np.int8,
    pa.int16(): np.int16,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint8(): np.uint8,
    pa.uint16(): np.uint16,
    pa.uint32(): np.uint32,
    pa.uint64(): np.uint64,
    pa.float16(): np.float16,
    pa.float32(): np.float32,
    pa.float64(): np.float64,
    pa.bool_(): np.bool_,
}


def numpy_of(values: pa.Array | pa.ChunkedArray, null: Any = None) -> np.ndarray:
    """A numeric or boolean column as numpy, its nulls as ``null`` (a value of the column's
    dtype); without nulls, a view of the buffer where Arrow's layout is numpy's (read-only, as
    ``to_numpy``'s). Any other column, or nulls with ``null=None``, goes to pyarrow's
    ``to_numpy(zero_copy_only=False)``."""
    if isinstance(values, pa.ChunkedArray):
        parts = [numpy_of(chunk, null) for chunk in values.chunks]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else _empty(values.type)
    dtype = _NUMPY.get(values.type)
    if dtype is None or (values.null_count and null is None):
        return values.to_numpy(zero_copy_only=False)
    if len(values) == 0:
        return _empty(values.type)
    data = _data(values, dtype)
    if not values.null_count:
        return data
    return np.where(valid_of(values), data, np.asarray(null, dtype=dtype))


def arrow_of(values: np.ndarray, kind: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    """An Arrow array of ``kind`` (a numeric type) holding numpy ``values``, from their
    buffer: ``pa.array(values, kind, mask=~valid)`` without ``pa.array``, the values cast to
    the kind's dtype as numpy casts (unchecked: the caller's values fit it). ``valid``:
    ``[N]`` bool, null where False (None: no null)."""
    if kind == pa.bool_():
        raise TypeError("arrow_of: Arrow packs booleans in bits, not numpy's bytes")
    data = np.ascontiguousarray(values, dtype=_NUMPY[kind])
    bitmap, nulls = None, 0
    if valid is not None:
        if len(valid) != len(data):
            raise ValueError(f"arrow_of: {len(valid)} validity flags for {len(data)} values")
        nulls = len(data) - int(np.count_nonzero(valid))
        if nulls:
            bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(kind, len(data), [bitmap, pa.py_buffer(data)], null_count=nulls)


def arrow_strings(values: Sequence[str | None]) -> pa.Array:
    """A string Arrow array of ``values`` (None: null), built from one UTF-8 buffer and its
    offsets: ``pa.array(values, pa.string())`` without ``pa.array``."""
    encoded = [b"" if v is None else v.encode() for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError("arrow_strings: more than 2 GiB of text in one array")
    valid = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    nulls = len(values) - int(np.count_nonzero(valid))
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    buffers = [bitmap, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(encoded))]
    return pa.Array.from_buffers(pa.string(), len(values), buffers, null_count=nulls)


def valid_of(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``[N]`` bool: the values that are not null."""
    if isinstance(values, pa.ChunkedArray):
        parts = [valid_of(chunk) for chunk in values.chunks]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
    if values.null_count == 0:
        return np.ones(len(values), dtype=bool)
    return _bits(values.buffers()[0], values.offset, len(values))


def _data(values: pa.Array, dtype: type[np.generic]) -> np.ndarray:
    buffer = values.buffers()[1]
    if dtype is np.bool_:
        return _bits(buffer, values.offset, len(values))
    size = np.dtype(dtype).itemsize
    return np.frombuffer(buffer, dtype, len(values), values.offset * size)


def _bits(buffer: pa.Buffer, offset: int, length: int) -> np.ndarray:
    """``length`` bits of an Arrow bitmap (least significant bit first) from bit ``offset``:
    only the bytes that hold them are unpacked (a slice deep into a column costs its length)."""
    skip, first = divmod(offset, 8)
    held = (first + length + 7) // 8
    bytes_ = np.frombuffer(buffer, dtype=np.uint8, count=held, offset=skip)
    return np.unpackbits(bytes_, count=first + length, bitorder="little")[first:].view(bool)


def _empty(kind: pa.DataType) -> np.ndarray:
    dtype = _NUMPY.get(kind)
    return np.zeros(0, dtype=dtype) if dtype is not None else pa.array([], kind).to_numpy()
