"""docs/ci/github-actions.yml stays true: it parses, and every ``probe`` command in it exists and
accepts its options and values (click parses each command line, as ``tests/test_docs.py``
checks the README's commands and options)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from mismatch_probe.report.baseline import parse_increase
from mismatch_probe.report.check import parse_bound
from mismatch_probe.report.comment import FORMATS
from tests.test_docs import COMMANDS

RECIPE = Path(__file__).resolve().parent.parent / "docs" / "ci" / "github-actions.yml"
SEPARATORS = {"&&", "||", "|", ";", ">", ">>", "<", "(", ")"}


def workflow() -> dict[Any, Any]:
    return dict(yaml.safe_load(RECIPE.read_text()))


def steps() -> list[dict[str, Any]]:
    return [s for job in workflow()["jobs"].values() for s in job["steps"]]


def probe_commands() -> list[list[str]]:
    """Every ``probe`` (or ``.../bin/probe``) invocation in the run scripts, as argv lists."""
    found = []
    for step in steps():
        script = step.get("run", "").replace("\\\n", " ")
        for line in script.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words: list[str] = []
            for token in [*lexer, ";"]:
                if token not in SEPARATORS:
                    words.append(token)
                    continue
                if words and Path(words[0]).name == "probe":
                    found.append(words[1:])
                words = []
    return found


def resolve(argv: list[str]) -> tuple[tuple[str, ...], Any, list[str]]:
    """The longest command path that ``argv`` starts with, its command, the rest."""
    commands = dict(COMMANDS)
    for n in range(len(argv), 0, -1):
        if tuple(argv[:n]) in commands:
            return tuple(argv[:n]), commands[tuple(argv[:n])], argv[n:]
    raise AssertionError(f"no such command: probe {' '.join(argv)}")


def test_the_recipe_is_a_workflow() -> None:
    flow = workflow()
    assert flow[True] == {"pull_request": None}  # YAML 1.1 reads the key `on` as True
    assert flow["permissions"]["pull-requests"] == "write"
    uses = [s.get("uses", "").split("@")[0] for s in steps()]
    assert {"actions/checkout", "actions/cache", "actions/upload-artifact"} <= set(uses)
    upload = next(s for s in steps() if s.get("uses", "").startswith("actions/upload-artifact"))
    assert "runs/head" in upload["with"]["path"] and upload["if"] == "always()"
    assert any("gh pr comment" in s.get("run", "") for s in steps())
    assert "probe check" in steps()[-1]["run"]  # the gate decides the job, last


def test_every_probe_command_exists_with_those_options() -> None:
    commands = probe_commands()
    assert [c[0] for c in commands] == ["scan", "scan", "compare", "check"]
    for argv in commands:
        path, command, rest = resolve(argv)
        try:
            command.make_context(" ".join(("probe", *path)), list(rest))
        except typer.TyperException as exc:  # typer's click: unknown option, bad value
            pytest.fail(f"probe {' '.join(argv)}: {exc.format_message()}")


def option_values(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == name]


def test_scans_match_and_the_gate_values_parse() -> None:
    base, head, compare, check = probe_commands()

    def without_out(argv: list[str]) -> list[str]:
        i = argv.index("--out")
        return argv[:i] + argv[i + 2 :]

    assert without_out(base) == without_out(head)  # comparable runs, or the gate exits 2
    base_out, head_out = option_values(base, "--out")[0], option_values(head, "--out")[0]
    assert compare[1:3] == [base_out, head_out]
    assert option_values(compare, "--format") == ["pr-comment"] and "pr-comment" in FORMATS
    assert check[1] == head_out and option_values(check, "--baseline") == [base_out]
    increases = [parse_increase(v) for v in option_values(check, "--max-increase")]
    assert {i.metric for i in increases} >= {"k3_kl", "chi2_token"}
    for value in option_values(check, "--max"):
        parse_bound(value, "max")
