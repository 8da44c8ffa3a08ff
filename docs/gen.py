"""The generated parts of the docs, written by ``cog`` between markers in the pages.

A page holds, e.g.::

    <!-- [[[cog import gen; gen.cli_reference() ]]] -->
    ... what the call printed ...
    <!-- [[[end]]] -->

``make docs-gen`` (``cog -r -I docs`` over every page with markers) rewrites what lies between
the markers; ``make test`` runs ``cog --check`` on them (``tests/test_docs.py``), so a renamed
option, a new metric or a new column fails the tests until the page is regenerated. Every
function here prints Markdown from one of the code's own tables and knows nothing else:

* ``cli_reference``: ``probe COMMAND --help`` for every command, as the terminal shows it;
* ``metrics_reference``: ``metrics/names.py`` (every name of ``metrics.json``);
* ``presets``: the correction presets (``PRESETS``);
* ``health_checks``: the verdicts' thresholds and their sources (``HEALTH_CHECKS``);
* ``store_schema``: the token and sequence stores' columns (``store``'s schemas and
  ``FIELD_DESCRIPTIONS``).

``python docs/gen.py report-example RUN_DIR`` writes the one page that comes from a real run
instead, ``report-example.md`` (see ``report_example``).
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

WIDTH = 80  # the terminal width the CLI reference is rendered at (fits the page)


def _out(text: str) -> None:
    import cog  # type: ignore[import-not-found]  # provided by cog while it runs a page

    cog.out(text)


def _cell(text: str) -> str:
    """A Markdown table cell on one line, pipes escaped. A pipe inside a code span cannot be
    written so that both MkDocs and GitHub keep the table (one shows the backslash, the other
    splits the cell): the tables' sources write ``abs(x)`` instead, and this refuses one."""
    parts = " ".join(text.split()).split("`")
    for code in parts[1::2]:
        if "|" in code:
            raise ValueError(f"a pipe inside a code span of a table cell: `{code}`")
    parts[::2] = [part.replace("|", "\\|") for part in parts[::2]]
    return "`".join(parts)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --- the command line ------------------------------------------------------------------------


def commands() -> list[tuple[str, ...]]:
    """Every command path of ``probe`` (groups included), in ``probe --help`` order."""
    import typer

    from mismatch_probe.cli import app

    found: list[tuple[str, ...]] = []

    def walk(command: Any, path: tuple[str, ...]) -> None:
        found.append(path)
        if hasattr(command, "list_commands"):
            for name in command.list_commands(None):
                walk(command.get_command(None, name), (*path, name))

    walk(typer.main.get_command(app), ())
    return found


def help_text(path: tuple[str, ...]) -> str:
    """``probe PATH --help`` as a terminal ``WIDTH`` columns wide shows it, without colour."""
    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    env = {"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH), "NO_COLOR": "1"}
    result = CliRunner().invoke(app, [*path, "--help"], env=env, prog_name="probe")
    if result.exit_code != 0:
        raise RuntimeError(f"probe {' '.join(path)} --help exited {result.exit_code}")
    lines = [line.rstrip() for line in result.output.splitlines()]
    return "\n".join(lines).strip("\n") + "\n"


def cli_reference() -> None:
    """A section per command: its ``--help``."""
    for path in commands():
        name = " ".join(("probe", *path))
        _out(f"\n## `{name}`\n\n```text\n$ {name} --help\n{help_text(path)}```\n")


# --- the metrics -----------------------------------------------------------------------------


def metrics_reference() -> None:
    """Sources, placeholders, then a table per group of ``NAMES``, then the structured keys."""
    from mismatch_probe.metrics import names

    _out("\n### Sources\n\n")
    _out(_table(("source", "what it means"), [(f"`{k}`", v) for k, v in names.SOURCES.items()]))
    _out("\n### Placeholders\n\nA name with a placeholder stands for one key per value:\n\n")
    values = [(f"`{p}`", ", ".join(f"`{v}`" for v in vs)) for p, vs in names.PLACEHOLDERS.items()]
    _out(_table(("placeholder", "values"), values))
    for group in names.GROUPS:
        members = [n for n in names.NAMES if n.group == group]
        _out(f"\n### {group}\n\n")
        rows = [(f"`{n.pattern}`", n.definition, n.source, n.when or "always") for n in members]
        _out(_table(("name", "definition", "source", "present when"), rows))
    _out("\n### Records and lists\n\n")
    records = [(f"`{k}`", v) for k, v in names.STRUCTURED.items()]
    _out(_table(("key", "what it holds"), records))


def presets() -> None:
    """The correction presets: name, verl's name, what they do (``PRESETS``)."""
    from mismatch_probe.metrics.config import parse_preset
    from mismatch_probe.metrics.presets import PRESETS

    rows = [(f"`{n}`", p.verl_name, parse_preset(n).describe()) for n, p in PRESETS.items()]
    _out(_table(("preset", "verl", "correction"), rows))


def health_checks() -> None:
    """The verdicts: metric, healthy range, label, source, and where each threshold comes from."""
    from mismatch_probe.metrics.verdicts import HEALTH_CHECKS, SOURCES

    rows = [(c.label, f"`{c.metric}`", c.threshold, c.source) for c in HEALTH_CHECKS]
    _out(_table(("check", "metric", "healthy when", "source"), rows))
    _out("\n" + _table(("source", "where the threshold comes from"), list(SOURCES.items())))


# --- the stores ------------------------------------------------------------------------------


# When a column that not every store has is present (scans write the rest always).
PRESENT_IN = {
    "train_entropy": "scans",
    "engine_prefill_logprob": "`--attribute`",
    "engine_prefill_single_logprob": "`--attribute`",
    "train_rollout_dtype_logprob": "`--attribute`",
    "stale_logprob": "`--attribute --stale-model`",
    "train_no_replay_logprob": "`--attribute`, MoE replay settings",
    "turn": "scans, `probe ingest`",
    "num_turns": "scans, `probe ingest`",
    "turn_finish_reasons": "scans",
    "rerender_differs": "multi-turn trajectories",
    "rerender_mismatched_tokens": "multi-turn trajectories",
    "rerender_context": "multi-turn trajectories",
    "seq_k3_sum": "scans",
    "seq_log_ratio_sum": "scans",
}
TYPES = {"float": "float32", "double": "float64"}  # pyarrow's names -> numpy's


def _fields(kind: str) -> list[Any]:
    """The pyarrow fields of a scan's token or sequence store, in the order they are written."""
    from mismatch_probe import store

    if kind == "tokens":
        extra = [store.ENTROPY_FIELD, *store.RUNG_FIELDS, store.TURN_FIELD]
        return [*store.TOKEN_SCHEMA, *extra, *store.SETTING_FIELDS]
    extra = [*store.SEQUENCE_MISMATCH_FIELDS, *store.SEQUENCE_TURN_FIELDS]
    return [*store.SEQUENCE_SCHEMA, *extra, *store.SETTING_FIELDS]


def store_schema(kind: str) -> None:
    """The columns of a scan's ``tokens.parquet`` (``kind="tokens"``) or ``sequences.parquet``
    (``"sequences"``)."""
    from mismatch_probe import store

    words = {"rollout": "the run's log-probability mode", "rescoring": "the rescoring's"}
    setting = {f.name for f in store.SETTING_FIELDS}
    rows = []
    for field in _fields(kind):
        text = store.FIELD_DESCRIPTIONS.get(field.name, "").format(**words)
        when = "scans" if field.name in setting else PRESENT_IN.get(field.name, "always")
        kind_ = TYPES.get(str(field.type), str(field.type))
        rows.append(
            (f"`{field.name}`", kind_ + (", nullable" if field.nullable else ""), when, text)
        )
    _out(_table(("column", "type", "present in", "meaning"), rows))


# --- the example report (from a real run, not from cog) -------------------------------------

EXAMPLE = "report-example.md"
EXAMPLE_PLOTS = ("ratio_hist", "probs", "prob_bins")  # copied into docs/ as report-<name>.png
PLOT = re.compile(r"!\[([^\]]*)\]\(plots/([\w-]+)\.png\)")


def report_example(run_dir: Path, docs: Path) -> None:
    """Write ``docs/report-example.md`` from a run's ``report.md`` (the ``make demo`` scan:
    ``python docs/gen.py report-example reports/demo``) and copy three of its plots beside it;
    the other plots are named, not copied."""
    text = (run_dir / "report.md").read_text()
    for private in {str(Path.home()), str(Path.cwd()), str(run_dir.resolve())}:
        if private in text:
            raise SystemExit(f"{run_dir}/report.md holds the local path {private}")

    def plot(match: re.Match[str]) -> str:
        alt, name = match.groups()
        if name in EXAMPLE_PLOTS:
            return f"![{alt}](report-{name}.png)"
        return f"*({alt}: `plots/{name}.png` in the run directory, not copied into docs/.)*"

    note = (
        "<!-- Generated by `python docs/gen.py report-example RUN_DIR` from the `make demo` "
        "run's report.md (SmolLM2-135M-Instruct, vLLM bf16 rollout on a CPU vs transformers "
        "fp32 rescoring); three plots copied beside it. -->\n\n"
    )
    (docs / EXAMPLE).write_text(note + PLOT.sub(plot, text))
    for name in EXAMPLE_PLOTS:
        shutil.copyfile(run_dir / "plots" / f"{name}.png", docs / f"report-{name}.png")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "report-example":
        raise SystemExit("usage: python docs/gen.py report-example RUN_DIR")
    report_example(Path(sys.argv[2]), Path(__file__).resolve().parent)
