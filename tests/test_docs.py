"""Docs stay true: every command and option has help text and appears in the README."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from mismatch_probe.cli import app

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def walk(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from walk(sub, (*path, name))


COMMANDS = [(path, cmd) for path, cmd in walk(typer.main.get_command(app)) if path]


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_command_has_help_and_is_documented(path: tuple[str, ...], command: Any) -> None:
    assert (command.help or "").strip(), f"probe {' '.join(path)} has no help"
    assert f"probe {' '.join(path)}" in README


OPTIONS = [
    (path, opt)
    for path, cmd in COMMANDS
    for param in cmd.params
    if param.param_type_name == "option"
    for opt in param.opts
    if opt.startswith("--")
]


@pytest.mark.parametrize(
    ("path", "option"), OPTIONS, ids=[f"{' '.join(p)} {o}" for p, o in OPTIONS]
)
def test_option_has_help_and_is_documented(path: tuple[str, ...], option: str) -> None:
    command = dict(COMMANDS)[path]
    param = next(p for p in command.params if option in p.opts)
    assert (param.help or "").strip(), f"{option} of probe {' '.join(path)} has no help"
    assert f"`{option}" in README, f"{option} (probe {' '.join(path)}) is missing in README"


def test_help_answers_without_heavy_imports() -> None:
    """``probe --help`` must not import torch, vllm or transformers (lazy imports)."""
    import subprocess
    import sys

    code = (
        "import sys; from mismatch_probe.cli import app; "
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'matplotlib') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
