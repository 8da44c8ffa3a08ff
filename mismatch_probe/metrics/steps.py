"""Metrics per training step of a store with a ``step`` column (``probe ingest`` runs).

The steps come from the row groups' footer statistics; a row group whose minimum and maximum
differ (a foreign writer mixed steps) is read for its ``step`` column alone. Each step's metrics
are one ``compute_metrics(..., step=N)`` call, which reads only the row groups that can hold
the step, so all steps together cost about one pass over the file.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.config import MetricsConfig
from mismatch_probe.metrics.stream import compute_metrics
from mismatch_probe.store import STEP_COLUMN, open_parquet, resolve_tokens_path, step_ranges
from mismatch_probe.store.dataset import part_files


def list_steps(path: Path | str) -> list[int]:
    """Every distinct step of the store, ascending ([] when it has no ``step`` column)."""
    path = resolve_tokens_path(Path(path))
    if STEP_COLUMN not in open_parquet(path).schema_arrow.names:
        return []
    steps: set[int] = set()
    for part in part_files(path):  # a directory of parts: ``probe watch`` writes one per step
        pf = open_parquet(part)
        for i, span in enumerate(step_ranges(pf)):
            if span is not None and span[0] == span[1]:
                steps.add(span[0])
                continue
            column = pf.read_row_group(i, columns=[STEP_COLUMN]).column(STEP_COLUMN)
            steps.update(int(s) for s in pc.unique(column.drop_null()).to_pylist())
    return sorted(steps)


def resolve_step(path: Path | str, text: str) -> int:
    """``"last"`` or a step number -> a step the store holds."""
    steps = list_steps(path)
    if not steps:
        raise ProbeError(f"{path} has no step column (not an ingested run); drop --step")
    if text.strip() == "last":
        return steps[-1]
    try:
        step = int(text)
    except ValueError:
        raise ProbeError(f"--step {text!r}: expected a step number or 'last'") from None
    if step not in steps:
        raise ProbeError(f"--step {step}: not in the run (steps {steps[0]}..{steps[-1]})")
    return step


def compute_step_metrics(
    path: Path | str, config: MetricsConfig | None = None
) -> dict[int, dict[str, float]]:
    """``{step: flat metrics}`` for every step, ascending."""
    return {s: compute_metrics(path, config, step=s).flat() for s in list_steps(path)}
