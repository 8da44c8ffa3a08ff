"""``report.md``: the Markdown a user pastes into a pull request.

Every string that comes from the model or the environment (token text, setting, model name,
paths) goes through ``escape``: HTML special characters become entities, Markdown punctuation is
backslash-escaped, newlines become a visible ⏎, and ``@`` / ``#`` get a zero-width space so that
model output can neither inject HTML or links nor mention users or issues; bare URLs
(``http://``, ``www.``, ``mailto:``: GitHub links them even without link syntax) get one too.
The only HTML in the file is the ``<b>``/``<details>`` markup written here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mismatch_probe.metrics.verdicts import SOURCES, Verdict, evaluate
from mismatch_probe.report.integrity import integrity_markdown
from mismatch_probe.report.md import escape, table
from mismatch_probe.report.sections import (
    KEY_METRICS,
    fmt,
    preset_rows,
    prob_text,
    settings_rows,
    show_blank,
)
from mismatch_probe.rundir.causes import LEGEND
from mismatch_probe.rundir.context import RunContext, WorstToken

MD_DIGITS = 6  # significant digits of every number in report.md
VERDICT_MARK = {"PASS": "✅ PASS", "FAIL": "❌ FAIL", "n/a": "➖ n/a"}


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


def parity_section(metrics: dict[str, float]) -> list[str]:
    """The parity block (metrics spec section 9) under UniRL's names; [] without one."""
    from mismatch_probe.metrics.parity import PARITY_KEYS

    rows = [[f"`{k}`", num(k, metrics[k])] for k in PARITY_KEYS if k in metrics]
    if not rows:
        return []
    intro = (
        "Over valid tokens, both log-probs in float32, under UniRL's names (UniRL#430/#431); "
        "`probe check --exact` fails when `parity/mismatch_count` is above 0."
    )
    return ["## Parity block", "", intro, "", *table(["metric", "value"], rows, "lr"), ""]


def presets_section(ctx: RunContext) -> list[str]:
    rows = [
        [f"`{name}`", escape(correction), *(f"{v:.{MD_DIGITS}g}" for v in values)]
        for name, correction, values in preset_rows(ctx.metrics, ctx.config)
    ]
    if not rows:
        return []
    header = ["preset", "correction", "tokens masked", "sequences masked", "ESS"]
    return ["### What each correction preset would do", "", *table(header, rows, "llrrr"), ""]


def skipped_markdown(
    skipped: Sequence[tuple[str, str]], level: str = "##", ran: int | None = None
) -> list[str]:
    """A section naming each setting that did not run and why ([] when every setting ran);
    ``ran``: the settings that did, to count both where no headline above does."""
    if not skipped:
        return []
    rows = [[escape(name), escape(reason)] for name, reason in skipped]
    title = f"{level} Settings that did not run ({len(skipped)} skipped)"
    count = (
        []
        if ran is None
        else [f"**{len(skipped)} of {ran + len(skipped)} settings did not run.**", ""]
    )
    return [title, "", *count, *table(["setting", "why it was skipped"], rows, "ll"), ""]


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
            prob_text(tok.rollout_logprob, 4),
            prob_text(tok.train_logprob, 4),
            tok.cause,
        ]
        for i, tok in enumerate(worst, 1)
    ]
    header = ["#", "seq:pos", "token in context", "log ρ", "p rollout", "p train", "cause"]
    intro = "The tokens of largest |log ρ| (ρ = p_train / p_rollout), the token in bold."
    legend = escape(LEGEND)
    return ["## Worst tokens", "", intro, "", *table(header, rows, "rllrrrl"), "", legend, ""]


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


def render_markdown(
    ctx: RunContext,
    plots: dict[str, tuple[Path, str]],
    base: Path,
    top: list[str] | None = None,
) -> str:
    """The whole ``report.md`` of a run; ``plots`` maps a name to (PNG path, title), linked
    relative to ``base`` (the report's directory); the data integrity comes first, then the
    recommendation, or for a matrix run ``top`` (every setting judged, each with its
    recommendation) and then the recommendation of the setting the sections below describe."""
    from mismatch_probe.report import decisions

    title = f"# Mismatch report: {escape(ctx.run.get('model', {}).get('name', ctx.label))}"
    recommendation = decisions.recommendation_md(ctx.tables, ctx.setting)
    lead = (
        [*top, *recommendation]
        if top
        else [
            *recommendation,
            *skipped_markdown(ctx.skipped, ran=max(len(ctx.settings), 1)),
        ]
    )
    lines = [
        title,
        "",
        *integrity_markdown(ctx.integrity),
        *lead,
        *settings_section(ctx),
        *verdict_section(evaluate(ctx.metrics)),
    ]
    lines += key_metrics_section(ctx.metrics) + presets_section(ctx)
    lines += parity_section(ctx.metrics)
    lines += decisions.sweep_md(ctx.tables)
    lines += plots_section(plots, base) + worst_section(ctx.worst)
    lines += decisions.outliers_md(ctx) + decisions.entropy_md(ctx)
    lines += all_metrics_section(ctx.metrics)
    return "\n".join(lines)
