"""The settings of one precision-matrix run, side by side (the compare views, inside a run).

A run whose token store holds several ``setting`` values gets a comparison: one column per
setting, least mismatch (``k3_kl``) first, with each setting's rollout throughput as measured
during the scan (``settings.json``), a recommendation line, and the overlaid plots of
``compare``. It reuses ``compare``'s ``Entry`` core; only where the entries come from differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from rich.console import Console, Group
from rich.text import Text

from mismatch_probe import store
from mismatch_probe.report.compare import Entry, compare_rows, comparison_table, overlay_plots
from mismatch_probe.report.compare import row_cells as compare_row_cells
from mismatch_probe.report.context import NOT_FLAT
from mismatch_probe.report.markdown import escape, table
from mismatch_probe.report.sections import visible


def setting_names(run_dir: Path) -> list[str]:
    """The settings in the token store, in the scan's order (first = the reference)."""
    tokens = store.resolve_tokens_path(run_dir)
    if "setting" not in store.open_parquet(tokens).schema_arrow.names:
        return []
    present = pq.read_table(tokens, columns=["setting"]).column("setting").unique().to_pylist()
    if len(present) < 2:
        return present
    order = _run_json(run_dir).get("settings") or sorted(present)
    return [s for s in order if s in present] + [s for s in present if s not in order]


def setting_entries(
    run_dir: Path, metrics_config: Any = None, computed: dict[str, dict[str, Any]] | None = None
) -> list[Entry]:
    """One ``Entry`` per setting, least ``k3_kl`` first; [] for a single-setting run.

    ``computed``: setting name -> metrics already computed with ``metrics_config`` (default
    config when None), reused instead of recomputed."""
    from mismatch_probe.metrics import MetricsConfig, compute_metrics

    names = setting_names(run_dir)
    if len(names) < 2:
        return []
    speed = _throughput(run_dir)
    cfg = metrics_config or MetricsConfig()
    entries = []
    for name in names:
        data = (computed or {}).get(name)
        if data is None or data["config"] != cfg.describe():
            tokens = store.resolve_tokens_path(run_dir)
            data = compute_metrics(tokens, cfg, setting=name).to_json_dict()
        flat = {k: float(v) for k, v in data.items() if k not in NOT_FLAT}
        if name in speed:
            flat["rollout_tokens_per_s"] = speed[name]
        entries.append(Entry(name, flat, data["curves"]))
    return sorted(entries, key=lambda e: e.metrics["k3_kl"])


def recommendation(entries: list[Entry]) -> str:
    best = entries[0]
    speed = best.metrics.get("rollout_tokens_per_s")
    cost = f", {speed:.1f} rollout tokens/s" if speed else ""
    return f"Lowest mismatch: {best.label} (k3_kl {best.metrics['k3_kl']:.3g}{cost})."


def render_settings(entries: list[Entry], console: Console) -> None:
    """The settings table (ratio to the least-mismatch setting) and the recommendation."""
    table_ = comparison_table(entries, compare_rows(entries))
    table_.title = "Settings, least mismatch first (×: ratio to the first)"
    console.print(Group(table_, Text(visible(recommendation(entries)), style="bold")))


def settings_markdown(entries: list[Entry], run_dir: Path) -> str:
    """A ``## Precision settings`` section with the table, the recommendation and overlaid plots."""
    plots = overlay_plots(entries, run_dir / store.PLOTS_DIR / "settings")
    header = ["metric"]
    for i, e in enumerate(entries):
        header += [escape(e.label)] + ([f"× {escape(entries[0].label)}"] if i else [])
    rows = [[f"`{row.key}`", *compare_row_cells(row)] for row in compare_rows(entries)]
    speeds = [e.metrics.get("rollout_tokens_per_s") for e in entries]
    if all(s is not None for s in speeds):
        rows.append(["rollout tokens/s", *_speed_cells(speeds)])
    lines = [
        "## Precision settings side by side (least mismatch first)",
        "",
        f"**{escape(recommendation(entries))}**",
    ]
    lines += ["", *table(header, rows, "l" + "r" * (len(header) - 1)), ""]
    for path, title in plots.values():
        lines += [f"![{escape(title)}]({path.relative_to(run_dir).as_posix()})", ""]
    return "\n".join(lines)


def _speed_cells(speeds: list[Any]) -> list[str]:
    cells = [f"{speeds[0]:.1f}"]
    for s in speeds[1:]:
        cells += [f"{s:.1f}", f"×{s / speeds[0]:.3g}" if speeds[0] else "—"]
    return cells


def _run_json(run_dir: Path) -> dict[str, Any]:
    """``run.json`` ({} when missing or unreadable: it only orders the settings here)."""
    data = _read(run_dir / store.RUN_FILE)
    return data if isinstance(data, dict) else {}


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
