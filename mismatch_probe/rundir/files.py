"""A view's data files written: what the scan's finishing step, ``probe ingest`` and
``probe report`` write before any report is rendered.

``metrics.json`` (the store's first setting, or the whole store, with ``store``: the row count
and each Parquet part's fingerprint of the token store they were computed from, so that a
reader recomputes them when the store was replaced: ``store.fingerprint``), ``integrity.json``,
``attribution.json`` (removed when the run has none: an earlier ``--attribute`` run's) and
``steps.json`` when its per-step metrics were computed here (an ingest, or another config).
``settings.json`` and ``routing.json`` are the scan's own (``pipeline.scan``, ``pipeline.routes``).
"""

from __future__ import annotations

from pathlib import Path

from mismatch_probe import store
from mismatch_probe.rundir.attribution import write_attribution
from mismatch_probe.rundir.context import RunContext
from mismatch_probe.rundir.integrity import write_integrity
from mismatch_probe.rundir.trend import write_steps
from mismatch_probe.store.fingerprint import STORE_KEY, store_tie


def write_data(ctx: RunContext, out_dir: Path) -> dict[str, Path]:
    """Write the data files of ``ctx`` into ``out_dir`` (see the module docstring).

    Returns:
        ``{"metrics": ..., "integrity": ..., "attribution": ..., "steps": ...}``, those written.

    Raises:
        ProbeError: ``out_dir`` cannot be written to.
    """
    out = store.writable_dir(Path(out_dir), "run directory")
    paths: dict[str, Path] = {}
    if not ctx.settings or ctx.setting in (None, ctx.settings[0]):  # the scan's first setting
        paths["metrics"] = out / store.METRICS_FILE
        tie = store_tie(store.resolve_tokens_path(ctx.run_dir))  # the store they come from
        store.write_json(paths["metrics"], {**ctx.json_dict(), STORE_KEY: tie})
    if ctx.integrity is not None:
        paths["integrity"] = write_integrity(out, ctx.integrity)
    paths.update(write_attribution(out, ctx.attribution))
    if ctx.steps is not None and not ctx.steps.stored:
        paths["steps"] = write_steps(out, ctx.steps)
    return paths
