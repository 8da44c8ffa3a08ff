"""``probe selftest``'s output: the fault table with what was expected and what was seen.

Takes plain rows (``(fault, injected how, must be caught by, seen, held)``); the numbers and the
verdicts are ``selftest.run``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

SelftestRow = tuple[str, str, str, str, bool]


def selftest_table(rows: Sequence[SelftestRow]) -> Table:
    table = Table(title="probe selftest: each fault against its detector", title_justify="left")
    table.title_style = "bold"
    for name in ("", "fault", "injected how", "must be caught by", "seen"):
        table.add_column(name)
    for fault, how, expect, seen, held in rows:
        mark = Text("✔", style="green") if held else Text("✘", style="bold red")
        table.add_row(mark, fault, how, "no finding, probe check passes" if expect == "none"
                      else _expected(expect), seen)  # fmt: skip
    return table


def _expected(expect: str) -> str:
    words = {"check": "probe check (k3_kl bound)", "exact": "probe check --exact",
             "matrix": "probe check, naming the setting"}  # fmt: skip
    return words.get(expect, expect)


def render_selftest(rows: Sequence[SelftestRow], model: str, tokens: int, console: Console) -> None:
    """The table, then one line: every row held, or which did not."""
    console.print(selftest_table(rows))
    bad = [r[0] for r in rows if not r[4]]
    head = f"on {model}, one scan of {tokens:,} tokens: "
    if not bad:
        console.print(Text(head + f"all {len(rows)} rows hold", style="green"), highlight=False)
    else:
        text = head + f"{len(bad)} of {len(rows)} rows do not hold: {'; '.join(bad)}"
        console.print(Text(text, style="bold red"), highlight=False)
