"""The one-pass metric engine over a token store.

``compute_metrics`` reads the store one row group at a time through
``store.iter_sequence_batches`` (whole sequences per batch). Each batch is computed on one of
the cores into a fresh ``MetricEngine`` (``partial``: every accumulator of it) and merged into
the run's engine in file order (``merge``): the batches, their order and the arithmetic of the
merge are those of a serial pass, so the result is the same bit for bit on any number of cores
(``parallel.ordered_map``). Memory is bounded by a few row groups in flight plus fixed-size
state (sums, moments, histograms, a 10-token heap and a 2,000-sequence sample), whatever the
number of tokens.

The result is a ``MetricsResult``: ``flat()`` is one ``{name: float}`` dict, finite everywhere,
with the spec's names (``kl``, ``rollout_is_mean``, ...) and ours (``f_tau_2``,
``presets/token_is/eff_sample_size``, ...); ``to_json_dict()`` adds ``config``, ``curves`` and
the tables of spec section 7 (``threshold_sweep``, ``outliers``), which are lists of records,
not flat keys (``STRUCTURED_KEYS`` names every non-flat key of ``metrics.json``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_probe.errors import ProbeError
from mismatch_probe.malloc import collector_paused
from mismatch_probe.metrics.accum import Counts
from mismatch_probe.metrics.batch import TokenBatch, batch_from_table
from mismatch_probe.metrics.config import MetricsConfig
from mismatch_probe.metrics.curves import CurvesAccumulator
from mismatch_probe.metrics.decisions import DecisionAccumulator
from mismatch_probe.metrics.diagnostics import DiagnosticsAccumulator
from mismatch_probe.metrics.entropy import EntropyAccumulator
from mismatch_probe.metrics.offpolicy import OffPolicyAccumulator
from mismatch_probe.metrics.outliers import OutlierAccumulator
from mismatch_probe.metrics.parity import ParityAccumulator, ParityBlockAccumulator
from mismatch_probe.metrics.preset_metrics import PresetAccumulator
from mismatch_probe.metrics.rejection import RSAccumulator
from mismatch_probe.metrics.turns import (
    TURN_COLUMN,
    TurnAccumulator,
    prompt_lengths,
    rerender_scalars,
)
from mismatch_probe.metrics.weights import ISAccumulator
from mismatch_probe.parallel import ordered_map
from mismatch_probe.store import (
    METRIC_COLUMNS,
    ROW_COLUMN,
    STEP_COLUMN,
    clean_int64_column,
    iter_sequence_batches,
    open_parquet,
    read_rows,
    resolve_tokens_path,
    step_source,
)
from mismatch_probe.store.arrays import numpy_of
from mismatch_probe.store.dataset import part_files

OPTIONAL_COLUMNS = (
    "support_flip",
    "token_id",
    "prompt_id",
    "sample_id",
    "train_entropy",
    TURN_COLUMN,
)
# The keys of metrics.json that are not flat metrics: records, tables, the configuration.
STRUCTURED_KEYS = (
    "config",
    "curves",
    "threshold_sweep",
    "outliers",
    "recommendation",
    "per_turn",
    "store",  # metrics.json's tie to its token store (store.fingerprint)
    "first_divergent_layer",
)


def flat_part(data: dict[str, Any]) -> dict[str, float]:
    """The flat ``{name: float}`` metrics of a ``metrics.json``-shaped dict."""
    return {k: float(v) for k, v in data.items() if k not in STRUCTURED_KEYS}


class Accumulator(Protocol):
    def update(self, b: TokenBatch) -> None: ...

    def merge(self, other: Any) -> None: ...

    def scalars(self, counts: Counts) -> dict[str, float]: ...


@dataclass(frozen=True)
class MetricsResult:
    """Metrics of one token store (or one setting of it)."""

    config: MetricsConfig
    scalars: dict[str, float]
    curves: dict[str, Any]
    # threshold_sweep, outliers; per_turn (one row per turn index, ``metrics.turns``) when the
    # store holds more than one turn
    tables: dict[str, Any] = field(default_factory=dict)

    def flat(self) -> dict[str, float]:
        """``{name: value}``, every value a finite float."""
        return dict(self.scalars)

    @property
    def per_turn(self) -> tuple[dict[str, Any], ...]:
        """One row per turn index (``turns.py``); () for a store of one turn."""
        return tuple(self.tables.get("per_turn", ()))

    def to_json_dict(self) -> dict[str, Any]:
        """``flat()`` plus ``config`` (the settings used), ``curves`` (see ``curves.py``) and
        ``tables`` (``threshold_sweep``: see ``decisions.py``; ``outliers``: ``outliers.py``;
        ``per_turn``: ``turns.py``)."""
        data = {**self.scalars, "config": self.config.describe(), "curves": self.curves}
        return {**data, **self.tables}


class MetricEngine:
    """Every accumulator a configuration needs, fed batch by batch."""

    def __init__(self, config: MetricsConfig, has_flip: bool) -> None:
        self.config = config
        self.has_flip = has_flip
        self.counts = Counts()
        self.diagnostics = DiagnosticsAccumulator(has_flip)
        self.curves = CurvesAccumulator()
        self.decisions = DecisionAccumulator()
        self.outliers = OutlierAccumulator()
        self.entropy = EntropyAccumulator()
        parts: list[Accumulator] = []
        if config.is_spec is not None:
            parts.append(ISAccumulator(config.is_spec, config.batch_normalize))
        if config.rs_specs:
            parts.append(RSAccumulator(config.rs_specs))
        parts += [OffPolicyAccumulator(), ParityAccumulator(), self.diagnostics, self.curves]
        parts += [self.decisions, self.outliers, self.entropy]
        parts.append(ParityBlockAccumulator())  # the parity block (spec 9)
        parts += [PresetAccumulator(p) for p in config.preset_specs]
        self.parts = parts
        self.turns = TurnAccumulator()

    def update(self, b: TokenBatch, turn: np.ndarray | None = None) -> None:
        """Add a batch; ``turn``: ``[N]`` turn of each row (None: every row turn 0)."""
        self.merge(self.partial(b, turn))

    def partial(self, b: TokenBatch, turn: np.ndarray | None = None) -> MetricEngine:
        """A fresh engine that has seen ``b`` alone (no state of this one is read or changed,
        so batches can be computed on any core); ``merge`` it in batch order."""
        fresh = MetricEngine(self.config, self.has_flip)
        fresh.counts.update(b)
        for part in fresh.parts:
            part.update(b)
        fresh.turns.update(b, turn)
        return fresh

    def merge(self, other: MetricEngine) -> None:
        """Add ``other``'s batches after this engine's (see ``accum``: the serial arithmetic)."""
        self.counts.merge(other.counts)
        for mine, theirs in zip(self.parts, other.parts, strict=True):
            mine.merge(theirs)
        self.turns.merge(other.turns)

    def result(
        self,
        source: str,
        setting: str | None = None,
        prompt_lengths: dict[int, int] | None = None,
        extra: Any = None,
    ) -> MetricsResult:
        """The metrics; ``setting`` names the rows they cover (in each outlier record),
        ``prompt_lengths`` (``seq_id -> tokens``) give the per-turn context, ``extra`` flat
        scalars measured elsewhere (the re-render drift)."""
        if self.counts.tokens == 0:
            raise ProbeError(f"{source}: no valid response token")
        scalars = self.counts.scalars()
        for part in self.parts:
            scalars.update({k: float(v) for k, v in part.scalars(self.counts).items()})
        scalars.update(extra or {})
        bad = [k for k, v in scalars.items() if not math.isfinite(v)]
        if bad:  # a bug, not bad input: every formula is meant to stay finite
            raise AssertionError(f"non-finite metrics: {', '.join(bad)}")
        c = self.counts
        curves = {**self.diagnostics.curves(c), **self.curves.curves(c)}
        curves.update({**self.decisions.curves(c), **self.entropy.curves(c)})
        tables: dict[str, Any] = {
            "threshold_sweep": self.decisions.sweep(c),
            "outliers": [{"setting": setting, **rec} for rec in self.outliers.outliers()],
        }
        # ``per_turn`` only where there is more than one turn: a single-turn run's one row
        # would repeat the run's own numbers
        rows = self.turns.rows(prompt_lengths)
        if len(rows) > 1:
            tables["per_turn"] = list(rows)
        return MetricsResult(self.config, scalars, curves, tables)


def select_setting(table: pa.Table, setting: str | None, seen: set[str]) -> pa.Table:
    if "setting" not in table.column_names:
        return table
    seen.update(pc.unique(table.column("setting")).to_pylist())
    if setting is None:
        return table
    return table.filter(pc.equal(table.column("setting"), setting))


def check_settings(path: Path, setting: str | None, seen: set[str]) -> None:
    if setting is None and len(seen) > 1:
        names = ", ".join(sorted(seen))
        raise ProbeError(f"{path} holds {len(seen)} settings ({names}); choose one with --setting")
    if setting is not None and setting not in seen:
        names = ", ".join(sorted(seen)) or "none"
        raise ProbeError(f"{path}: no rows with setting {setting!r} (settings: {names})")


def compute_metrics(
    path: Path | str,
    config: MetricsConfig | None = None,
    setting: str | None = None,
    step: int | None = None,
    workers: int | None = None,
) -> MetricsResult:
    """All metrics of a token store in one streaming pass.

    Args:
        path: a run directory (its ``tokens.parquet``) or any Parquet file with the columns
            ``seq_id, position, rollout_logprob, train_logprob`` (``support_flip``, ``token_id``
            and ``setting`` used when present); a sequence's rows must be contiguous.
        config: what to compute (default ``MetricsConfig()``).
        setting: keep only rows of this ``setting``; required when the store holds several.
        step: keep only rows of this training ``step`` (stores written by ``probe ingest``);
            only the row groups whose statistics can hold it are read.
        workers: threads computing batches (default: every core, ``parallel.workers``); the
            result does not depend on it (batches merged in file order, see ``accum``).

    Raises:
        ProbeError: unreadable or unsuitable file, unknown setting, no valid token.
    """
    config = config or MetricsConfig()
    path = resolve_tokens_path(Path(path))
    pf = open_parquet(path)
    names = pf.schema_arrow.names
    if setting is not None and "setting" not in names:
        raise ProbeError(f"{path} has no setting column; drop the setting filter")
    groups, read = None, path
    if step is not None:
        if STEP_COLUMN not in names:
            raise ProbeError(f"{path} has no step column (not an ingested run); drop --step")
        read, groups = step_source(path, step)  # one part of a directory ``probe watch`` wrote
    optional = [c for c in (*OPTIONAL_COLUMNS, "setting") if c in names]
    optional += [STEP_COLUMN] if step is not None else []
    parts = part_files(read)  # listed once: the locators index them
    optional, later = token_ids_later(parts, optional, groups)
    engine = MetricEngine(config, has_flip="support_flip" in names)
    seen: set[str] = set()

    def tables() -> Iterator[pa.Table]:
        for table in iter_sequence_batches(read, [*METRIC_COLUMNS, *optional], groups, parts):
            if step is not None:
                table = table.filter(pc.equal(table.column(STEP_COLUMN), step))
            table = select_setting(table, setting, seen)
            if table.num_rows:
                yield table

    with collector_paused():
        for part in ordered_map(lambda t: table_partial(engine, t), tables(), workers):
            engine.merge(part)
    check_settings(path, setting, seen)
    if later:
        engine.curves.read_token_ids(lambda rows: read_rows(parts, rows, "token_id"))
    covered = setting if setting is not None or len(seen) != 1 else next(iter(seen))
    source = str(path) if step is None else f"{path} step {step}"
    lengths = prompt_lengths(path, setting)
    if step is not None:  # the sequences store of an ingested run has no per-step drift
        return engine.result(source, covered, lengths)
    return engine.result(source, covered, lengths, rerender_scalars(path, setting))


def token_ids_later(
    parts: list[Path], columns: list[str], groups: list[int] | None = None
) -> tuple[list[str], bool]:
    """The columns a pass reads, with each row's locator (``store.ROW_COLUMN``) in place of
    ``token_id`` where the worst tokens' ids can be read afterwards (``read_rows``), and
    whether they are: where every part holds the column as integers int64 holds and the
    footers show no null, so the pass could not have refused it. Decoding every row's id took
    7% of a one-worker pass of the 10M-token bench."""
    later = "token_id" in columns and clean_int64_column(parts, "token_id", groups)
    return [ROW_COLUMN if c == "token_id" and later else c for c in columns], later


def table_partial(engine: MetricEngine, table: pa.Table) -> MetricEngine:
    """``engine.partial`` of one table of whole sequences (any thread)."""
    return engine.partial(batch_from_table(table), _turn_array(table))


def _turn_array(table: pa.Table) -> np.ndarray | None:
    """``[N]`` int64 turn of each row (nulls as 0), or None without a ``turn`` column."""
    if TURN_COLUMN not in table.column_names:
        return None
    return numpy_of(pc.cast(table.column(TURN_COLUMN), pa.int64()), null=0)
