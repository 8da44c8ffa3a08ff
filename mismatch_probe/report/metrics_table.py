"""Rich tables of a ``MetricsResult`` (what ``probe metrics`` prints without ``--json``).

One two-column table per group of flat keys (``SECTIONS``, first matching prefix wins), then one
table with a row per preset. Knows nothing about how the numbers were computed.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from mismatch_probe.metrics import PRESET_COLUMNS, PRESET_PREFIX, MetricsResult

MIN_WIDTH = 40  # every section table at least this wide, and never narrower than its title
# (title, key prefixes); a key goes to the first section with a matching prefix.
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Data", ("num_",)),
    ("Importance sampling", ("rollout_is_",)),
    ("Rejection sampling", ("rollout_rs_",)),
    ("Off-policy", ("kl", "k3_kl", "training_", "rollout_", "log_ppl_", "ppl_", "chi2_")),
    ("Diagnostics", ("",)),
)


def _fmt(value: float) -> str:
    return f"{value:.6g}"


def _section(key: str) -> str:
    return next(title for title, prefixes in SECTIONS if key.startswith(prefixes))


def _titles(result: MetricsResult) -> dict[str, str]:
    cfg = result.config
    return {
        "Importance sampling": cfg.is_spec.describe() if cfg.is_spec else "",
        "Rejection sampling": ", ".join(rs.describe() for rs in cfg.rs_specs),
    }


def section_tables(result: MetricsResult) -> list[Table]:
    """One ``metric | value`` table per section that has keys, in ``SECTIONS`` order."""
    rows: dict[str, list[tuple[str, float]]] = {title: [] for title, _ in SECTIONS}
    for key, value in result.scalars.items():
        if not key.startswith(PRESET_PREFIX):
            rows[_section(key)].append((key, value))
    notes = _titles(result)
    tables = []
    for title, items in rows.items():
        if not items:
            continue
        note = notes.get(title, "")
        heading = f"{title} ({note})" if note else title
        table = Table(title=heading, title_justify="left", min_width=max(len(heading), MIN_WIDTH))
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in items:
            table.add_row(key, _fmt(value))
        tables.append(table)
    return tables


def preset_table(result: MetricsResult) -> Table | None:
    """``preset | correction | tokens masked | seqs masked | ESS``, or None without presets."""
    specs = result.config.preset_specs
    if not specs:
        return None
    table = Table(title="Presets: what each correction would do", title_justify="left")
    table.add_column("preset")
    table.add_column("correction")
    for name in ("tokens masked", "seqs masked", "ESS"):
        table.add_column(name, justify="right")
    for spec in specs:
        values = [result.scalars[f"{PRESET_PREFIX}{spec.name}/{col}"] for col in PRESET_COLUMNS]
        table.add_row(spec.name, spec.describe(), *map(_fmt, values))
    return table


def render_metrics(result: MetricsResult, console: Console) -> None:
    """Print every table of ``result`` on ``console``."""
    for table in section_tables(result):
        console.print(table)
    presets = preset_table(result)
    if presets is not None:
        console.print(presets)
