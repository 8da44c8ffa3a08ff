"""What a report shows, loaded once: the reference setting's ``RunContext`` and, for a
precision-matrix run, one ``Entry`` per setting (``load_report``); which settings a report, a
check or a comparison covers (``select_settings``); each setting's entry (``setting_entries``).

Sign convention: ``r = train_logprob - rollout_logprob``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.context import (
    Entry,
    RunContext,
    _run_metadata,
    decision_tables,
    load_run,
    setting_names,
)

if TYPE_CHECKING:
    from mismatch_probe.metrics import MetricsConfig


def load_report(
    run_dir: Path,
    metrics_config: MetricsConfig | None = None,
    computed: Mapping[str, dict[str, Any]] | None = None,
    run: dict[str, Any] | None = None,
    order: list[str] | None = None,
    settings: tuple[str, ...] = (),
    integrity_errors: Sequence[str] = (),
) -> tuple[RunContext, list[Entry]]:
    """Load what a report shows: the run (its reference setting when the store holds several)
    and, for a precision-matrix run, one ``Entry`` per setting (least mismatch first).

    Args:
        computed: setting name -> ``MetricsResult.to_json_dict()`` the caller already has (the
            scan's, default config): used instead of computing them again.
        run: the run metadata, when the caller has it in memory (the scan's finishing step,
            before it writes ``run.json``): nothing is read from a ``run.json`` on disk, which
            may be an earlier run's.
        order: the settings in the scan's order (first = the reference), with ``run``.
        settings: only these settings of a matrix run (``--setting``); the first of them in
            the scan's order is the reference. () means every setting.
        integrity_errors: integrity checks known to have found an error beside the run's own
            (the run's store is checked here; its errors turn the recommendation into
            "investigate first").
    """
    from dataclasses import replace

    from mismatch_probe.rundir.integrity import run_integrity

    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise ProbeError(
            f"{run_dir} is a file; probe report takes a run directory "
            "(probe metrics reads a Parquet file)"
        )
    if not run_dir.is_dir():
        raise ProbeError(f"{run_dir} is not a run directory")
    names = setting_names(run_dir, order)
    chosen = select_settings(run_dir, settings, order)
    reference = chosen[0]
    given = dict(computed or {})
    first = given.get(reference or names[0]) if names else None
    integrity = run_integrity(run_dir, run)  # recomputed from the store
    errors = list(dict.fromkeys([*integrity_errors, *integrity.error_checks()]))
    ctx = load_run(run_dir, metrics_config, reference, first, run, errors)
    ctx = replace(ctx, integrity=integrity)
    entries = setting_entries(run_dir, metrics_config, given, names, errors, ctx.run)
    if settings and len(names) > 1:
        entries = [e for e in entries if e.label in chosen]
    return ctx, entries


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
    speed = throughput(run_dir)
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


def throughput(run_dir: Path) -> dict[str, float]:
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
