"""Every PNG a report writes goes through ``save_png``: drawn into memory, written atomically
(never a truncated PNG under its final name), and kept for the HTML of the same report while a
``kept()`` block is open, so ``report.html`` embeds the plots it was handed without reading a
file back.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING

from mismatch_probe import store

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_KEPT: ContextVar[dict[Path, bytes] | None] = ContextVar("kept_pngs", default=None)


def save_png(fig: Figure, path: Path, dpi: int) -> Path:
    """Write ``fig`` as the PNG ``path`` (its file name as the PNG's title); returns ``path``."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format="png", metadata={"Title": Path(path).name})
    data = buffer.getvalue()
    store.write_bytes(path, data)
    kept_now = _KEPT.get()
    if kept_now is not None:
        kept_now[Path(path).resolve()] = data
    return path


@contextmanager
def kept() -> Iterator[dict[Path, bytes]]:
    """``{resolved path: PNG bytes}`` of every PNG saved inside the block."""
    images: dict[Path, bytes] = {}
    token = _KEPT.set(images)
    try:
        yield images
    finally:
        _KEPT.reset(token)
