"""Every setting of a precision-matrix run judged: the setting x verdict grid and the matrix table.

The grid has a row per setting and a column per health check (``verdicts.HEALTH_CHECKS``), each
cell the verdict and the value, and last the setting's recommendation (spec section 7: one per
setting, in the grid) when the settings have theirs; failing cells come first (settings in the
one order of ``rundir.order``: more failing checks above, then least ``k3_kl``; checks that fail
somewhere to the left), so what needs attention is in the top-left corner. The matrix table has
a row per setting in the same order: its verdict, then the key numbers, no ratios (a ratio to
a near-zero identity setting reads ``x1e+09`` and says nothing). Both work on ``(setting, flat
metrics)`` pairs, so the scan's summary, ``probe report`` and the PR comment share them.
Renderers of the three formats are here; numbers are written as each format writes them
elsewhere (``sections.fmt`` in the terminal, ``markdown.num`` in Markdown).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from mismatch_probe.metrics.verdicts import FAIL, NA, PASS, HealthCheck, Verdict, evaluate
from mismatch_probe.report.markdown import VERDICT_MARK, escape, num, skipped_markdown, table
from mismatch_probe.report.sections import fmt, visible
from mismatch_probe.rundir.order import in_setting_order

# (metric, terminal header) of the matrix table, in order (the scan summary's key numbers);
# Markdown and HTML head each column with the metric's name.
MATRIX_COLUMNS: tuple[tuple[str, str], ...] = (
    ("num_tokens", "tokens"),
    ("k3_kl", "k3_kl"),
    ("kl", "kl"),
    ("chi2_token", "chi2_token"),
    ("f_tau_2", "f_tau_2"),
    ("prob_abs_diff_max", "max |dp|"),
    ("support_flip_fraction", "flips"),
    ("rollout_tokens_per_s", "rollout tok/s"),
)
# Short terminal headers of the health checks' metrics (the grid must fit a terminal).
SHORT = {
    "rollout_is_mean": "IS mean",
    "rollout_is_eff_sample_size": "ESS",
    "rollout_is_std": "IS std",
    "prob_abs_diff_max": "max|dp|",
    "token_mult_prob_error": "mult err",
    "chi2_token": "χ²",
}
TERMINAL_STYLE = {PASS: ("✔", "green"), FAIL: ("✘", "bold red"), NA: ("·", "dim")}


@dataclass(frozen=True)
class Judged:
    """One setting and its verdicts (``verdicts.evaluate``, table order)."""

    setting: str
    metrics: dict[str, float]
    verdicts: tuple[Verdict, ...]
    recommendation: str | None = None  # its grid cell (``recommendation_cell``), if it has one

    @property
    def failing(self) -> list[str]:
        return [v.check.metric for v in self.verdicts if v.status == FAIL]

    @property
    def status(self) -> str:
        """``FAIL`` when a check fails, ``PASS`` when every computed check passes."""
        return FAIL if self.failing else PASS

    def summary(self) -> str:
        """``FAIL 2/8`` (failing checks of those computed) or ``PASS``."""
        if not self.failing:
            return PASS
        computed = sum(v.status != NA for v in self.verdicts)
        return f"{FAIL} {len(self.failing)}/{computed}"


# A recommendation's grid cell per outcome (``metrics.recommend.OUTCOMES``).
RECOMMENDATION_CELLS = {
    "investigate_first": "investigate first",
    "none_needed": "none needed",
    "preset": "{preset}",
    "no_preset_fits": "no preset fits (closest {closest})",
}


def recommendation_cell(recommendation: Mapping[str, Any] | None) -> str | None:
    """``token_is``, ``none needed``, ``no preset fits (closest seq_is)``: a setting's
    recommendation (``tables["recommendation"]``) in a grid cell; None when it has none."""
    if not recommendation or recommendation.get("outcome") not in RECOMMENDATION_CELLS:
        return None
    cell = RECOMMENDATION_CELLS[recommendation["outcome"]]
    return cell.format(**{k: recommendation.get(k) or "none" for k in ("preset", "closest")})


def judge(
    settings: Sequence[tuple[str, dict[str, float]]],
    recommendations: Mapping[str, Mapping[str, Any] | None] | None = None,
) -> list[Judged]:
    """Every setting's verdicts, in the settings' order (``rundir.order``: more failing checks
    first, then least ``k3_kl``); ``recommendations``: setting -> its recommendation, shown in
    the grid."""
    recommendations = recommendations or {}
    judged = [
        Judged(name, m, tuple(evaluate(m)), recommendation_cell(recommendations.get(name)))
        for name, m in settings
    ]
    return in_setting_order(judged, lambda j: j.setting, lambda j: j.metrics)


def recommendations_of(entries: Sequence[Any]) -> dict[str, Any]:
    """setting -> its recommendation, from entries (``rundir.Entry``: ``tables``)."""
    return {e.label: e.tables.get("recommendation") for e in entries}


def recommended(judged: Sequence[Judged]) -> bool:
    """The grid has a recommendation column: a setting has its recommendation."""
    return any(j.recommendation for j in judged)


def check_order(judged: Sequence[Judged]) -> list[int]:
    """Column order of the checks: those failing in more settings first (else table order);
    a check no setting computed (IS off) is left out."""
    if not judged:
        return []
    columns = range(len(judged[0].verdicts))
    shown = [i for i in columns if any(j.verdicts[i].status != NA for j in judged)]
    counts = {i: sum(j.verdicts[i].status == FAIL for j in judged) for i in shown}
    return sorted(shown, key=lambda i: -counts[i])


def headline(judged: Sequence[Judged], skipped: Sequence[tuple[str, str]] = ()) -> str:
    """``2 of 12 settings fail a check: rollout=bf16,kv=fp8 | train=fp32, ...`` or all pass;
    with ``skipped`` (setting, reason) the settings that did not run are counted and named."""
    bad = [j.setting for j in judged if j.failing]
    n = len(judged)
    ran = " that ran" if skipped else ""
    if not bad:
        text = f"All {n} settings{ran} pass every check."
    else:
        text = f"{len(bad)} of {n} settings{ran} fail a check: {', '.join(bad)}."
    if skipped:
        names = ", ".join(name for name, _ in skipped)
        text += f" {len(skipped)} of {n + len(skipped)} settings did not run: {names}."
    return text


def skipped_lines(skipped: Sequence[tuple[str, str]]) -> list[str]:
    """``skipped SETTING: reason`` for each setting that did not run."""
    return [f"skipped {name}: {reason}" for name, reason in skipped]


# --- terminal ----------------------------------------------------------------------------------


def _cell(v: Verdict, number: Callable[[str, float], str]) -> tuple[str, str]:
    """(text, status) of one grid cell: ``FAIL 0.0266``."""
    value = "—" if v.value is None else number(v.check.metric, v.value)
    return f"{v.status} {value}", v.status


def grid_table(judged: Sequence[Judged]) -> Table:
    """The setting x verdict grid for the terminal (rich): ``✘ 0.0266`` cells (the mark says
    the verdict without colour too), the healthy ranges in the caption."""
    order = check_order(judged)
    checks: list[HealthCheck] = [judged[0].verdicts[i].check for i in order] if judged else []
    title = f"Verdicts of every setting ({len(judged)} settings, failing first)"
    healthy = ", ".join(f"{SHORT.get(c.metric, c.metric)} {c.threshold}" for c in checks)
    grid = Table(
        title=title,
        title_justify="left",
        title_style="bold",
        caption=f"healthy when: {healthy}",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    grid.add_column("setting", min_width=12, overflow="fold")
    grid.add_column("verdict", no_wrap=True)
    for check in checks:
        name = SHORT.get(check.metric, check.metric)
        grid.add_column(name, justify="right")
    if recommended(judged):
        grid.add_column("recommendation", overflow="fold")
    for j in judged:
        mark, style = TERMINAL_STYLE[j.status]
        cells = [Text(f"{mark} {j.summary()}", style=style)]
        for i in order:
            v = j.verdicts[i]
            value = "—" if v.value is None else fmt(v.check.metric, v.value)
            mark_, style_ = TERMINAL_STYLE[v.status]
            cells.append(Text(f"{mark_} {value}", style=style_))
        if recommended(judged):
            cells.append(Text(visible(j.recommendation or "—"), style="bold"))
        grid.add_row(Text(visible(j.setting)), *cells)
    return grid


MATRIX_TITLE = "Key numbers of every setting (the grid's order)"


def matrix_table(judged: Sequence[Judged]) -> Table:
    """One row per setting, in the grid's order: verdict and key numbers, no ratios."""
    rows = list(judged)
    columns = [(k, h) for k, h in MATRIX_COLUMNS if any(k in j.metrics for j in rows)]
    out = Table(title=MATRIX_TITLE, title_justify="left")
    out.title_style = "bold"
    out.add_column("setting", min_width=12)
    out.add_column("verdict", no_wrap=True)
    for _, header in columns:
        out.add_column(header, justify="right")
    for j in rows:
        mark, style = TERMINAL_STYLE[j.status]
        cells = [_value(j.metrics, key, fmt) for key, _ in columns]
        out.add_row(Text(visible(j.setting)), Text(f"{mark} {j.summary()}", style=style), *cells)
    return out


def _value(metrics: dict[str, float], key: str, number: Callable[[str, float], str]) -> str:
    if key not in metrics:
        return "—"
    if key == "rollout_tokens_per_s":
        return f"{metrics[key]:.1f}"
    return number(key, metrics[key])


# --- Markdown ----------------------------------------------------------------------------------


def grid_markdown(judged: Sequence[Judged]) -> list[str]:
    """The grid as a GitHub table: setting, verdict, one column per check (failing first)."""
    order = check_order(judged)
    checks = [judged[0].verdicts[i].check for i in order] if judged else []
    header = ["setting", "verdict", *(f"`{c.metric}` {escape(c.threshold)}" for c in checks)]
    extra = ["recommendation"] if recommended(judged) else []
    rows = []
    for j in judged:
        cells = [f"{VERDICT_MARK[j.status]}" + j.summary().removeprefix(j.status)]
        for i in order:
            text, status = _cell(j.verdicts[i], num)
            cells.append(VERDICT_MARK[status] + text.removeprefix(status))
        if extra:
            cells.append(escape(j.recommendation or "—"))
        rows.append([escape(j.setting), *cells])
    return table([*header, *extra], rows, "ll" + "r" * len(checks) + "l" * len(extra))


def matrix_markdown(judged: Sequence[Judged]) -> list[str]:
    """The matrix table as a GitHub table (one row per setting, in the grid's order)."""
    rows_ = list(judged)
    columns = [(k, h) for k, h in MATRIX_COLUMNS if any(k in j.metrics for j in rows_)]
    header = ["setting", "verdict", *(f"`{k}`" for k, _ in columns)]
    rows = [
        [
            escape(j.setting),
            VERDICT_MARK[j.status] + j.summary().removeprefix(j.status),
            *(_value(j.metrics, k, num) for k, _ in columns),
        ]
        for j in rows_
    ]
    return table(header, rows, "ll" + "r" * len(columns))


def every_setting_markdown(
    judged: Sequence[Judged],
    reference: str,
    level: str = "##",
    of: int | None = None,
    skipped: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """The top of a matrix run's report: the headline, the grid, the settings that did not run
    (``skipped``), the matrix table, and which setting the sections below describe; ``of``: the
    settings the run holds, when only some of them are judged (``--setting``)."""
    title = "Every setting judged"
    if of is not None and of > len(judged):
        title = f"The {len(judged)} settings chosen with --setting judged (of {of} in the run)"
    return [
        f"{level} {title}",
        "",
        f"**{escape(headline(judged, skipped))}**",
        "",
        *grid_markdown(judged),
        "",
        *skipped_markdown(skipped, level),
        f"{level} {MATRIX_TITLE}",
        "",
        *matrix_markdown(judged),
        "",
        f"*The sections below describe one setting, {escape(reference)}; every setting's "
        "verdicts are above.*",
        "",
    ]
