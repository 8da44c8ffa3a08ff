"""``report.md``: the Markdown a user pastes into a pull request.

Every string that comes from the model or the environment (token text, setting, model name,
paths) goes through ``escape``: HTML special characters become entities, Markdown punctuation is
backslash-escaped, newlines become a visible ⏎, and ``@`` / ``#`` get a zero-width space so that
model output can neither inject HTML or links nor mention users or issues. The only HTML in the
file is the ``<b>``/``<details>`` markup written here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from mismatch_probe.report.context import RunContext, WorstToken
from mismatch_probe.report.sections import (
    KEY_METRICS,
    fmt,
    preset_rows,
    settings_rows,
    show_blank,
    visible,
)
from mismatch_probe.report.verdicts import SOURCES, Verdict, evaluate

MD_DIGITS = 6  # significant digits of every number in report.md
# Brackets escaped means no link or image can form, so parentheses stay as they are.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]#!|~$])")  # < > & become entities instead
_ZWSP = "\u200b"
VERDICT_MARK = {"PASS": "✅ PASS", "FAIL": "❌ FAIL", "n/a": "➖ n/a"}


def escape(text: str) -> str:
    """Model or user text -> inert Markdown for one table cell (see the module docstring)."""
    text = _MD_SPECIAL.sub(r"\\\1", text)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return visible(text.replace("@", "@" + _ZWSP).replace("#", "#" + _ZWSP))


def table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """A GitHub table; ``align`` gives one letter per column (``l`` or ``r``, default ``l``)."""
    marks = [("---:" if a == "r" else "---") for a in align.ljust(len(header), "l")]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks) + " |"]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def num(key: str, value: float) -> str:
    return fmt(key, value, MD_DIGITS)


def settings_section(ctx: RunContext) -> list[str]:
    rows = settings_rows(ctx.run, ctx.label, ctx.metrics)
    body = [[escape(name), escape(str(value))] for name, value in rows]
    return ["## Settings", "", *table(["setting", "value"], body), ""]


def verdict_section(verdicts: list[Verdict]) -> list[str]:
    rows = [
        [
            VERDICT_MARK[v.status],
            escape(v.check.label),
            f"`{v.check.metric}`",
            escape(v.check.threshold),
            "not computed" if v.value is None else num(v.check.metric, v.value),
            v.check.source,
        ]
        for v in verdicts
    ]
    header = ["verdict", "check", "metric", "healthy when", "value", "source"]
    used = dict.fromkeys(v.check.source for v in verdicts)
    notes = [f"- {escape(name)}: {escape(SOURCES[name])}" for name in used if name in SOURCES]
    sources = ["Threshold sources:", "", *notes, ""] if notes else []
    return ["## Verdicts", "", *table(header, rows, "llllrl"), "", *sources]


def key_metrics_section(metrics: dict[str, float]) -> list[str]:
    rows = [[f"`{k}`", num(k, metrics[k]), escape(what)] for k, what in KEY_METRICS if k in metrics]
    return ["## Key metrics", "", *table(["metric", "value", "meaning"], rows, "lrl"), ""]


def presets_section(ctx: RunContext) -> list[str]:
    rows = [
        [f"`{name}`", escape(correction), *(f"{v:.{MD_DIGITS}g}" for v in values)]
        for name, correction, values in preset_rows(ctx.metrics, ctx.config)
    ]
    if not rows:
        return []
    header = ["preset", "correction", "tokens masked", "sequences masked", "ESS"]
    return ["### What each correction preset would do", "", *table(header, rows, "llrrr"), ""]


def plots_section(plots: dict[str, tuple[Path, str]], base: Path) -> list[str]:
    """``![title](relative/path.png)`` for each plot, paths relative to ``base``."""
    out = ["## Plots", ""]
    for path, title in plots.values():
        rel = path.relative_to(base).as_posix()
        out += [f"![{escape(title)}]({rel})", ""]
    return out


def _cell_context(tok: WorstToken) -> str:
    return f"{escape(tok.before)}<b>{escape(show_blank(tok.text))}</b>{escape(tok.after)}"


def worst_section(worst: tuple[WorstToken, ...]) -> list[str]:
    rows = [
        [
            str(i),
            f"{tok.seq_id}:{tok.position}",
            _cell_context(tok),
            f"{tok.log_ratio:+.4g}",
            f"{math.exp(tok.rollout_logprob):.4g}",
            f"{math.exp(tok.train_logprob):.4g}",
            tok.cause,
        ]
        for i, tok in enumerate(worst, 1)
    ]
    header = ["#", "seq:pos", "token in context", "log ρ", "p rollout", "p train", "cause"]
    intro = "The tokens of largest |log ρ| (ρ = p_train / p_rollout), the token in bold."
    return ["## Worst tokens", "", intro, "", *table(header, rows, "rllrrrl"), ""]


def all_metrics_section(metrics: dict[str, float]) -> list[str]:
    rows = [[f"`{k}`", num(k, v)] for k, v in sorted(metrics.items())]
    return [
        "<details>",
        f"<summary>Every metric ({len(rows)})</summary>",
        "",
        *table(["metric", "value"], rows, "lr"),
        "",
        "</details>",
        "",
    ]


def render_markdown(ctx: RunContext, plots: dict[str, tuple[Path, str]]) -> str:
    """The whole ``report.md`` of a run; ``plots`` maps a name to (PNG path, title)."""
    from mismatch_probe.report import decisions

    title = f"# Mismatch report: {escape(ctx.run.get('model', {}).get('name', ctx.label))}"
    lines = [title, "", *decisions.recommendation_md(ctx.tables)]
    lines += [*settings_section(ctx), *verdict_section(evaluate(ctx.metrics))]
    lines += key_metrics_section(ctx.metrics) + presets_section(ctx)
    lines += decisions.sweep_md(ctx.tables)
    lines += plots_section(plots, ctx.run_dir) + worst_section(ctx.worst)
    lines += decisions.outliers_md(ctx) + decisions.entropy_md(ctx)
    lines += all_metrics_section(ctx.metrics)
    return "\n".join(lines)
