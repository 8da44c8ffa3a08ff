"""The data-integrity section, shown first in every report (metrics spec section 8).

The findings are computed from the run's token store by ``rundir.integrity`` (``run_integrity``,
which also writes ``integrity.json``). Renderers: ``integrity_markdown`` (report.md, report.html,
the PR comment) and ``integrity_text`` (the terminal). A clean run is one line; each finding is
one line with its severity, check, counts and message.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.text import Text

from mismatch_probe.metrics.integrity import ERROR, Finding, Integrity
from mismatch_probe.report.sections import visible

CLEAN = "Data integrity: clean (no placeholder, shift, copy, bad log-prob or sampling gap)"
MARK = {ERROR: ("❌", "✘", "bold red"), "warning": ("⚠️", "⚠", "yellow")}  # md, terminal, style


def _counts(f: Finding) -> str:
    if not f.tokens and not f.sequences:
        return ""
    return f" ({f.tokens:,} tokens, {f.sequences:,} sequences)"


def tally(findings: tuple[Finding, ...]) -> str:
    """``1 error, 2 warnings`` (``clean`` for none)."""
    n_err = sum(f.severity == ERROR for f in findings)
    counts = ((n_err, "error"), (len(findings) - n_err, "warning"))
    return ", ".join(f"{n} {word}{'s' if n != 1 else ''}" for n, word in counts if n) or "clean"


def summary(findings: tuple[Finding, ...], step: int | None = None) -> str:
    """``Data integrity: 1 error, 1 warning`` (``at step N``), or the clean line."""
    if not findings:
        return CLEAN if step is None else CLEAN.replace("integrity:", f"integrity at step {step}:")
    where = f" at step {step}" if step is not None else ""
    return f"Data integrity{where}: {tally(findings)} (numbers below may not mean what they say)"


def applied_line(integrity: Integrity) -> str:
    """``Masks applied: sample_loss_mask (detail)``, or ``""``."""
    masks = [
        m["rule"] + (f" ({m['detail']})" if m.get("detail") else "")
        for m in integrity.masks_applied
    ]
    return f"Masks applied as the framework does: {'; '.join(masks)}." if masks else ""


def integrity_markdown(integrity: Integrity | None, accepted: Iterable[str] = ()) -> list[str]:
    """One line for a clean run (``✅ Data integrity: clean ...``); else ``## Data integrity``
    with the summary and one bullet per finding (an accepted error says so). Then the masks
    applied, if any."""
    from mismatch_probe.report.md import escape

    if integrity is None:
        return []
    ok = set(accepted)
    findings = integrity.findings
    applied = applied_line(integrity)
    if not findings:
        return [f"✅ {escape(CLEAN)}", "", *([escape(applied), ""] if applied else [])]
    lines = ["## Data integrity", "", escape(summary(findings)), ""]
    for f in findings:
        mark = MARK.get(f.severity, MARK["warning"])[0]
        note = " (accepted)" if f.check in ok else ""
        lines.append(
            f"- {mark} **{f.severity}{note}** `{f.check}`{escape(_counts(f))}: {escape(f.message)}"
        )
    lines.append("")
    return lines + ([escape(applied), ""] if applied else [])


def integrity_json(integrity: Integrity, step: int | None = None) -> dict[str, Any]:
    """What ``--json`` shows: the run's findings (or one step's) and the masks applied."""
    data: dict[str, Any] = {"findings": [f.to_dict() for f in integrity.of_step(step)]}
    if step is not None:
        data["step"] = step
    return {**data, "masks_applied": list(integrity.masks_applied)}


def integrity_text(
    integrity: Integrity | None, step: int | None = None, accepted: Iterable[str] = ()
) -> Text:
    """The terminal version: the summary line, one line per finding (of ``step`` when given;
    an accepted check says so), the masks applied."""
    if integrity is None:
        return Text()
    findings = integrity.of_step(step)
    ok = set(accepted)
    bad = any(f.severity == ERROR and f.check not in ok for f in findings)
    style = "bold red" if bad else "yellow" if findings else "green"
    text = Text(("✔ " if not findings else "") + summary(findings, step), style=style)
    for f in findings:
        _, mark, mark_style = MARK.get(f.severity, MARK["warning"])
        label = f"{f.severity} (accepted)" if f.check in ok else f.severity
        text.append(f"\n  {mark} {label} ", style=mark_style)
        text.append(f"{f.check}{_counts(f)}: ", style="bold")
        text.append(visible(f.message))
    applied = applied_line(integrity)
    if applied:
        text.append(f"\n  {visible(applied)}", style="dim")
    return text


# --- several runs (probe compare) ---------------------------------------------------------------

CLEAN_EVERY_RUN = CLEAN.replace("Data integrity: clean", "Data integrity: clean in every run")


def _per_run(labeled: list[tuple[str, Integrity | None]]) -> list[tuple[str, tuple[Finding, ...]]]:
    return [(label, i.findings) for label, i in labeled if i is not None]


def runs_markdown(labeled: list[tuple[str, Integrity | None]]) -> list[str]:
    """Every run's findings (``probe compare``): one line when all are clean, else
    ``## Data integrity`` with a bullet per run and one per finding under it."""
    from mismatch_probe.report.md import escape

    runs = _per_run(labeled)
    if not runs:
        return []
    if not any(findings for _, findings in runs):
        return [f"✅ {escape(CLEAN_EVERY_RUN)}", ""]
    lines = ["## Data integrity", ""]
    for label, findings in runs:
        lines.append(f"- {escape(label)}: {tally(findings)}")
        for f in findings:
            mark = MARK.get(f.severity, MARK["warning"])[0]
            body = f"{escape(_counts(f))}: {escape(f.message)}"
            lines.append(f"  - {mark} **{f.severity}** `{f.check}`{body}")
    return [*lines, ""]


def runs_text(labeled: list[tuple[str, Integrity | None]]) -> Text:
    """The terminal version of ``runs_markdown``."""
    runs = _per_run(labeled)
    if not runs:
        return Text()
    if not any(findings for _, findings in runs):
        return Text(f"✔ {CLEAN_EVERY_RUN}", style="green")
    text = Text("Data integrity", style="bold")
    for label, findings in runs:
        text.append(f"\n  {visible(label)}: ")
        if not findings:
            text.append("clean", style="green")
        for f in findings:
            _, mark, style = MARK.get(f.severity, MARK["warning"])
            text.append(f"\n    {mark} {f.severity} ", style=style)
            text.append(f"{f.check}{_counts(f)}: ", style="bold")
            text.append(visible(f.message))
    return text
