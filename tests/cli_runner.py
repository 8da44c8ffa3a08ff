"""``probe ARGS`` run in-process, as a user runs it (``cli.main``: exit codes, one-line errors)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from mismatch_probe import cli


def run_probe(
    args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> tuple[int, str, str]:
    """``probe ARGS`` in-process: ``(exit code, stdout, stderr)``."""
    monkeypatch.setattr(sys, "argv", ["probe", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_probe_err(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any) -> tuple[int, str]:
    """``probe ARGS`` in-process: ``(exit code, stderr)``; stdout is dropped."""
    code, _, err = run_probe(args, monkeypatch, capsys)
    return code, err
