"""The pull-request comment (``--format pr-comment``): GitHub-flavoured Markdown that stands alone.

No image (plots live in ``report.html``): the verdicts, the key metrics (with the change against
the baseline and an arrow saying better or worse when there is one), a text histogram of the
log-ratio, the worst tokens, and the rest (settings, presets, every metric) inside ``<details>``.
Tables and escaping are ``markdown``'s, so model text is as inert here as in ``report.md``; each
piece of model text is also clipped to ``CLIP`` characters, and a part that would take the
comment past ``COMMENT_LIMIT`` characters is left out with a note (GitHub refuses comments over
65,536 characters).

A comparison's comment describes its last run (HEAD) against its first (the baseline), with a
column for every run in between; each change is judged against the noise the comparison holds
(``gate.compare.with_intervals``: ``probe compare --format pr-comment`` loads it so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from mismatch_probe.gate.compare import CHANGE_LEVEL, Comparison
from mismatch_probe.metrics.verdicts import FAIL, NA, PASS, evaluate
from mismatch_probe.report import layers, turns
from mismatch_probe.report.integrity import integrity_markdown, runs_markdown
from mismatch_probe.report.markdown import (
    VERDICT_MARK,
    all_metrics_section,
    escape,
    key_metrics_section,
    num,
    parity_section,
    presets_section,
    settings_section,
    table,
    verdict_section,
    worst_section,
)
from mismatch_probe.report.sections import KEY_METRICS, SIGNED
from mismatch_probe.report.terminal import HIST_WIDTH, _bar, _hist_rows
from mismatch_probe.rundir.context import Entry, RunContext, WorstToken

COMMENT_LIMIT = 60_000
COMMENT_OUTLIERS = 5  # outliers listed in a comment (report.md has all of them)
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
    "clip_fraction_0.2": "lower",
    "clip_fraction_0.28": "lower",
    "outlier_share_top1pct": "lower",
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


LEVEL = CHANGE_LEVEL  # confidence level of the intervals of a change (gate.compare)


def _percent(value: float) -> str:
    """``+35.2%``, ``+100%``, ``+1234%``: three significant digits, never ``+1e+02%``."""
    return f"{value:+.3g}%" if abs(value) < 100 else f"{value:+.0f}%"


def change_cell(
    key: str, base: float | None, value: float | None, ci: tuple[float, float] | None = None
) -> str:
    """``↑ +35.2% 🔴 worse, 95% CI of the change [+1e-05, +3e-05]``: direction, relative change
    (a difference for a signed metric or a base of 0), and, judged against the noise, whether
    that is better or worse. ``ci`` is the bootstrap interval of ``value - base``: a change
    whose interval holds 0 is ``within noise`` (no colour); without an interval the change is
    not judged. ``= no change`` when the table shows the same number."""
    if base is None or value is None:
        return "—"
    if num(key, value) == num(key, base):  # equal as far as the table shows them
        return "= no change"
    delta = value - base
    relative = bool(base) and key not in SIGNED
    amount = _percent(100 * delta / abs(base)) if relative else f"{delta:+.3g}"
    arrow = "↑" if delta > 0 else "↓"
    direction = worse(key, base, value)
    if direction is None:
        return f"{arrow} {amount}"
    if ci is None:
        return f"{arrow} {amount} (no noise estimate)"
    interval = f"{LEVEL:.0%} CI of the change [{ci[0]:+.3g}, {ci[1]:+.3g}]"
    if ci[0] <= 0.0 <= ci[1]:
        return f"{arrow} {amount} within noise, {interval}"
    verdict = "🔴 worse" if direction else "🟢 better"
    return f"{arrow} {amount} {verdict}, {interval}"


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
    source = ctx.run.get("model", {}).get("source")
    weights = f" · weights: {escape(str(source))}" if source else ""
    facts = f"{escape(ctx.label)}{weights} · {m.get('num_tokens', 0):,.0f} response tokens"
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


def _integrity_lines(ctx: RunContext) -> list[str]:
    """The data-integrity section (first after the title), when the findings are loaded."""
    lines = integrity_markdown(ctx.integrity)
    return titled("Data integrity", lines) if lines and lines[0].startswith("#") else lines


def run_comment(ctx: RunContext, entries: Sequence[Entry] | None = None) -> str:
    """The comment of one run (``probe report RUN --format pr-comment``): data integrity and
    the recommendation first; a matrix run's (``entries``: its settings) then has every setting
    judged and each setting's recommendation."""
    from mismatch_probe.report import decisions

    model = escape(ctx.run.get("model", {}).get("name", ctx.label))
    verdicts = evaluate(ctx.metrics)
    counts = verdict_counts([v.status for v in verdicts])
    top: list[tuple[str, list[str]]] = []
    if entries and len(entries) > 1:
        from mismatch_probe.report.grid import every_setting_markdown, judge, recommendations_of

        judged = judge([(e.label, e.metrics) for e in entries], recommendations_of(entries))
        held = len(ctx.settings)  # more than judged: a --setting choice
        grid = every_setting_markdown(judged, ctx.label, "####", of=held, skipped=ctx.skipped)
        top = [("Every setting", grid)]
        counts = counts.replace("**Verdicts:**", f"**Verdicts of {escape(ctx.label)}:**")
    elif ctx.skipped:
        from mismatch_probe.report.grid import headline, judge
        from mismatch_probe.report.markdown import skipped_markdown

        line = headline(judge([(ctx.label, ctx.metrics)]), ctx.skipped)
        top = [("Skipped", [f"**{escape(line)}**", "", *skipped_markdown(ctx.skipped, "####")])]
    head = [*_header(ctx, f"Mismatch report: {model}"), *_integrity_lines(ctx), counts, ""]
    recommendation = decisions.recommendation_md(ctx.tables, ctx.setting)
    if entries and len(entries) > 1:  # every setting judged first, each with its own
        top = [(title, [*lines, *recommendation]) for title, lines in top]
    else:
        head += recommendation
    head += layers.comment_lines(ctx.layer_curve(), ctx.layers)  # --layers
    parts = [
        ("Header", head),
        *top,
        ("Verdicts", titled("Verdicts", verdict_section(verdicts))),
        ("Key metrics", titled("Key metrics", key_metrics_section(ctx.metrics))),
        *[("Parity block", titled("Parity block", p)) for p in [parity_section(ctx.metrics)] if p],
        *[("Per turn", lines) for lines in [turns.section_lines(ctx, "####")] if lines],
        *_tail(ctx),
    ]
    sweep = decisions.sweep_md(ctx.tables)
    if sweep:  # after the key metrics
        at = [name for name, _ in parts].index("Key metrics") + 1
        parts.insert(at, ("Threshold sweep", titled("Threshold sweep", sweep)))
    if entries and len(entries) > 1:  # right after every setting judged
        per_setting = [
            "#### Recommendation per setting",
            "",
            *decisions.settings_recommendations_md(list(entries))[2:],
        ]
        parts.insert(1 + len(top), ("Recommendation per setting", per_setting))
    clipped = tuple(clip_token(o) for o in ctx.outliers)  # type: ignore[arg-type]
    clipped_ctx = dataclasses.replace(ctx, outliers=clipped)  # type: ignore[arg-type]
    outliers = decisions.outliers_md(clipped_ctx, COMMENT_OUTLIERS)
    if outliers:
        parts.append(("Outliers", details("Outliers (the top 5)", outliers)))
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
    keys: Sequence[str],
    runs: Sequence[RunContext],
    labels: list[str],
    intervals: dict[tuple[int, str], tuple[float, float]] | None = None,
) -> list[str]:
    """metric | baseline | (value, change) per later run, for ``keys`` some run has; a change
    is judged against its interval (``gate.compare.change_intervals``) when there is one."""
    header = ["metric", *_run_header_cells(labels[:1])]
    for label in labels[1:]:
        header += [escape(label), f"change vs {escape(labels[0])}"]
    rows = []
    for key in keys:
        values = [r.metrics.get(key) for r in runs]
        if all(v is None for v in values):
            continue
        cells = ["—" if values[0] is None else num(key, values[0])]
        for i, value in enumerate(values[1:], 1):
            ci = (intervals or {}).get((i, key))
            cells += [
                "—" if value is None else num(key, value),
                change_cell(key, values[0], value, ci),
            ]
        rows.append([f"`{key}`", *cells])
    return table(header, rows, "l" + "r" * (len(header) - 1))


NOISE_NOTE = (
    f"<sub>A change is judged against its noise: {LEVEL:.0%} bootstrap interval of the "
    "difference over responses (paired when the runs hold the same responses); within noise "
    "when it holds 0. `kl` and `log_ppl_diff` change as a difference, not a percentage.</sub>"
)


def comparison_comment(comparison: Comparison) -> str:
    """The comment of ``probe compare BASE HEAD --format pr-comment``: HEAD (the last run)
    against the baseline (the first), setting by setting for precision-matrix runs."""
    pairs = comparison.all_pairs
    runs = list(pairs[0].runs)
    labels = [e.label for e in pairs[0].entries]
    head_ctx = runs[-1]
    model = escape(head_ctx.run.get("model", {}).get("name", head_ctx.label))
    title = f"Mismatch: {escape(labels[-1])} vs {escape(labels[0])} ({model})"
    head = _header(head_ctx, title)
    integrity = runs_markdown([(lab, r.integrity) for lab, r in zip(labels, runs, strict=True)])
    head += (
        titled("Data integrity", integrity) if integrity[:1] == ["## Data integrity"] else integrity
    )
    head += [f"> ⚠️ **The runs differ:** {escape(w)}" for w in comparison.warnings]
    head += [""] if comparison.warnings else []
    keys = [k for k, _ in KEY_METRICS]
    head += _every_head_setting(comparison, labels[-1])
    if len(pairs) == 1:
        head += [verdict_counts([v.status for v in evaluate(head_ctx.metrics)]), ""]
        intervals = pairs[0].intervals
        every = sorted({k for r in runs for k in r.metrics})
        parts = [
            ("Header", head),
            *_head_only_parts(comparison, labels[-1]),
            ("Verdicts", ["#### Verdicts", "", *comparison_verdicts(runs, labels), ""]),
            (
                "Key metrics",
                ["#### Key metrics", "", *comparison_metrics(keys, runs, labels, intervals), ""],
            ),
            ("Noise", [NOISE_NOTE, ""]),
            *_tail(head_ctx),
            (
                "Every metric",
                details(f"Every metric ({len(every)})", comparison_metrics(every, runs, labels)),
            ),
        ]
        return fit(parts)
    return fit([("Header", head), *_matrix_parts(comparison, keys), *_tail(head_ctx)])


def _head_judged(comparison: Comparison) -> list[Any]:
    """Every setting of HEAD (the last run) judged: the paired ones and those only it holds."""
    from mismatch_probe.report.grid import judge

    paired = [
        (str(p.setting or p.entries[-1].label), p.runs[-1].metrics) for p in comparison.all_pairs
    ]
    return judge([*paired, *comparison.head_only])


def _every_head_setting(comparison: Comparison, head_label: str) -> list[str]:
    """The opening line over every setting of HEAD, where it holds settings the baseline does
    not (else the verdicts below already cover them all)."""
    from mismatch_probe.report.grid import headline

    if not comparison.head_only:
        return []
    line = headline(_head_judged(comparison))
    return [f"**Every setting of {escape(head_label)}:** {escape(line)}", ""]


def _head_only_parts(comparison: Comparison, head_label: str) -> list[tuple[str, list[str]]]:
    """HEAD's settings without a baseline, judged (the grid), so none hides."""
    from mismatch_probe.report.grid import grid_markdown, judge

    if not comparison.head_only:
        return []
    judged = judge(list(comparison.head_only))
    title = (
        f"#### Settings only {escape(head_label)} holds ({len(judged)}, not compared: "
        "no baseline), judged"
    )
    return [("Only in HEAD", [title, "", *grid_markdown(judged), ""])]


def _matrix_parts(comparison: Comparison, keys: list[str]) -> list[tuple[str, list[str]]]:
    """Every setting's HEAD verdicts (the grid), then each paired setting's key metrics with
    their changes, and the settings only some runs hold."""
    from mismatch_probe.report.grid import every_setting_markdown, judge

    pairs = comparison.all_pairs
    judged = judge([(str(p.setting), p.runs[-1].metrics) for p in pairs])
    top = every_setting_markdown(judged, str(pairs[0].setting), "####")[:-2]
    head_label = escape(pairs[0].entries[-1].label)
    top[0] = f"#### Every setting of {head_label} judged ({len(pairs)} paired by name)"
    parts = [
        ("Every setting", [*top, ""]),
        *_head_only_parts(comparison, pairs[0].entries[-1].label),
    ]
    for pair in pairs:
        runs, labels = list(pair.runs), [e.label for e in pair.entries]
        metrics = comparison_metrics(keys, runs, labels, pair.intervals)
        parts.append(
            (
                f"Key metrics of {pair.setting}",
                [f"#### Key metrics of {escape(pair.title)}", "", *metrics, ""],
            )
        )
    if comparison.unpaired:
        lines = [f"- {escape(line)}" for line in comparison.unpaired_lines()]
        parts.append(("Unpaired", ["#### Settings only some runs hold", "", *lines, ""]))
    parts.append(("Noise", [NOISE_NOTE, ""]))
    return parts
