"""Docs stay true: the README and every page of the docs site (``docs/``).

* every command and option has help text and is explained in a hand-written page (the
  generated command-line reference does not count);
* every ``probe`` command line in a code block parses (click reads it: the options exist and
  take their values), and every option named in inline code exists;
* every ``--help`` example is a line of a page and parses;
* the generated parts (between ``cog`` markers) are current (``cog --check``), and the site
  builds with ``mkdocs build --strict`` (no broken link or anchor, every page in the nav);
* every link stays inside the repository's own files or is a public URL; the README is short.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from mismatch_probe.cli import app
from mismatch_probe.cli_help import EXAMPLES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_FILE = ROOT / "README.md"
README = README_FILE.read_text()
PAGE_FILES = sorted(DOCS.rglob("*.md"))
# Every Markdown file a user reads: the README and the pages of the site.
FILES = [README_FILE, *PAGE_FILES]
README_LIMIT = 15_000  # bytes
GENERATED = re.compile(r"<!-- \[\[\[cog.*?<!-- \[\[\[end\]\]\] -->", re.S)
# Options of other tools that the docs name in inline code.
FOREIGN_OPTIONS = {"--dump-details", "--extra-index-url", "--skip-actor-forward-only"}


def walk(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from walk(sub, (*path, name))


COMMANDS = [(path, cmd) for path, cmd in walk(typer.main.get_command(app)) if path]


def hand_written(path: Path) -> str:
    """The text of a page without its generated parts."""
    return GENERATED.sub("", path.read_text())


PROSE = "\n".join(hand_written(path) for path in FILES)


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_command_has_help_and_is_documented(path: tuple[str, ...], command: Any) -> None:
    assert (command.help or "").strip(), f"probe {' '.join(path)} has no help"
    assert f"probe {' '.join(path)}" in PROSE, f"probe {' '.join(path)} is in no page"


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
    assert f"`{option}" in PROSE, f"{option} (probe {' '.join(path)}) is explained in no page"


def test_help_answers_without_heavy_imports() -> None:
    """``probe --help`` must not import torch, vllm or transformers (lazy imports)."""
    code = (
        "import sys; from mismatch_probe.cli import app; "
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'matplotlib') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# --- command lines ---------------------------------------------------------------------------


def parse(argv: list[str]) -> None:
    """Let click parse ``probe ARGS`` as the command it names; fail with click's message."""
    assert argv[0] == "probe", argv
    words = argv[1:]
    path = next(
        (p for p, _ in sorted(COMMANDS, key=lambda c: -len(c[0])) if tuple(words[: len(p)]) == p),
        None,
    )
    assert path is not None, f"{shlex.join(argv)}: no such command"
    try:
        dict(COMMANDS)[path].make_context(f"probe {' '.join(path)}", words[len(path) :])
    except typer.TyperException as exc:  # typer's click: unknown option, bad value
        pytest.fail(f"{shlex.join(argv)}: {exc.format_message()}")


CODE_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
PROMPT = re.compile(r"^(?:\$ )?(?:\S*/bin/)?(probe\b.*)$")


def command_lines(path: Path) -> Iterator[str]:
    """Every ``probe ...`` line of the page's hand-written shell and text code blocks (``$ ``
    prompts and ``.venv/bin/`` prefixes dropped, ``\\`` continuations joined, ``# comments``
    cut)."""
    for lang, body in CODE_BLOCK.findall(hand_written(path)):
        if lang not in ("", "bash", "sh", "text", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            match = PROMPT.match(line.strip())
            if match:
                yield re.sub(r"\s+#.*$", "", match.group(1)).strip()


LINES = [(path, line) for path in FILES for line in command_lines(path)]


@pytest.mark.parametrize(
    ("path", "line"), LINES, ids=[f"{p.relative_to(ROOT)}: {line}" for p, line in LINES]
)
def test_every_command_line_in_the_docs_parses(path: Path, line: str) -> None:
    parse(shlex.split(line))


def known_options() -> set[str]:
    found = {"--help", "--version"}
    for _, command in COMMANDS:
        for param in command.params:
            found.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
    return found


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_option_named_in_the_docs_exists(path: Path) -> None:
    """An option in inline code (``--rollout-is``, ``--max-increase METRIC=Fx``) is one that
    some command takes: a renamed or removed option fails here."""
    known = known_options() | FOREIGN_OPTIONS
    named = {
        word
        for code in re.findall(r"`([^`\n]+)`", hand_written(path))
        for word in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", code)
    }
    assert named - known == set(), f"options no command has, in {path.relative_to(ROOT)}"


EXAMPLE_LINES = [(command, line) for command, lines in EXAMPLES.items() for line in lines]


@pytest.mark.parametrize(("command", "line"), EXAMPLE_LINES, ids=[x for _, x in EXAMPLE_LINES])
def test_every_help_example_parses_and_is_documented(command: str, line: str) -> None:
    """The "Examples" of ``probe COMMAND --help`` are command lines of the pages' code blocks
    that click parses."""
    documented = {text for _, text in LINES}
    assert line in documented, f"{line!r} is not a command line of any page"
    argv = shlex.split(line)
    assert tuple(argv[1 : 1 + len(command.split())]) == tuple(command.split())
    parse(argv)


# --- the site --------------------------------------------------------------------------------


def nav_pages(nav: Any) -> Iterator[str]:
    """The page paths of an ``mkdocs.yml`` nav (nested sections, titled or not)."""
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            yield from nav_pages(value)
        else:
            yield str(value)


def test_every_page_is_in_the_nav() -> None:
    """A page of docs/ that the nav leaves out would be built but not found: list it under its
    section in docs/mkdocs.yml (and a nav entry without its page is a broken link)."""
    config = yaml.safe_load((DOCS / "mkdocs.yml").read_text())
    listed = list(nav_pages(config["nav"]))
    pages = [str(p.relative_to(DOCS)) for p in PAGE_FILES]
    assert sorted(set(pages) - set(listed)) == [], "pages missing from the nav of docs/mkdocs.yml"
    assert sorted(set(listed) - set(pages)) == [], "nav entries without a page"
    assert len(listed) == len(set(listed)), "a page listed twice in the nav"


def test_generated_parts_are_current() -> None:
    """``cog --check`` on every page with generated parts: run ``make docs-gen`` after changing
    an option, a help text, a metric name or a store column."""
    pages = [str(p) for p in PAGE_FILES if "[[[cog" in p.read_text()]
    assert pages, "no page has a generated part"
    cog = [sys.executable, "-m", "cogapp", "--check", "-I", str(DOCS), *pages]
    out = subprocess.run(cog, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, f"stale (run `make docs-gen`):\n{out.stdout}{out.stderr}"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link or anchor, a page left out of the nav or a
    missing page fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(DOCS / "mkdocs.yml")]
    out = subprocess.run(
        [*build, "-d", str(tmp_path / "site")], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "site" / "metrics.html").is_file()
    assert "k3_kl_reverse" in (tmp_path / "site" / "metrics.html").read_text()


# --- links, tables, size ---------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slugs(path: Path) -> set[str]:
    """The anchors of a page's headings, as MkDocs (Python-Markdown's toc) makes them."""
    from markdown.extensions.toc import slugify

    text = CODE_BLOCK.sub("", path.read_text())
    headings = re.findall(r"^#+ (.*)$", text, re.M)
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in headings}


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_links_stay_inside_the_repository(path: Path) -> None:
    """A link is a public URL or a file of the repository (with an anchor its page has); no
    page cites a file the repository does not hold."""
    text = CODE_BLOCK.sub("", path.read_text())
    assert "shared/spec" not in path.read_text()
    for target in LINK.findall(text):
        if target.startswith(("https://", "http://")):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.exists(), f"{path.name}: link to {target}, which does not exist"
        assert resolved.is_relative_to(ROOT), f"{path.name}: link outside the repository"
        if anchor and resolved.suffix == ".md":
            assert anchor in slugs(resolved), f"{path.name}: no anchor #{anchor} in {file}"


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_tables_are_whole(path: Path) -> None:
    """A table row follows its table: a blank line inside a table turns the rows after it into
    a paragraph (the token-schema table of an earlier README). In the site's pages no code span
    in a table holds a pipe, which MkDocs and GitHub would render differently."""
    lines = CODE_BLOCK.sub("", path.read_text()).splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            assert i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]), (
                f"{path.name}:{i + 1}: a table row outside a table: {line[:60]}"
            )
        if line.startswith("|") and path != README_FILE:
            for code in re.findall(r"`[^`]*`", line):
                assert "|" not in code, f"{path.name}:{i + 1}: a pipe in {code}"


def test_the_readme_is_short_and_keeps_the_two_commands() -> None:
    assert len(README.encode()) <= README_LIMIT, f"README.md is {len(README.encode())} bytes"
    assert "make demo" in README and "make test" in README


CHOICE_OPTIONS = [
    (opt, tuple(param.metavar[1:-1].split("|")))
    for _, cmd in COMMANDS
    for param in cmd.params
    if param.param_type_name == "option" and re.fullmatch(r"\[[\w,|-]+\]", param.metavar or "")
    for opt in param.opts
    if opt.startswith("--")
]


@pytest.mark.parametrize(("option", "choices"), sorted(set(CHOICE_OPTIONS)))
def test_a_documented_option_lists_every_choice(option: str, choices: tuple[str, ...]) -> None:
    """A table row that explains an option with a fixed set of values names every value (an
    earlier README's ``--rollout-is`` row left out ``none``)."""
    rows = [
        line
        for line in PROSE.splitlines()
        if line.startswith("|") and re.match(rf"^\| `{re.escape(option)}[ `]", line)
    ]
    for row in rows:
        missing = [c for c in choices if f"`{c}`" not in row and f"`{option} {c}`" not in row]
        assert missing == [], f"{row[:80]}...: no {missing}"
