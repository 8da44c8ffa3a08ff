"""Markdown primitives every Markdown renderer shares: ``escape`` makes model or user text inert
(no link, image, mention, heading or verdict mark can form from it, and bare URLs never become
live links), ``table`` writes a GitHub table."""

from __future__ import annotations

import re

from mismatch_probe.report.sections import visible

# Brackets escaped means no link or image can form, so parentheses stay as they are.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]#!|~$])")  # < > & become entities instead
_ZWSP = "\u200b"
# What GitHub turns into a link even without Markdown link syntax (its autolink extension):
# ``scheme://``, ``www.``, ``mailto:`` and ``xmpp:``; a zero-width space breaks each.
_AUTOLINK = re.compile(
    r"(?i)(?<=[a-z0-9+.-]:)(?=//)|(?<![a-z0-9])(?:www(?=\.)|mailto(?=:)|xmpp(?=:))"
)


def escape(text: str) -> str:
    """Model or user text -> inert Markdown for one table cell (see the module docstring)."""
    text = _MD_SPECIAL.sub(r"\\\1", text)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _AUTOLINK.sub(lambda m: m.group(0) + _ZWSP, text)  # a bare URL never a live link
    text = text.replace("@", "@" + _ZWSP).replace("#", "#" + _ZWSP)
    for mark in ("✅", "❌", "➖"):  # model text never reads as a verdict (html.VERDICT_HTML)
        text = text.replace(mark, mark + _ZWSP)
    return visible(text)


def table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """A GitHub table; ``align`` gives one letter per column (``l`` or ``r``, default ``l``)."""
    marks = [("---:" if a == "r" else "---") for a in align.ljust(len(header), "l")]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks) + " |"]
    return out + ["| " + " | ".join(row) + " |" for row in rows]
