"""A run's data-integrity findings (metrics spec section 8), computed from its token store.

``run_integrity`` runs ``metrics.integrity.compute_integrity`` over the store with the run
metadata; ``write_integrity`` writes the findings as ``integrity.json`` (``probe report`` and
``probe check`` recompute them from the store rather than trust the file). The renderers are
``report.integrity``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.integrity import Integrity, compute_integrity

INTEGRITY_FILE = store.INTEGRITY_FILE


def run_metadata(path: Path) -> dict[str, Any]:
    """``run.json`` beside the store when there is one, else the store's own metadata."""
    tokens = store.resolve_tokens_path(Path(path))
    for folder in (Path(path), tokens.parent):
        candidate = folder / store.RUN_FILE
        if folder.is_dir() and candidate.is_file():
            try:
                data = store.read_json(candidate)
                return dict(data) if isinstance(data, dict) else {}
            except (OSError, TypeError, ValueError):
                raise ProbeError(f"{candidate} is not valid JSON of finite numbers") from None
    return store.read_run_metadata(tokens)


def run_integrity(path: Path, run: Mapping[str, Any] | None = None) -> Integrity:
    """The findings of a run directory or token store (``run``: its metadata, read when None)."""
    return compute_integrity(path, run_metadata(path) if run is None else run)


def write_integrity(run_dir: Path, integrity: Integrity) -> Path:
    path = Path(run_dir) / INTEGRITY_FILE
    store.write_json(path, integrity.to_json_dict())
    return path
