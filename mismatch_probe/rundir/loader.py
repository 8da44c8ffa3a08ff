"""What a report shows, built once: the reference setting's ``RunContext`` and, for a
precision-matrix run, one ``Entry`` per setting (``build_report``, from the data files as their
producer holds them; ``load_report``, from a run directory); which settings a report, a check or
a comparison covers (``select_settings``); each setting's entry (``setting_entries``).

Sign convention: ``r = train_logprob - rollout_logprob``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.context import (
    Entry,
    RunContext,
    build_run,
    decision_tables,
    match_settings,
    setting_names,
)
from mismatch_probe.rundir.data import RunData, read_data
from mismatch_probe.rundir.integrity import run_integrity
from mismatch_probe.rundir.order import in_setting_order
from mismatch_probe.rundir.trend import build_trend, steps_of

if TYPE_CHECKING:
    from mismatch_probe.metrics import MetricsConfig


def load_report(
    run_dir: Path,
    metrics_config: MetricsConfig | None = None,
    settings: tuple[str, ...] = (),
    integrity_errors: Sequence[str] = (),
) -> tuple[RunContext, list[Entry]]:
    """``probe report``: read the run directory's data files once (``data.read_data``) and
    build what a report shows (``build_report``).

    Raises:
        ProbeError: a file instead of a run directory, a missing directory, an unknown
            ``--setting``, an unreadable store or data file.
    """
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise ProbeError(
            f"{run_dir} is a file; probe report takes a run directory "
            "(probe metrics reads a Parquet file)"
        )
    if not run_dir.is_dir():
        raise ProbeError(f"{run_dir} is not a run directory")
    return build_report(run_dir, read_data(run_dir), metrics_config, settings, integrity_errors)


def build_report(
    run_dir: Path,
    data: RunData,
    metrics_config: MetricsConfig | None = None,
    settings: tuple[str, ...] = (),
    integrity_errors: Sequence[str] = (),
) -> tuple[RunContext, list[Entry]]:
    """What a report shows: the run (its reference setting when the store holds several), with
    its data-integrity findings and, for an ingested run, its trend; and, for a precision-matrix
    run, one ``Entry`` per setting (in the settings' order, ``rundir.order``).

    Args:
        data: the run's data files, as the producer holds them in memory (the scan's finishing
            step, before it writes ``run.json``: nothing is read from an earlier run's files) or
            as ``read_data`` read them.
        metrics_config: the config of the metrics shown (None: the stored or given ones').
        settings: only these settings of a matrix run (``--setting``); the first of them in
            the scan's order is the reference. () means every setting.
        integrity_errors: integrity checks known to have found an error beside the run's own
            (the run's store is checked here; its errors turn the recommendation into
            "investigate first").
    """
    names = setting_names(run_dir, data.order)
    chosen = select_settings(run_dir, settings, data.order)
    integrity = data.integrity  # the producer's, from this store in its metrics pass
    if integrity is None:
        integrity = run_integrity(run_dir, data.run)  # recomputed from the store
    errors = list(dict.fromkeys([*integrity_errors, *integrity.blocking_checks()]))
    ctx = build_run(run_dir, data, metrics_config, chosen[0], errors, names)
    steps = steps_of(store.resolve_tokens_path(run_dir), data.steps, ctx.config)
    trend = build_trend(steps.per_step, ctx.run) if steps is not None else None
    ctx = replace(ctx, integrity=integrity, steps=steps, trend=trend)
    entries = setting_entries(run_dir, data, metrics_config, names, errors)
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
    wanted = match_settings(wanted, names)  # kv=fp8: the one setting with that part
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
    data: RunData,
    metrics_config: MetricsConfig | None = None,
    names: list[str] | None = None,
    integrity_errors: Sequence[str] = (),
) -> list[Entry]:
    """One ``Entry`` per setting, in the settings' order (``order.setting_key``: failing first,
    then least ``k3_kl``), with its rollout throughput
    (``data.throughput``); [] for a single-setting run.

    ``data.metrics`` computed with ``metrics_config`` (default config when None) are reused,
    the others computed from the store. ``names``: the settings (``setting_names``) when the
    caller has them. Each entry's ``tables`` hold its threshold sweep, outliers and
    recommendation (``context.decision_tables``)."""
    from mismatch_probe.metrics import MetricsConfig, compute_metrics
    from mismatch_probe.metrics.stream import flat_part

    names = setting_names(run_dir, data.order) if names is None else names
    if len(names) < 2:
        return []
    cfg = metrics_config or MetricsConfig()
    entries = []
    for name in names:
        metrics = data.metrics.get(name)
        if metrics is None or metrics["config"] != cfg.describe():
            tokens = store.resolve_tokens_path(run_dir)
            metrics = compute_metrics(tokens, cfg, setting=name).to_json_dict()
        flat = flat_part(metrics)
        if name in data.throughput:
            flat["rollout_tokens_per_s"] = data.throughput[name]
        tables = decision_tables(data.run, metrics, integrity_errors)
        entries.append(Entry(name, flat, metrics["curves"], tables))
    return in_setting_order(entries, lambda e: e.label, lambda e: e.metrics)
