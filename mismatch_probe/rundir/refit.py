"""A refit run's ``refit.json`` (``probe refit``), read and checked once: one setting's result,
or several under ``settings`` (``refit_settings`` gives the list either way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError

REQUIRED = ("audit", "links")


def is_refit_run(run_dir: Path) -> bool:
    """True when ``run_dir`` holds a refit run (``refit.json``)."""
    return (run_dir / store.REFIT_FILE).is_file()


def read_refit(run_dir: Path) -> dict[str, Any]:
    """``refit.json`` of ``run_dir``.

    Raises:
        ProbeError: missing, unreadable, or without its ``audit`` and ``links``.
    """
    path = run_dir / store.REFIT_FILE
    if not path.is_file():
        raise ProbeError(f"{run_dir}: no {store.REFIT_FILE} (written by probe refit)")
    data = store.read_json(path)
    parts = refit_settings(data) if isinstance(data, dict) else []
    if not parts or any(
        not isinstance(part, dict) or any(not isinstance(part.get(k), dict) for k in REQUIRED)
        for part in parts
    ):
        raise ProbeError(f"{path}: not a refit run ({', '.join(REQUIRED)} missing)")
    return data


def refit_settings(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-setting results of a refit view: its ``settings`` (a run of several precision
    settings), or the view itself (one setting)."""
    parts = data.get("settings")
    return list(parts) if isinstance(parts, list) else [data]
