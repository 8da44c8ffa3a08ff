"""Metrics per training step of a store with a ``step`` column (``probe ingest`` runs).

The steps come from the row groups' footer statistics; a row group whose minimum and maximum
differ (a foreign writer mixed steps) is read for its ``step`` column alone. ``compute_by_step``
gives the run's metrics and every step's in one pass over the file (each batch computed once,
on every core), equal to ``compute_metrics(..., step=N)`` of each step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_probe.errors import ProbeError
from mismatch_probe.malloc import collector_paused
from mismatch_probe.metrics.config import MetricsConfig
from mismatch_probe.metrics.stream import (
    OPTIONAL_COLUMNS,
    MetricEngine,
    MetricsResult,
    check_settings,
    compute_metrics,
    select_setting,
    table_partial,
    token_ids_later,
)
from mismatch_probe.metrics.turns import prompt_lengths, rerender_scalars
from mismatch_probe.parallel import ordered_map
from mismatch_probe.store import (
    METRIC_COLUMNS,
    STEP_COLUMN,
    iter_sequence_batches,
    open_parquet,
    read_rows,
    resolve_tokens_path,
    step_ranges,
    written_sequence_batches,
)
from mismatch_probe.store.arrays import numpy_of
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
    return compute_by_step(path, config)[1]


@dataclass(frozen=True)
class Written:
    """A token store handed over by its writer as it writes it (``probe ingest``): its
    ``schema`` and its row groups' ``tables``, each once written; the file is complete when
    they end. Its sequences store holds no ``prompt_length`` (an ingest's does not)."""

    schema: pa.Schema
    tables: Iterable[pa.Table]


def compute_by_step(
    path: Path | str,
    config: MetricsConfig | None = None,
    workers: int | None = None,
    on_table: Callable[[pa.Table], None] | None = None,
    written: Written | None = None,
) -> tuple[MetricsResult, dict[int, dict[str, float]]]:
    """The run's metrics and each step's flat metrics, in one pass over the store.

    Every batch is computed once for the run; a batch that holds one step is that step's batch
    too, and one that holds the end of a step and the start of the next (a sequence carried
    over a row group) is also computed per step. The steps' batches are then those that
    ``compute_metrics(path, step=N)`` reads, merged in the same order: the same numbers. A
    step's engine is finished as soon as a batch of a later step arrives (memory: the steps in
    flight, whatever the number of steps); a step seen again after that (a foreign writer's
    unordered steps) is computed on its own at the end. ``on_table`` sees each batch as read
    (``probe ingest`` feeds the integrity checks with it). With ``written``, the batches are
    cut from the tables as written (``store.written_sequence_batches``: the same batches) and
    ``path`` is read only once they end.
    """
    config = config or MetricsConfig()
    path = resolve_tokens_path(Path(path))
    names = (open_parquet(path).schema_arrow if written is None else written.schema).names
    if STEP_COLUMN not in names:
        raise ProbeError(f"{path} has no step column (not an ingested run)")
    optional = [c for c in (*OPTIONAL_COLUMNS, "setting") if c in names]
    files: list[Path] = []  # written: every column in the tables, the token ids too
    later = False
    if written is None:
        files = part_files(path)  # listed once: the locators index them
        optional, later = token_ids_later(files, optional)  # the worst tokens' ids: after
    columns = [*METRIC_COLUMNS, *optional, STEP_COLUMN]
    batches = (
        iter_sequence_batches(path, columns, parts=files)
        if written is None
        else written_sequence_batches(written.tables, columns, path)
    )
    run = MetricEngine(config, has_flip="support_flip" in names)
    steps = _Steps(path, config, run.has_flip, None if written else prompt_lengths(path, None))
    seen: set[str] = set()

    def tables() -> Iterator[pa.Table]:
        for table in batches:
            if on_table is not None:
                on_table(table)
            table = select_setting(table, None, seen)
            if table.num_rows:
                yield table

    # Written: the collector stays on, the readers and the writer running meanwhile
    with collector_paused() if written is None else nullcontext():
        for whole, parts in ordered_map(lambda t: _step_partials(run, t), tables(), workers):
            run.merge(whole)
            steps.add(parts)
    if written is not None and prompt_lengths(path, None) is not None:
        raise AssertionError("a store measured as written has no prompt_length (Written)")
    check_settings(path, None, seen)
    if later:
        run.curves.read_token_ids(lambda rows: read_rows(files, rows, "token_id"))
    covered = next(iter(seen)) if len(seen) == 1 else None
    result = run.result(str(path), covered, steps.lengths, rerender_scalars(path, None))
    return result, steps.finish(covered)


class _Steps:
    """The per-step engines in flight and the steps' finished flat metrics."""

    def __init__(
        self, path: Path, config: MetricsConfig, has_flip: bool, lengths: dict[int, int] | None
    ) -> None:
        self.path, self.config, self.has_flip = path, config, has_flip
        self.open: dict[int, MetricEngine] = {}
        self.done: dict[int, dict[str, float]] = {}
        self.again: set[int] = set()  # finished steps seen again: computed on their own
        self.lengths = lengths  # prompt lengths (``turns.prompt_lengths``)

    def add(self, parts: list[tuple[int, MetricEngine]]) -> None:
        for step in [s for s in self.open if s < min(p[0] for p in parts)]:
            self._close(step, None)
        for step, part in parts:
            if step in self.done or step in self.again:
                self.again.add(step)
                continue
            self.open.setdefault(step, MetricEngine(self.config, self.has_flip)).merge(part)

    def _close(self, step: int, covered: str | None) -> None:
        engine = self.open.pop(step)
        source = f"{self.path} step {step}"
        self.done[step] = engine.result(source, covered, self.lengths).flat()

    def finish(self, covered: str | None) -> dict[int, dict[str, float]]:
        for step in list(self.open):
            self._close(step, covered)
        for step in self.again:
            self.done[step] = compute_metrics(self.path, self.config, step=step).flat()
        return dict(sorted(self.done.items()))


def _step_partials(
    engine: MetricEngine, table: pa.Table
) -> tuple[MetricEngine, list[tuple[int, MetricEngine]]]:
    """The run's partial of a batch and its steps' (the same one for a batch of one step)."""
    column = table.column(STEP_COLUMN)
    whole = table_partial(engine, table)
    if not column.null_count:  # the usual batch: one step's rows, found by its extremes
        steps = numpy_of(column)
        if len(steps) and steps.min() == steps.max():
            return whole, [(int(steps[0]), whole)]  # the same rows: the same partial
    values = np.asarray(pc.unique(column.drop_null()).to_pylist(), dtype=np.int64)
    return whole, [(int(s), table_partial(engine, _only(table, int(s)))) for s in sorted(values)]


def _only(table: pa.Table, step: int) -> pa.Table:
    return table.filter(pc.equal(table.column(STEP_COLUMN), step))
