"""The excerpts of real runs in the docs match what the tool prints today.

An excerpt is a ```text block after an ``<!-- excerpt: NAME ... -->`` comment: a ``$`` command
line, then lines of its output, with ``...`` where lines are cut. Numbers differ between machines
(and a test run is smaller than the documented one), so this compares structure, not digits:
each excerpt's scan runs again here, smaller, on the same model, and each stretch of the excerpt
between two ``...`` must be a stretch of the fresh output, line for line, once both are
normalised: numbers, setting names, verdicts and the run directory become placeholders, the
sentences that say what the numbers mean (the recommendation, the matrix headline) become one
placeholder each, a line's words are compared in any order (a grid puts its failing checks
first), and the lines that depend on the CPU or the data (a setting skipped for want of
AVX-512, the first re-render difference) are left out. A line the tool no longer prints, or a
new line inside an excerpt's stretch, fails.

The same runs check three more claims of the docs: the example report (docs/report-example.md)
has the sections and table headers of a fresh ``report.md``; every key of ``metrics.json`` has a
row in the metric names table; and the first example of ``probe check --help`` passes on the
demo scan.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mismatch_probe.cli_help import EXAMPLES
from mismatch_probe.metrics import PRESETS
from mismatch_probe.metrics.names import STRUCTURED, lookup
from tests.forked_cli import Forker

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
PROBE = str(Path(sys.executable).with_name("probe"))
EXCERPT = re.compile(r"<!-- excerpt: ([\w-]+)[^>]*-->\n```text\n(.*?)^```", re.S | re.M)
FRESH = "fresh-run"  # the --out of every run here (relative to its working directory)
WIDE = "1000"  # COLUMNS of the fresh runs: no line wraps, so a line is a line
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))


@dataclass(frozen=True)
class Run:
    """How to re-run an excerpt's scan, smaller: ``args`` after ``probe scan``, and the run
    directory the excerpt shows (replaced like the fresh one)."""

    args: tuple[str, ...]
    shown_out: str
    moe: bool = False


RUNS = {
    "demo": Run(("--num-prompts", "3", "--max-tokens", "24"), "reports/demo"),
    "matrix": Run(
        ("--num-prompts", "2", "--max-tokens", "8", "--rollout-dtype", "bfloat16,float32"),
        "reports/demo-precision",
    ),
    "moe": Run(
        (
            *("--num-prompts", "2", "--samples-per-prompt", "2", "--max-tokens", "8"),
            *("--rollout-dtype", "bfloat16", "--routing-replay", "none,rollout"),
        ),
        "reports/moe",
        moe=True,
    ),
    "agentic": Run(
        (
            "--prompts",
            str(ROOT / "prompts" / "agentic.jsonl"),
            "--num-prompts",
            "2",
            "--max-tokens",
            "8",
        ),
        "reports/agentic",
    ),
}

SETTING = re.compile(r"rollout=[\w.,=]+ \| train=[\w.,=]+")
NUMBER = re.compile(r"(?<![\w.])[-+−]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?%?(?!\w)")
VERDICT = re.compile(r"[✔✘·] (?:PASS|FAIL(?: #/#)?|n/a)")
# Sentences whose words follow the data: one placeholder each.
SENTENCES = (
    (re.compile(r"^Recommendation(?: for <setting>)?: .*"), "<recommendation>"),
    (
        re.compile(
            r"^(?:All # settings(?: that ran)? pass every check\."
            r"|# of # settings(?: that ran)? fail a check: .*?)"
            r"(?: # of # settings did not run: .*)?$"  # skipped settings counted and named
        ),
        "<h>",
    ),
)
# A grid row's last cell, the setting's recommendation (``grid.recommendation_cell``): it follows
# the data like the sentences above, one placeholder.
RECOMMENDATION_CELL = re.compile(
    r"\s(?:none needed|investigate first|no preset fits \(closest \w+\)|"
    + "|".join(re.escape(name) for name in PRESETS)
    + r")$"
)
# Lines that depend on the CPU or on the data: not compared.
OPTIONAL = re.compile(r"^(?:skipped <setting>|skipped rollout=|first difference: )")


def shape(line: str, out: str) -> tuple[str, ...] | None:
    """The structure of one output line (its words, sorted), or None for a line not compared."""
    text = line.strip().replace(out, "<out>")
    if not text or OPTIONAL.match(text):
        return None
    text = RECOMMENDATION_CELL.sub(" <recommendation>", text)
    text = SETTING.sub("<setting>", text)
    text = VERDICT.sub("<verdict>", NUMBER.sub("#", text))
    text = re.sub(r"[✔✘]", "<mark>", text)
    text = re.sub(r"[─━═]+", "─", text)  # a rule is as wide as its table
    for pattern, placeholder in SENTENCES:
        text = pattern.sub(placeholder, text)
    return tuple(sorted(text.split()))


def shapes(lines: list[str], out: str) -> list[tuple[str, ...]]:
    """The compared lines' shapes, runs of equal shapes (table rows) kept once."""
    found: list[tuple[str, ...]] = []
    for line in lines:
        s = shape(line, out)
        if s is not None and (not found or found[-1] != s):
            found.append(s)
    return found


def excerpts() -> dict[str, str]:
    found = {name: body for page in PAGES for name, body in EXCERPT.findall(page.read_text())}
    return found


def stretches(body: str) -> list[list[str]]:
    """The excerpt's output (its ``$`` command and continuation lines dropped), cut at ``...``."""
    lines = body.splitlines()
    while lines and (lines[0].startswith("$ ") or lines[0].startswith("    ")):
        lines.pop(0)
    parts: list[list[str]] = [[]]
    for line in lines:
        if line.strip() == "...":
            parts.append([])
        else:
            parts[-1].append(line)
    return [p for p in parts if any(line.strip() for line in p)]


class Fresh:
    """Each excerpt's scan, run when a test first asks for it: ``fresh[name]`` is
    ``(run directory, stdout)``. The commands are forked from one process that has imported
    torch, vLLM and transformers once (``tests/forked_cli.py``): each runs ``cli.main()`` as
    the console script does, without paying those imports again."""

    def __init__(self, root: pytest.TempPathFactory) -> None:
        self.root = root
        self.runs: dict[str, tuple[Path, str]] = {}
        self.forker: Forker | None = None

    def __getitem__(self, name: str) -> tuple[Path, str]:
        if name not in self.runs:
            self.runs[name] = self._scan(name, RUNS[name])
        return self.runs[name]

    def probe(self, args: list[str], cwd: Path) -> str:
        """``probe ARGS`` in ``cwd``: its stdout (it must exit 0)."""
        self.forker = self.forker or Forker()
        stdout, stderr = cwd / f"{args[0]}.stdout", cwd / f"{args[0]}.stderr"
        code = self.forker.run(args, {"COLUMNS": WIDE}, stderr, stdout, cwd)
        assert code == 0, f"probe {shlex.join(args)}:\n{stderr.read_text()[-3000:]}"
        return stdout.read_text()

    def _scan(self, name: str, run: Run) -> tuple[Path, str]:
        cwd = self.root.mktemp(name)
        args = list(run.args)
        if run.moe:
            model = cwd / "tiny-moe"
            self.probe(["models", "tiny", str(model), "--arch", "qwen3_moe"], cwd)
            args = ["--model", str(model), *args]
        return cwd / FRESH, self.probe(["scan", *args, "--out", FRESH], cwd)

    def close(self) -> None:
        if self.forker is not None:
            self.forker.close()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fresh]:
    runs = Fresh(tmp_path_factory)
    yield runs
    runs.close()


def test_every_excerpt_has_a_run() -> None:
    assert set(excerpts()) == set(RUNS)


@pytest.mark.parametrize("name", list(RUNS))
def test_excerpt_matches_a_fresh_run(name: str, fresh: Fresh) -> None:
    ours = shapes(fresh[name][1].splitlines(), FRESH)
    for stretch in stretches(excerpts()[name]):
        want = shapes(stretch, RUNS[name].shown_out)
        n = len(want)
        found = any(ours[i : i + n] == want for i in range(len(ours) - n + 1))
        shown, got = ("\n".join(" ".join(s) for s in lines) for lines in (want, ours))
        assert found, (
            f"excerpt {name!r}: no stretch of the fresh run is\n{shown}\n--- fresh:\n{got}"
        )


def test_normalising_keeps_what_a_reader_sees() -> None:
    """The normalisation forgets numbers and word order, not words: a renamed column or a
    missing verdict still differs."""
    a = shape("rollout=bf16 | train=fp32  ✔ PASS     4883  0.001333", "x")
    assert a == shape("rollout=fp32 | train=fp32  ✘ FAIL 2/8  12  -3e-05", "x")
    assert a != shape("rollout=bf16 | train=fp32  4883  0.001333", "x")
    assert shape("setting verdict tokens k3_kl", "x") != shape("setting verdict tokens kl", "x")
    assert shape("skipped rollout=bf16,kv=fp8: an fp8 KV cache needs AVX-512", "x") is None
    assert shape(" ─────────", "x") == shape(" ───", "x")
    row = "rollout=bf16 | train=fp32   ✔ PASS     ✔ 0.002202     ✔ 0.002661   {}"
    assert shape(row.format("token_is"), "x") == shape(row.format("none needed"), "x")
    assert shape(row.format("token_is"), "x") != shape(row.format(""), "x")


def headings_and_tables(text: str) -> tuple[list[str], list[str]]:
    """A Markdown report's headings and table header rows, in order."""
    lines = text.splitlines()
    headings = [line for line in lines if line.startswith("#")]
    headers = [
        line
        for line, below in itertools.pairwise(lines)
        if line.startswith("|") and re.match(r"^\| ?[-:]", below)
    ]
    return headings, headers


def test_the_example_report_has_the_sections_of_a_fresh_one(
    fresh: Fresh,
) -> None:
    example = (ROOT / "docs" / "report-example.md").read_text()
    report = (fresh["demo"][0] / "report.md").read_text()
    assert headings_and_tables(example) == headings_and_tables(report)


@pytest.mark.parametrize("name", list(RUNS))
def test_every_key_of_metrics_json_has_a_row(name: str, fresh: Fresh) -> None:
    data = json.loads((fresh[name][0] / "metrics.json").read_text())
    unnamed = [k for k in data if k not in STRUCTURED and lookup(k) is None]
    assert unnamed == [], "metrics.json keys without a row in mismatch_probe/metrics/names.py"


def test_the_first_check_example_passes_on_the_demo_scan(
    fresh: Fresh,
) -> None:
    """``probe check --help`` shows it first: on the demo scan it must pass (exit 0)."""
    example = EXAMPLES["check"][0]
    argv = shlex.split(example.replace("reports/demo", str(fresh["demo"][0])))
    out = subprocess.run([PROBE, *argv[1:]], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
