"""Docs stay true: every command and option has help text and appears in the README."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from mismatch_probe.cli import app
from mismatch_probe.cli_help import EXAMPLES

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


EXAMPLE_LINES = [(command, line) for command, lines in EXAMPLES.items() for line in lines]


@pytest.mark.parametrize(("command", "line"), EXAMPLE_LINES, ids=[x for _, x in EXAMPLE_LINES])
def test_every_help_example_parses_and_is_in_the_readme(command: str, line: str) -> None:
    """The "Examples" of ``probe COMMAND --help`` are README command lines that click parses
    (every option exists and takes its value)."""
    assert f"\n{line}\n" in README, f"{line!r} is not a line of README.md"
    argv = shlex.split(line)
    path = tuple(command.split())
    assert argv[0] == "probe" and tuple(argv[1 : 1 + len(path)]) == path
    try:
        dict(COMMANDS)[path].make_context(f"probe {command}", argv[1 + len(path) :])
    except typer.TyperException as exc:  # typer's click: unknown option, bad value
        pytest.fail(f"{line}: {exc.format_message()}")
