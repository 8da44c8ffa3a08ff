"""What ties a data file to the token store it was computed from: its row count and a
fingerprint of each Parquet part (issue 29: a ``metrics.json`` reused after ``tokens.parquet``
was replaced gated on the old numbers).

``store_tie(tokens)`` is ``{"rows": N, "parts": [{"path", "rows", "fingerprint"}]}`` (paths
relative to the store's folder, POSIX). A part's fingerprint is the SHA-256 of its size and its
Parquet footer (the file metadata: schema, row groups, every column chunk's offsets, sizes and
statistics), so it is read in one seek whatever the store's size, and any rewrite of a part's
rows changes it. ``same_store(tie, tokens)`` says whether a recorded tie still holds.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.store.dataset import part_files

FOOTER_TAIL = 8  # 4-byte footer length + "PAR1"
STORE_KEY = "store"  # where a data file records its tie (``metrics.json``)


def part_fingerprint(path: Path) -> tuple[int, str]:
    """``(rows, sha256 hex)`` of one Parquet part (its size and footer)."""
    import pyarrow.parquet as pq

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(size - FOOTER_TAIL, 0))
        tail = f.read(FOOTER_TAIL)
        length = struct.unpack("<I", tail[:4])[0] if len(tail) == FOOTER_TAIL else 0
        f.seek(max(size - FOOTER_TAIL - length, 0))
        footer = f.read(length + FOOTER_TAIL)
    digest = hashlib.sha256(str(size).encode() + b"\0" + footer).hexdigest()
    return pq.ParquetFile(path).metadata.num_rows, digest


def store_tie(tokens: Path) -> dict[str, Any]:
    """The row count and each part's fingerprint of the token store ``tokens`` (a file or a
    sharded scan's directory)."""
    tokens = Path(tokens)
    root = tokens if tokens.is_dir() else tokens.parent
    parts = []
    for part in part_files(tokens):
        rows, digest = part_fingerprint(part)
        parts.append(
            {"path": part.relative_to(root).as_posix(), "rows": rows, "fingerprint": digest}
        )
    return {"rows": sum(p["rows"] for p in parts), "parts": parts}


def same_store(tie: Any, tokens: Path) -> bool:
    """Whether ``tie`` (a recorded ``store_tie``) describes the store ``tokens`` as it is now;
    False for a missing or malformed tie, or an unreadable store."""
    if not isinstance(tie, Mapping):
        return False
    try:
        return dict(tie) == store_tie(tokens)
    except (OSError, ValueError, struct.error, ProbeError):
        return False
