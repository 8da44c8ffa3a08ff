"""The settings of one precision-matrix run, side by side (the compare views, inside a run).

A run whose token store holds several ``setting`` values gets a comparison: one column per
setting in the settings' order (``rundir.order``: failing first, then least ``k3_kl``), with
each setting's rollout throughput as measured during the scan (``settings.json``), a
recommendation line, and the overlaid plots of ``compare``. The entries are ``rundir.Entry``
records (``rundir.setting_entries`` loads them); this module renders them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.text import Text

from mismatch_probe import store
from mismatch_probe.report.compare import overlay_plots
from mismatch_probe.report.markdown import escape, num
from mismatch_probe.report.sections import visible
from mismatch_probe.rundir.context import Entry

K3_PLOT = "k3_by_setting.png"


def recommendation(entries: list[Entry], number: Any = None) -> str:
    """``Lowest mismatch: SETTING (k3_kl ..., N rollout tokens/s).``; ``number(key, value)``
    writes the metric as the format around it does (``sections.fmt`` by default)."""
    from mismatch_probe.report.sections import fmt

    number = number or fmt
    best = min(entries, key=lambda e: e.metrics["k3_kl"])
    speed = best.metrics.get("rollout_tokens_per_s")
    cost = f", {speed:.1f} rollout tokens/s" if speed else ""
    return f"Lowest mismatch: {best.label} (k3_kl {number('k3_kl', best.metrics['k3_kl'])}{cost})."


def judged(entries: list[Entry]) -> list[Any]:
    """Every setting's verdicts and recommendation (``grid.judge``), in the settings' order."""
    from mismatch_probe.report.grid import judge, recommendations_of

    return judge([(e.label, e.metrics) for e in entries], recommendations_of(entries))


def render_settings(
    entries: list[Entry], console: Console, skipped: Sequence[tuple[str, str]] = ()
) -> None:
    """The setting x verdict grid, the settings that did not run (``skipped``), the matrix
    table, the lowest-mismatch setting and each setting's recommended correction."""
    from mismatch_probe.report.decisions import recommendation_text
    from mismatch_probe.report.grid import grid_table, headline, matrix_table, skipped_lines

    rows = judged(entries)
    style = "bold red" if any(j.failing for j in rows) else "bold green"
    console.print(
        Group(
            Text(visible(headline(rows, skipped)), style=style),
            grid_table(rows),
            *(Text(visible(line), style="yellow") for line in skipped_lines(skipped)),
            matrix_table(rows),
            Text(visible(recommendation(entries)), style="bold"),
            *(Text(visible(f"  {e.label}: {recommendation_text(e.tables)}")) for e in entries),
        )
    )


def settings_top_markdown(
    entries: list[Entry],
    reference: str,
    of: int | None = None,
    skipped: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """The top of a matrix run's report.md: every setting judged (``grid``) and those that did
    not run; ``of``: the settings the run holds, when ``entries`` are only some of them."""
    from mismatch_probe.report.grid import every_setting_markdown

    return every_setting_markdown(judged(entries), reference, of=of, skipped=skipped)


def settings_markdown(entries: list[Entry], out_dir: Path) -> str:
    """A ``## Precision settings`` section: the recommendations, the overlaid plots and k3 per
    setting (the settings' table is at the top of the report)."""
    from mismatch_probe.report.decisions import settings_recommendations_md
    from mismatch_probe.report.plots import write_k3_by_setting

    plots = overlay_plots(entries, out_dir / store.PLOTS_DIR / "settings", what="settings")
    lines = [
        f"## Precision settings overlaid ({len(entries)} settings)",
        "",
        f"**{escape(recommendation(entries, num))}**",
        "",
    ]
    lines += settings_recommendations_md(entries)
    k3_plot = write_k3_by_setting(entries, out_dir / store.PLOTS_DIR / "settings" / K3_PLOT)
    for path, title in [*plots.values(), k3_plot]:
        lines += [f"![{escape(title)}]({path.relative_to(out_dir).as_posix()})", ""]
    return "\n".join(lines)
