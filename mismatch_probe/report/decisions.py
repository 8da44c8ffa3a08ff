"""The decision sections of a report (spec section 7), in Markdown and for the terminal:
the recommendation, the threshold sweep, the outliers and the mismatch by entropy.

They read a ``RunContext``'s ``tables`` (``threshold_sweep``, ``outliers`` with their re-scan
``command``, ``recommendation``), its ``outliers`` (worst tokens in context) and its
``curves["entropy"]``. Model text goes through ``markdown.escape`` / ``sections.visible``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

from mismatch_probe.metrics.config import parse_preset
from mismatch_probe.metrics.decisions import FAMILIES
from mismatch_probe.metrics.presets import PRESETS
from mismatch_probe.metrics.recommend import RULE, pct
from mismatch_probe.report.md import escape, table
from mismatch_probe.report.sections import show_blank, visible
from mismatch_probe.rundir.context import OutlierToken, RunContext

FAMILY_LABELS = {
    "token_tis": "token TIS: ρ > C",
    "token_icepop": "token IcePop: ρ outside [1/C, C]",
    "seq_is": "sequence IS: q′ > C",
    "seq_mean_k3": "seq_mean_k3 RS: mean k3 > U",
}
TERMINAL_OUTLIERS = 10  # rows of the terminal's outlier table (report.md lists all 20)
NOT_AVAILABLE = (
    "not available: this store holds no train_entropy values (an ingested run's logs hold "
    "log-probabilities, not the logits an entropy needs; stores written before the column "
    "existed lack it too)."
)


def preset_marks() -> dict[tuple[str, float], list[str]]:
    """``(family, threshold) -> presets`` whose default sits on the sweep's grid."""
    marks: dict[tuple[str, float], list[str]] = {}
    for name in PRESETS:
        spec = parse_preset(name)
        points = []
        if spec.is_spec is not None and spec.is_spec.lower is None:
            family = "token_tis" if spec.is_spec.level == "token" else "seq_is"
            points.append((family, spec.is_spec.upper))
        points += [("seq_mean_k3", rs.hi) for rs in spec.rs_specs if rs.option == "seq_mean_k3"]
        for point in points:
            marks.setdefault(point, []).append(name)
    return marks


def sweep_by_family(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row["family"], []).append(row)
    return out


def recommendation_text(ctx_tables: dict[str, Any]) -> str:
    rec = ctx_tables.get("recommendation") or {}
    return str(rec.get("reason", "no recommendation (the metrics hold no presets)"))


# --- Markdown ----------------------------------------------------------------------------------


def recommendation_md(tables: dict[str, Any], setting: str | None = None) -> list[str]:
    """The one sentence at the top of a report, and the rule folded under it; ``setting``
    (a precision matrix's reference setting) says which setting it is for."""
    head = "Recommendation" if setting is None else f"Recommendation for {escape(setting)}"
    return [
        f"**{head}:** {escape(recommendation_text(tables))}",
        "",
        f"<sub>How it is chosen: {escape(RULE)}</sub>",
        "",
    ]


def _sweep_table(family_rows: dict[str, list[dict[str, Any]]], families: list[str]) -> list[str]:
    marks = preset_marks()
    thresholds = [r["threshold"] for r in family_rows[families[0]]]
    rows = []
    for family in families:
        cells = []
        for r in family_rows[family]:
            cell = f"{pct(r['token_fraction'])} · {pct(r['seq_fraction'])}"
            cells.append(f"**{cell}**" if (family, r["threshold"]) in marks else cell)
        rows.append([escape(FAMILY_LABELS[family]), *cells])
    header = ["family", *(f"{t:g}" for t in thresholds)]
    return table(header, rows, "l" + "r" * len(thresholds))


def sweep_md(tables: dict[str, Any]) -> list[str]:
    """``## Threshold sweep``: tokens · sequences masked (or truncated) at each threshold."""
    by_family = sweep_by_family(tables.get("threshold_sweep", []))
    if not by_family:
        return []
    ratio = [f for f in FAMILIES if f != "seq_mean_k3" and f in by_family]
    lines = ["## Threshold sweep", ""]
    lines += [
        "Share of tokens · share of sequences each correction would mask (TIS: truncate) at "
        "each threshold; **bold**: a preset's default.",
        "",
    ]
    if ratio:
        lines += [*_sweep_table(by_family, ratio), ""]
    if "seq_mean_k3" in by_family:
        lines += [*_sweep_table(by_family, ["seq_mean_k3"]), ""]
    return lines


def _command_md(command: str | None) -> str:
    if command is None:
        return "—"
    return f"`{command}`" if "`" not in command else escape(command)


def _context_md(o: OutlierToken) -> str:
    if not o.text and not o.before:
        return f"position {o.record['worst_position']}"
    return f"{escape(o.before)}<b>{escape(show_blank(o.text))}</b>{escape(o.after)}"


def outliers_md(ctx: RunContext, limit: int | None = None) -> list[str]:
    """``## Outliers``: the sequences carrying most of the k3, and how to re-scan each."""
    shown = ctx.outliers[:limit] if limit else ctx.outliers
    if not shown:
        return []
    share = ctx.metrics.get("outlier_share_top1pct", 0.0)
    rows = []
    for i, o in enumerate(shown, 1):
        rec = o.record
        prompt = f"{rec['prompt_id']}:{rec['sample_id']}" if rec["prompt_id"] is not None else "—"
        rows.append(
            [
                str(i),
                str(rec["seq_id"]),
                prompt,
                str(rec["tokens"]),
                f"{rec['seq_k3_sum']:.4g}",
                pct(rec["share"]),
                _context_md(o),
                f"{rec['worst_abs_log_ratio']:.4g}",
            ]
        )
    header = ["#", "seq", "prompt:sample", "tokens", "Σ k3", "share", "worst token", "\\|log ρ\\|"]
    intro = (
        f"The top 1% of sequences carry {pct(share)} of the run's k3 (Σ over tokens of "
        "ρ − 1 − log ρ); the worst token of each response is in bold."
    )
    commands = [f"{i}. {_command_md(o.record.get('command'))}" for i, o in enumerate(shown, 1)]
    return [
        "## Outliers",
        "",
        intro,
        "",
        *table(header, rows, "rrlrrrlr"),
        "",
        "Re-scan just that prompt (same seed, settings and sampling):",
        "",
        *commands,
        "",
    ]


def entropy_md(ctx: RunContext) -> list[str]:
    """``## Mismatch by entropy``: mean |log ρ| and k3 per decile of train_entropy."""
    curve = ctx.curves.get("entropy") or {}
    lines = ["## Mismatch by entropy", ""]
    if not curve.get("available"):
        return [*lines, escape(f"train_entropy: {NOT_AVAILABLE}"), ""]
    mean = ctx.metrics.get("entropy_mean", 0.0)
    lines += [
        f"Mean training-side entropy {mean:.4g} nats over {curve['tokens']:,} tokens; "
        "high-entropy tokens are where sampling decisions flip.",
        "",
    ]
    rows = [
        [
            f"{100 * b['q_lo']:.0f}–{100 * b['q_hi']:.0f}%",
            _range(b),
            str(b["count"]),
            f"{b['mean_entropy']:.4g}",
            f"{b['mean_abs_log_ratio']:.4g}",
            f"{b['mean_k3']:.4g}",
        ]
        for b in curve["bins"]
    ]
    header = ["quantile", "entropy (nats)", "tokens", "mean entropy", "mean \\|log ρ\\|", "mean k3"]
    return [*lines, *table(header, rows, "lrrrrr"), ""]


def _range(b: dict[str, Any]) -> str:
    return f"{b['lo']:.3g}–{b['hi']:.3g}" if b["hi"] is not None else f"≥ {b['lo']:.3g}"


def settings_recommendations_md(entries: Sequence[Any]) -> list[str]:
    """One row per setting of a matrix: its recommendation."""
    rows = [[escape(e.label), escape(recommendation_text(e.tables))] for e in entries]
    return ["Recommendation per setting:", "", *table(["setting", "recommendation"], rows), ""]


# --- terminal ----------------------------------------------------------------------------------


def recommendation_rich(tables: dict[str, Any], setting: str | None = None) -> Text:
    head = "Recommendation" if setting is None else f"Recommendation for {visible(setting)}"
    text = Text(f"{head}: ", style="bold")
    text.append(visible(recommendation_text(tables)))
    return text


def sweep_rich(tables: dict[str, Any]) -> list[Table]:
    by_family = sweep_by_family(tables.get("threshold_sweep", []))
    marks = preset_marks()
    out = []
    groups = {
        "C": [f for f in FAMILIES if f != "seq_mean_k3"],
        "U": ["seq_mean_k3"],
    }
    for name, families in groups.items():
        present = [f for f in families if f in by_family]
        if not present:
            continue
        title = (
            f"Threshold sweep ({name}): tokens · sequences masked (TIS: truncated); "
            "bold: a preset's default"
        )
        t = Table(title=title, title_justify="left")
        t.title_style = "bold"
        t.add_column("family")
        for r in by_family[present[0]]:
            t.add_column(f"{r['threshold']:g}", justify="right")
        for family in present:
            cells = [
                Text(
                    f"{pct(r['token_fraction'])} · {pct(r['seq_fraction'])}",
                    style="bold" if (family, r["threshold"]) in marks else "",
                )
                for r in by_family[family]
            ]
            t.add_row(FAMILY_LABELS[family], *cells)
        out.append(t)
    return out


def outliers_rich(ctx: RunContext) -> Table | None:
    if not ctx.outliers:
        return None
    share = ctx.metrics.get("outlier_share_top1pct", 0.0)
    t = Table(
        title=f"Outliers: top 1% of sequences carry {pct(share)} of the k3",
        title_justify="left",
        expand=True,
    )
    t.title_style = "bold"
    for name in ("#", "seq", "p:s", "tokens", "Σ k3", "share"):
        t.add_column(name, justify="right" if name != "p:s" else "left")
    t.add_column("worst token ⟦in context⟧", ratio=1)
    for i, o in enumerate(ctx.outliers[:TERMINAL_OUTLIERS], 1):
        rec = o.record
        context = Text(visible(o.before), style="dim")
        context.append(f"⟦{visible(show_blank(o.text))}⟧")
        context.append(visible(o.after), style="dim")
        prompt = f"{rec['prompt_id']}:{rec['sample_id']}" if rec["prompt_id"] is not None else "—"
        t.add_row(str(i), str(rec["seq_id"]), prompt, str(rec["tokens"]),
                  f"{rec['seq_k3_sum']:.3g}", pct(rec["share"]), context)  # fmt: skip
    return t
