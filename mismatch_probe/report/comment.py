"""The pull-request comment (``--format pr-comment``): GitHub-flavoured Markdown that stands alone.

No image (plots live in ``report.html``): the verdicts, the key metrics (with the change against
the baseline and an arrow saying better or worse when there is one), a text histogram of the
log-ratio, the worst tokens, and the rest (settings, presets, every metric) inside ``<details>``.
Tables and escaping are ``markdown``'s, so model text is as inert here as in ``report.md``; each
piece of model text is also clipped to ``CLIP`` characters, and a part that would take the
comment past ``COMMENT_LIMIT`` characters is left out with a note (GitHub refuses comments over
65,536 characters).

A comparison's comment describes its last run (HEAD) against its first (the baseline), with a
column for every run in between.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mismatch_probe.report import turns
from mismatch_probe.report.compare import Comparison
from mismatch_probe.report.context import RunContext, WorstToken
from mismatch_probe.report.markdown import (
    VERDICT_MARK,
    all_metrics_section,
    escape,
    key_metrics_section,
    num,
    presets_section,
    settings_section,
    table,
    verdict_section,
    worst_section,
)
from mismatch_probe.report.sections import KEY_METRICS
from mismatch_probe.report.terminal import HIST_WIDTH, _bar, _hist_rows
from mismatch_probe.report.verdicts import FAIL, NA, PASS, evaluate

COMMENT_LIMIT = 60_000
CLIP = 48  # characters of model text kept per piece (token, context before, context after)
FORMATS = ("terminal", "pr-comment")
# Which way a key metric is better, for the arrows; a metric not listed is neutral (a count).
BETTER: dict[str, str] = {
    "k3_kl": "lower",
    "kl": "closer to 0",
    "chi2_token": "lower",
    "chi2_seq": "lower",
    "log_ratio_abs_mean": "lower",
    "log_ratio_abs_max": "lower",
    "prob_abs_diff_mean": "lower",
    "prob_abs_diff_max": "lower",
    "prob_pearson": "higher",
    "f_tau_1.1": "lower",
    "f_tau_2": "lower",
    "rollout_is_eff_sample_size": "higher",
    "seq_log_ratio_slope_per_1k": "closer to 0",
    "support_flip_fraction": "lower",
}
FOOTER = "<sub>Plots and the full report: `report.html` in the run directory.</sub>"


def check_format(fmt: str) -> str:
    """``fmt`` if it is one of ``FORMATS``, else a ``ProbeError`` (exit 2)."""
    from mismatch_probe.errors import ProbeError

    if fmt not in FORMATS:
        raise ProbeError(f"--format: one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


# --- pieces ------------------------------------------------------------------------------------


def worse(key: str, base: float, value: float) -> bool | None:
    """True when ``value`` is worse than ``base`` for ``key``, False when better, None when the
    metric has no better direction or did not change."""
    way = BETTER.get(key)
    if way is None or value == base:
        return None
    if way == "lower":
        return value > base
    if way == "higher":
        return value < base
    return abs(value) > abs(base)


def change_cell(key: str, base: float | None, value: float | None) -> str:
    """``↑ +35.2% 🔴 worse``: direction, relative change (absolute when the base is 0), and
    whether that is better or worse; ``= no change`` when the table shows the same number."""
    if base is None or value is None:
        return "—"
    if num(key, value) == num(key, base):  # equal as far as the table shows them
        return "= no change"
    delta = value - base
    amount = f"{100 * delta / abs(base):+.3g}%" if base else f"{delta:+.3g}"
    arrow = "↑" if delta > 0 else "↓"
    verdict = {True: " 🔴 worse", False: " 🟢 better", None: ""}[worse(key, base, value)]
    return f"{arrow} {amount}{verdict}"


def clip_token(tok: WorstToken, width: int = CLIP) -> WorstToken:
    """The token with its text and context clipped to ``width`` characters each."""

    def clip(text: str, keep_end: bool = False) -> str:
        if len(text) <= width:
            return text
        return "…" + text[-(width - 1) :] if keep_end else text[: width - 1] + "…"

    return dataclasses.replace(
        tok, text=clip(tok.text), before=clip(tok.before, keep_end=True), after=clip(tok.after)
    )


def histogram_block(hist: dict) -> list[str]:
    """The log-ratio histogram as a fenced text block (bar length ∝ log(1 + tokens))."""
    rows = _hist_rows(hist)
    top = max((c for _, c in rows), default=1)
    body = [f"{label:>17} │{_bar(count, top):<{HIST_WIDTH}}│ {count:,}" for label, count in rows]
    title = "r = log p_train − log p_rollout   (bar ∝ log(1 + tokens))"
    return ["```text", title, *body, "```", ""]


def titled(title: str, lines: list[str]) -> list[str]:
    """A ``markdown`` section (``## Heading``, blank, body) under a ``####`` heading instead."""
    body = lines[2:] if lines and lines[0].startswith("#") else lines
    return [f"#### {title}", "", *body]


def details(summary: str, lines: list[str]) -> list[str]:
    """``lines`` folded away under ``summary`` (blank lines keep the Markdown inside working)."""
    body = lines[2:] if lines and lines[0].startswith("#") else lines
    return ["<details>", f"<summary>{summary}</summary>", "", *body, "", "</details>", ""]


def verdict_counts(statuses: Sequence[str]) -> str:
    counts = {s: sum(x == s for x in statuses) for s in (FAIL, PASS, NA)}
    words = {FAIL: "failing", PASS: "passing", NA: "not computed"}
    parts = [f"{VERDICT_MARK[s].split()[0]} {n} {words[s]}" for s, n in counts.items() if n]
    return "**Verdicts:** " + ", ".join(parts)


def fit(parts: list[tuple[str, list[str]]], limit: int = COMMENT_LIMIT) -> str:
    """Join the parts in order, leaving out (with a note) any that would pass ``limit``."""
    out: list[str] = []
    size = len(FOOTER) + 1
    for name, lines in parts:
        text = "\n".join(lines) + "\n"
        if size + len(text) > limit:
            text = f"*{name}: left out, the comment would pass {limit:,} characters.*\n\n"
        out.append(text)
        size += len(text)
    return "".join(out) + FOOTER + "\n"


# --- one run -----------------------------------------------------------------------------------


def _header(ctx: RunContext, title: str) -> list[str]:
    m = ctx.metrics
    facts = f"{escape(ctx.label)} · {m.get('num_tokens', 0):,.0f} response tokens"
    return [f"### {title}", "", facts + f" · {m.get('num_sequences', 0):,.0f} responses", ""]


def _tail(ctx: RunContext) -> list[tuple[str, list[str]]]:
    """Histogram, worst tokens and the folded parts of the run ``ctx`` (HEAD)."""
    worst = tuple(clip_token(t) for t in ctx.worst)
    hist = histogram_block(ctx.curves["log_ratio_hist"])
    parts = [("Histogram", titled("Log-ratio histogram", hist))]
    if worst:
        parts.append(("Worst tokens", titled("Worst tokens", worst_section(worst))))
    parts.append(("Settings", details("Settings", settings_section(ctx))))
    presets = presets_section(ctx)
    if presets:
        parts.append(("Presets", details("What each correction preset would do", presets)))
    return parts


def run_comment(ctx: RunContext) -> str:
    """The comment of one run (``probe report RUN --format pr-comment``)."""
    model = escape(ctx.run.get("model", {}).get("name", ctx.label))
    verdicts = evaluate(ctx.metrics)
    head = _header(ctx, f"Mismatch report: {model}")
    head += [verdict_counts([v.status for v in verdicts]), ""]
    parts = [
        ("Header", head),
        ("Verdicts", titled("Verdicts", verdict_section(verdicts))),
        ("Key metrics", titled("Key metrics", key_metrics_section(ctx.metrics))),
        *[("Per turn", lines) for lines in [turns.section_lines(ctx, "####")] if lines],
        *_tail(ctx),
    ]
    every = all_metrics_section(ctx.metrics)
    parts.append(("Every metric", every))
    return fit(parts)


# --- several runs ------------------------------------------------------------------------------


def _run_header_cells(labels: list[str]) -> list[str]:
    return [f"{escape(label)}{' (baseline)' if i == 0 else ''}" for i, label in enumerate(labels)]


def comparison_verdicts(runs: Sequence[RunContext], labels: list[str]) -> list[str]:
    """check | healthy when | one ``✅ value`` cell per run."""
    per_run = [evaluate(r.metrics) for r in runs]
    rows = []
    for i, v in enumerate(per_run[0]):
        cells = []
        for verdicts in per_run:
            w = verdicts[i]
            value = "not computed" if w.value is None else num(w.check.metric, w.value)
            cells.append(f"{VERDICT_MARK[w.status].split()[0]} {value}")
        rows.append(
            [escape(v.check.label), f"`{v.check.metric}`", escape(v.check.threshold), *cells]
        )
    header = ["check", "metric", "healthy when", *_run_header_cells(labels)]
    return table(header, rows, "lll" + "r" * len(runs))


def comparison_metrics(
    keys: Sequence[str], runs: Sequence[RunContext], labels: list[str]
) -> list[str]:
    """metric | baseline | (value, change) per later run, for ``keys`` some run has."""
    header = ["metric", *_run_header_cells(labels[:1])]
    for label in labels[1:]:
        header += [escape(label), f"change vs {escape(labels[0])}"]
    rows = []
    for key in keys:
        values = [r.metrics.get(key) for r in runs]
        if all(v is None for v in values):
            continue
        cells = ["—" if values[0] is None else num(key, values[0])]
        for value in values[1:]:
            cells += ["—" if value is None else num(key, value), change_cell(key, values[0], value)]
        rows.append([f"`{key}`", *cells])
    return table(header, rows, "l" + "r" * (len(header) - 1))


def comparison_comment(comparison: Comparison) -> str:
    """The comment of ``probe compare BASE HEAD --format pr-comment``: HEAD (the last run)
    against the baseline (the first)."""
    runs = list(comparison.runs)
    labels = [e.label for e in comparison.entries]
    head_ctx = runs[-1]
    model = escape(head_ctx.run.get("model", {}).get("name", head_ctx.label))
    title = f"Mismatch: {escape(labels[-1])} vs {escape(labels[0])} ({model})"
    head = _header(head_ctx, title)
    head += [f"> ⚠️ **The runs differ:** {escape(w)}" for w in comparison.warnings]
    head += [""] if comparison.warnings else []
    head += [verdict_counts([v.status for v in evaluate(head_ctx.metrics)]), ""]
    keys = [k for k, _ in KEY_METRICS]
    every = sorted({k for r in runs for k in r.metrics})
    parts = [
        ("Header", head),
        ("Verdicts", ["#### Verdicts", "", *comparison_verdicts(runs, labels), ""]),
        ("Key metrics", ["#### Key metrics", "", *comparison_metrics(keys, runs, labels), ""]),
        *_tail(head_ctx),
        (
            "Every metric",
            details(f"Every metric ({len(every)})", comparison_metrics(every, runs, labels)),
        ),
    ]
    return fit(parts)
