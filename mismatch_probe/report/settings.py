"""The settings of one precision-matrix run, side by side (the compare views, inside a run).

A run whose token store holds several ``setting`` values gets a comparison: one column per
setting, least mismatch (``k3_kl``) first, with each setting's rollout throughput as measured
during the scan (``settings.json``), a recommendation line, and the overlaid plots of
``compare``. It reuses ``compare``'s ``Entry`` core; only where the entries come from differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.text import Text

from mismatch_probe import store
from mismatch_probe.report.compare import Entry, overlay_plots
from mismatch_probe.report.context import _run_metadata, decision_tables, setting_names
from mismatch_probe.report.markdown import escape, num
from mismatch_probe.report.sections import visible

K3_PLOT = "k3_by_setting.png"


def select_settings(
    run_dir: Path, wanted: tuple[str, ...] = (), order: list[str] | None = None
) -> list[str | None]:
    """The settings a report, a check or a comparison covers, in the scan's order: every
    setting of a matrix store, or only ``wanted`` (``--setting``, repeatable); ``[None]`` for a
    store of one setting (the whole store).

    Raises:
        ProbeError: a wanted setting the store does not hold (the settings it holds are named).
    """
    import difflib

    from mismatch_probe.errors import ProbeError

    names = setting_names(run_dir, order)
    missing = [w for w in wanted if w not in names]
    if missing:
        close = difflib.get_close_matches(missing[0], names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        held = "; ".join(names) or "none recorded"
        raise ProbeError(
            f"--setting {missing[0]!r}: {run_dir.name} has no such setting{hint} (it holds: {held})"
        )
    if len(names) < 2:
        return [None]
    return [n for n in names if n in wanted] if wanted else list(names)


def setting_entries(
    run_dir: Path,
    metrics_config: Any = None,
    computed: dict[str, dict[str, Any]] | None = None,
    names: list[str] | None = None,
    integrity_errors: Sequence[str] = (),
    run: dict[str, Any] | None = None,
) -> list[Entry]:
    """One ``Entry`` per setting, least ``k3_kl`` first; [] for a single-setting run.

    ``computed``: setting name -> metrics already computed with ``metrics_config`` (default
    config when None), reused instead of recomputed. ``names``: the settings (``setting_names``)
    when the caller has them. Each entry's ``tables`` hold its threshold sweep, outliers and
    recommendation (``context.decision_tables``; ``run``: the run metadata when the caller has
    it in memory, else the run's own)."""
    from mismatch_probe.metrics import MetricsConfig, compute_metrics
    from mismatch_probe.metrics.stream import flat_part

    names = setting_names(run_dir) if names is None else names
    if len(names) < 2:
        return []
    speed = _throughput(run_dir)
    run = _run_metadata(run_dir) if run is None else run
    cfg = metrics_config or MetricsConfig()
    entries = []
    for name in names:
        data = (computed or {}).get(name)
        if data is None or data["config"] != cfg.describe():
            tokens = store.resolve_tokens_path(run_dir)
            data = compute_metrics(tokens, cfg, setting=name).to_json_dict()
        flat = flat_part(data)
        if name in speed:
            flat["rollout_tokens_per_s"] = speed[name]
        tables = decision_tables(run, data, integrity_errors)
        entries.append(Entry(name, flat, data["curves"], tables))
    return sorted(entries, key=lambda e: e.metrics["k3_kl"])


def recommendation(entries: list[Entry], number: Any = None) -> str:
    """``Lowest mismatch: SETTING (k3_kl ..., N rollout tokens/s).``; ``number(key, value)``
    writes the metric as the format around it does (``sections.fmt`` by default)."""
    from mismatch_probe.report.sections import fmt

    number = number or fmt
    best = entries[0]
    speed = best.metrics.get("rollout_tokens_per_s")
    cost = f", {speed:.1f} rollout tokens/s" if speed else ""
    return f"Lowest mismatch: {best.label} (k3_kl {number('k3_kl', best.metrics['k3_kl'])}{cost})."


def judged(entries: list[Entry]) -> list[Any]:
    """Every setting's verdicts (``grid.judge``), failing first."""
    from mismatch_probe.report.grid import judge

    return judge([(e.label, e.metrics) for e in entries])


def render_settings(entries: list[Entry], console: Console) -> None:
    """The setting x verdict grid, the matrix table, the lowest-mismatch setting and each
    setting's recommended correction."""
    from mismatch_probe.report.decisions import recommendation_text
    from mismatch_probe.report.grid import grid_table, headline, matrix_table

    rows = judged(entries)
    style = "bold red" if any(j.failing for j in rows) else "bold green"
    console.print(
        Group(
            Text(visible(headline(rows)), style=style),
            grid_table(rows),
            matrix_table(rows),
            Text(visible(recommendation(entries)), style="bold"),
            *(Text(visible(f"  {e.label}: {recommendation_text(e.tables)}")) for e in entries),
        )
    )


def settings_top_markdown(entries: list[Entry], reference: str, of: int | None = None) -> list[str]:
    """The top of a matrix run's report.md: every setting judged (``grid``); ``of``: the
    settings the run holds, when ``entries`` are only some of them."""
    from mismatch_probe.report.grid import every_setting_markdown

    return every_setting_markdown(judged(entries), reference, of=of)


def settings_markdown(entries: list[Entry], run_dir: Path) -> str:
    """A ``## Precision settings`` section: the recommendations, the overlaid plots and k3 per
    setting (the settings' table is at the top of the report)."""
    from mismatch_probe.report.decisions import settings_recommendations_md
    from mismatch_probe.report.plots import write_k3_by_setting

    plots = overlay_plots(entries, run_dir / store.PLOTS_DIR / "settings", what="settings")
    lines = [
        f"## Precision settings overlaid ({len(entries)} settings)",
        "",
        f"**{escape(recommendation(entries, num))}**",
        "",
    ]
    lines += settings_recommendations_md(entries)
    k3_plot = write_k3_by_setting(entries, run_dir / store.PLOTS_DIR / "settings" / K3_PLOT)
    for path, title in [*plots.values(), k3_plot]:
        lines += [f"![{escape(title)}]({path.relative_to(run_dir).as_posix()})", ""]
    return "\n".join(lines)


def _throughput(run_dir: Path) -> dict[str, float]:
    """Each setting's rollout tokens/s from ``settings.json``; a missing, corrupt or
    non-finite value is left out (never copied into a report)."""
    data = _read(run_dir / store.SETTINGS_FILE)
    settings = data.get("settings") if isinstance(data, dict) else None
    if not isinstance(settings, dict):
        return {}
    speeds = {
        name: m.get("rollout_tokens_per_s") for name, m in settings.items() if isinstance(m, dict)
    }
    return {
        name: float(v)
        for name, v in speeds.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _read(path: Path) -> Any:
    """A JSON file of the run (strict: no NaN or infinity), None when missing or corrupt."""
    try:
        return store.read_json(path)
    except (OSError, ValueError):
        return None
