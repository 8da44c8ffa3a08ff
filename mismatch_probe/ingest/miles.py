"""Miles dashboard columns: ``{dump_details}/dashboard_columns/rollout_<id>.parquet``.

Checked against radixark/miles ``miles/ray/rollout/debug_data.py`` (``save_dashboard_columns``,
called by ``save_debug_rollout_data`` with ``path.parent.parent / "dashboard_columns"``) at
commit 31f1ca9 (2026-08):

* one row per sample, written with polars: ``sample_index`` (Int32), ``response_length``
  (Int32), ``total_length`` (Int32), ``tokens`` (List[Int32], prompt + response),
  ``loss_mask`` (List[Int8], one per response token, may be null = all trained),
  ``rollout_log_probs`` (List[Float32], one per response token); row groups of 8 rows;
* evaluation rollouts are ``rollout_eval_<id>.parquet``: not training steps, skipped.

Read ``ROWS_PER_READ`` rows at a time, each list column as numpy arrays (``rows``), one record
per sample.

The file holds rollout log-probs only: the training side comes from rescoring the same tokens
with ``--model`` (``mismatch_probe.training.rescore``), so what is measured is the engine
against our transformers forward, not against Miles' own trainer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.records import SeqRecord, StepRange, numbered_files
from mismatch_probe.ingest.slime import sample_record

COLUMNS = ("sample_index", "response_length", "total_length", "tokens", "loss_mask",
           "rollout_log_probs")  # fmt: skip
_FILE = re.compile(r"rollout_(\d+)\.parquet$")
ROWS_PER_READ = 64
ARRAYS = ("tokens", "loss_mask", "rollout_log_probs")  # one entry per token: read as numpy


def column_files(path: Path, steps: StepRange) -> list[tuple[int, Path]]:
    return numbered_files(path, _FILE, steps, "rollout_<id>.parquet file", "dashboard_columns")


def read(path: Path, steps: StepRange) -> Iterator[SeqRecord]:
    """Every sample, ``ROWS_PER_READ`` rows of one file in memory at a time; records carry
    their prompt ids and no training side (the ingest rescores them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for step, file in column_files(path, steps):
        try:
            pf = pq.ParquetFile(file)
            missing = [c for c in COLUMNS if c not in pf.schema_arrow.names]
            if missing:
                raise ProbeError(f"{file} lacks the column(s) {', '.join(missing)}")
            row = 0
            for batch in pf.iter_batches(ROWS_PER_READ, columns=list(COLUMNS)):
                for sample in rows(batch):
                    yield _record(sample, step, f"{file} row {row}")
                    row += 1
        except (pa.ArrowException, OSError) as exc:
            raise ProbeError(f"{file} is not a readable Parquet file ({exc})") from None


def rows(batch: Any) -> Iterator[dict[str, Any]]:
    """A record batch's rows as ``to_pylist`` gives them, except that each ``ARRAYS`` list of
    numbers is a numpy array of its values (a null list None, a null inside it NaN, as
    ``float_array`` and ``int_array`` read ``None``): no Python object per token."""
    columns = {
        name: _column_values(batch.column(name))
        if name in ARRAYS
        else batch.column(name).to_pylist()
        for name in batch.schema.names
    }
    for i in range(batch.num_rows):
        yield {name: values[i] for name, values in columns.items()}


def _column_values(column: Any) -> list[Any]:
    import pyarrow as pa

    listed = pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
    item = column.type.value_type if listed else None
    if item is None or not (pa.types.is_integer(item) or pa.types.is_floating(item)
                            or pa.types.is_boolean(item)):  # fmt: skip
        return column.to_pylist()
    values = column.values.to_numpy(zero_copy_only=False)
    offsets = column.offsets.to_numpy()
    null = column.is_null().to_numpy(zero_copy_only=False)
    return [None if null[i] else values[offsets[i] : offsets[i + 1]] for i in range(len(column))]


def _record(sample: dict[str, Any], step: int, where: str) -> SeqRecord:
    tokens = sample.get("tokens")
    if tokens is not None and not isinstance(tokens, (list, np.ndarray)):
        raise ProbeError(f"{where}: tokens is not a list of integers")
    if tokens is not None and sample.get("total_length") not in (None, len(tokens)):
        raise ProbeError(
            f"{where}: arrays of unequal length (tokens {len(tokens)}, "
            f"total_length {sample['total_length']})"
        )
    return sample_record(sample, step, where, train_key=None)


def off_policy(path: Path) -> dict[str, Any]:
    return {
        "max_off_policy_steps": None,
        "source": "not applicable: the training side is our rescoring with --model, which "
        "measures mismatch alone only if --model holds the weights that generated the rollouts",
        "staleness": None,
    }
