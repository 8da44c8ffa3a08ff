"""First contact with ``probe``: ``--version``, a bare ``probe``, the help's panels, metavars,
choices and examples (``tests/test_docs.py`` checks that the examples parse and are command lines
of the docs)."""

from __future__ import annotations

import re
from typing import Any, get_args

import pytest
import typer
from typer.testing import CliRunner

from mismatch_probe import options
from mismatch_probe.cli import app
from mismatch_probe.cli_help import COMMAND_ORDER, EXAMPLES, version
from mismatch_probe.metrics.config import IS_LEVELS
from mismatch_probe.models.tiny import ARCHS
from mismatch_probe.report.comment import FORMATS
from mismatch_probe.sampling import LogprobsMode
from mismatch_probe.settings import ON_OFF, REPLAY_MODES
from mismatch_probe.training.devices import DEVICE_MAPS
from tests.cli_runner import run_probe
from tests.test_docs import COMMANDS

COMMAND = dict(COMMANDS)


def help_text(*path: str) -> str:
    """``probe PATH --help`` as a user sees it on a 100-column terminal, without colours."""
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def test_version(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    code, out, err = run_probe(["--version"], monkeypatch, capsys)
    assert (code, out, err) == (0, f"probe {version()}\n", "")
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", version())


def test_bare_probe_prints_the_help_and_exits_0(monkeypatch: pytest.MonkeyPatch, capsys: Any):
    code, out, err = run_probe([], monkeypatch, capsys)
    assert code == 0 and err == ""
    assert "Usage: probe" in out and "--version" in out
    for name in COMMAND_ORDER:
        assert name in out
    code, out, err = run_probe(["models"], monkeypatch, capsys)
    assert code == 0 and err == "" and "Usage: probe models" in out and "prepare" in out


def test_scan_is_listed_first() -> None:
    group = typer.main.get_command(app)
    ctx = group.make_context("probe", ["--help"], resilient_parsing=True)
    assert group.list_commands(ctx)[0] == "scan"  # type: ignore[attr-defined]
    text = help_text()
    listed = [m.group(1) for m in re.finditer(r"^│ (\w+) ", text, re.MULTILINE)]
    assert listed == list(COMMAND_ORDER)


def panel_titles(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"╭─ (.+?) ─", text)]


def test_scan_options_are_grouped_in_panels() -> None:
    expected = [
        options.MODEL,
        options.SAMPLING,
        options.PRECISION,
        options.ATTRIBUTION,
        options.SCALE,
        options.OUTPUT,
    ]
    assert panel_titles(help_text("scan")) == ["Options", *expected]  # "Options": --help alone
    panels = {
        p.opts[0]: p.rich_help_panel for p in COMMAND[("scan",)].params if p.opts[0] != "--help"
    }
    assert panels["--model"] == options.MODEL and panels["--seed"] == options.SAMPLING
    assert panels["--kv-cache-dtype"] == options.PRECISION
    assert panels["--attribute"] == options.ATTRIBUTION and panels["--shards"] == options.SCALE
    assert panels["--out"] == options.OUTPUT


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_option_has_a_real_metavar_and_a_panel(path: tuple[str, ...], command: Any) -> None:
    for param in command.params:
        if param.opts == ["--help"]:
            continue
        assert param.metavar is not None, f"probe {' '.join(path)} {param.opts[0]}: no metavar"
        if param.param_type_name == "option":
            assert param.rich_help_panel in options.PANELS, f"{param.opts[0]} has no panel"
    text = help_text(*path)
    assert not re.search(r"<(bool|str|int|float|path|list\[\w+\])>", text), text
    shown = [t for t in panel_titles(text) if t in options.PANELS]
    assert shown == sorted(shown, key=options.PANELS.index)  # output last, the rest in order


def choices(command: tuple[str, ...], option: str) -> list[str]:
    param = next(p for p in COMMAND[command].params if option in p.opts)
    return param.metavar.strip("[]").split("|")


def test_the_metavars_list_the_library_choices() -> None:
    assert choices(("scan",), "--logprobs-mode") == list(get_args(LogprobsMode))
    assert choices(("scan",), "--train-device-map") == list(DEVICE_MAPS)
    assert choices(("report",), "--format") == list(FORMATS)
    assert choices(("compare",), "--format") == list(FORMATS)
    assert choices(("metrics",), "--rollout-is") == [*IS_LEVELS, "none"]
    assert choices(("scan",), "--routing-replay") == [*REPLAY_MODES, ",".join(REPLAY_MODES)]
    assert choices(("scan",), "--lm-head-fp32") == [*ON_OFF, ",".join(ON_OFF)]
    assert choices(("models", "tiny"), "--arch") == list(ARCHS)


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_is_for_users(path: tuple[str, ...], command: Any) -> None:
    """No developer docstring in the help (reST markup, class names), and an Examples epilog on
    every command that runs something."""
    text = help_text(*path)
    assert "``" not in text and "Config" not in text, text
    if " ".join(path) in EXAMPLES:
        examples = text[text.index("Examples") :]
        for example in EXAMPLES[" ".join(path)]:
            assert " ".join(example.split()) in " ".join(examples.split())
    else:
        assert path == ("models",)  # a group: its commands have the examples


def test_every_command_has_examples() -> None:
    runnable = {" ".join(p) for p, c in COMMANDS if not hasattr(c, "commands")}
    assert runnable == set(EXAMPLES)
