"""A run's outputs, in their order: the view's data files (``rundir.write_data``:
``metrics.json``, ``integrity.json``, ``attribution.json``) before the reports drawn from it
(``report.write_outputs``: plots, ``report.md``, ``report.html``). The scan's finishing step and
``probe report`` publish a run this way; ``probe ingest`` makes the same two calls into its
hidden directory (it sits beside the pipeline, not above it).
"""

from __future__ import annotations

from pathlib import Path

from mismatch_probe.report import write_outputs
from mismatch_probe.rundir import Entry, RunContext, write_data


def publish(ctx: RunContext, entries: list[Entry], out_dir: Path | None = None) -> dict[str, Path]:
    """Write the data files, then the reports, of ``ctx`` into ``out_dir`` (its run directory
    by default); returns every path written, by name (``report.write_outputs``)."""
    out = ctx.run_dir if out_dir is None else Path(out_dir)
    return write_outputs(ctx, entries, out, write_data(ctx, out))
