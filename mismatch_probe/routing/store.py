"""``routing.parquet``: both sides' expert choices, one row per forward column of a sequence.

Columns (``routing_schema``):

* ``setting``, ``seq_id``: as in ``tokens.parquet`` (``seq_id`` is unique in the file);
* ``position``: the response position of the token this column's logits predict, so a row with
  ``position >= 0`` joins ``tokens.parquet`` on ``(seq_id, position)``: it holds the routes of
  the forward column that computed that token's log-probability (its input is the token before
  it). Prompt columns have negative positions ``-(P - 1) .. -1``; the last response token is
  never fed to the engine and has no row;
* ``rollout_experts`` / ``train_experts``: ``[L][K]`` int16 expert ids per MoE layer (ids
  ascending; compare them as sets), as the engine routed the token / as the training router
  chose (under routing replay: its own choice before it was overridden).

The key-value metadata (``mismatch_probe.run``) holds the run metadata with a ``routing`` entry:
``num_layers``, ``top_k``, ``num_experts``, ``moe_layers``, ``capture_path``.
This module knows nothing about vLLM or transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.routing.shape import RoutingShape

ROUTING_COLUMNS = ("seq_id", "position", "rollout_experts", "train_experts")


def routing_schema(shape: RoutingShape) -> pa.Schema:
    experts = pa.list_(pa.list_(pa.int16(), shape.top_k), shape.num_layers)
    return pa.schema(
        [
            pa.field("setting", pa.string(), nullable=False),
            pa.field("seq_id", pa.int64(), nullable=False),
            pa.field("position", pa.int32(), nullable=False),  # response position; < 0: prompt
            pa.field("rollout_experts", experts, nullable=False),  # [L][K] engine
            pa.field("train_experts", experts, nullable=False),  # [L][K] training router
        ]
    )


def routing_metadata(shape: RoutingShape, capture_path: str) -> dict[str, Any]:
    """The ``routing`` entry of the run metadata."""
    return {**shape.to_json_dict(), "capture_path": capture_path}


def routing_table(
    setting: str,
    seq_ids: Sequence[int],
    prompt_lengths: Sequence[int],
    rollout_routes: Sequence[np.ndarray],
    train_routes: Sequence[np.ndarray],
) -> pa.Table:
    """Rows of every sequence's route columns.

    Args:
        setting: the ``setting`` value of these rows.
        seq_ids: ``[S]`` sequence ids, as in ``tokens.parquet``.
        prompt_lengths: ``[S]`` prompt lengths ``P``.
        rollout_routes: ``S`` arrays ``[T, L, K]`` (``T = P + R - 1``), engine side.
        train_routes: ``S`` arrays of the same shapes, training side.
    """
    counts = [len(r) for r in rollout_routes]
    for i, (a, b) in enumerate(zip(rollout_routes, train_routes, strict=True)):
        if a.shape != b.shape:
            raise ProbeError(f"sequence {seq_ids[i]}: route shapes {a.shape} and {b.shape}")
    positions = [
        np.arange(t, dtype=np.int32) - (p - 1) for t, p in zip(counts, prompt_lengths, strict=True)
    ]
    return pa.table(
        {
            "setting": pa.array([setting] * sum(counts), pa.string()),
            "seq_id": np.repeat(np.asarray(seq_ids, np.int64), counts),
            "position": np.concatenate(positions) if positions else np.zeros(0, np.int32),
            "rollout_experts": _nested(rollout_routes),
            "train_experts": _nested(train_routes),
        }
    )


def _nested(routes: Sequence[np.ndarray]) -> pa.Array:
    """``S`` arrays ``[T, L, K]`` -> one ``list<list<int16>[K]>[L]`` array of ``sum(T)`` rows."""
    flat = np.concatenate(
        [r.astype(np.int16).reshape(-1) for r in routes] or [np.zeros(0, np.int16)]
    )
    layers, k = routes[0].shape[1:] if routes else (0, 0)
    inner = pa.FixedSizeListArray.from_arrays(pa.array(flat.astype(np.int16)), k)
    return pa.FixedSizeListArray.from_arrays(inner, layers)


def write_routing(
    path: Path, table: pa.Table, shape: RoutingShape, capture_path: str, run: dict[str, Any]
) -> None:
    """Write ``table`` to ``path`` atomically, with the run metadata and its ``routing`` entry."""
    meta = {**run, "routing": routing_metadata(shape, capture_path)}
    store.write_table(path, table, routing_schema(shape), meta)


@dataclass(frozen=True)
class RoutingData:
    """``routing.parquet`` read into arrays (rows in file order)."""

    setting: np.ndarray  # [N] str
    seq_id: np.ndarray  # [N] int64
    position: np.ndarray  # [N] int32
    rollout: np.ndarray  # [N, L, K] int16
    train: np.ndarray  # [N, L, K] int16
    meta: dict[str, Any]  # the ``routing`` entry of the run metadata

    def select(self, mask: np.ndarray) -> RoutingData:
        return RoutingData(
            self.setting[mask],
            self.seq_id[mask],
            self.position[mask],
            self.rollout[mask],
            self.train[mask],
            self.meta,
        )


def read_routing(path: Path, setting: str | None = None) -> RoutingData:
    """Read ``routing.parquet`` (a run directory or the file), one setting or all."""
    path = resolve_routing_path(path)
    store.open_parquet(path, required=ROUTING_COLUMNS)
    meta = store.read_run_metadata(path).get("routing")
    if not meta:
        raise ProbeError(f"{path} has no routing metadata (num_layers, top_k)")
    filters = [("setting", "=", setting)] if setting is not None else None
    table = pq.read_table(path, filters=filters)
    shape = (table.num_rows, meta["num_layers"], meta["top_k"])
    return RoutingData(
        setting=table.column("setting").to_numpy(zero_copy_only=False),
        seq_id=table.column("seq_id").to_numpy(),
        position=table.column("position").to_numpy(),
        rollout=_unnest(table.column("rollout_experts"), shape),
        train=_unnest(table.column("train_experts"), shape),
        meta=meta,
    )


def resolve_routing_path(path: Path) -> Path:
    """A run directory -> its ``routing.parquet``, else its sharded ``routing/`` directory; a
    file or a directory of parts as it is."""
    from mismatch_probe.store import dataset

    if not path.is_dir():
        return path
    single, parts = path / store.ROUTING_FILE, path / store.ROUTING_DIR
    if single.exists():
        return single
    if parts.is_dir():
        return parts
    return path if dataset.shards(path) else single


def _unnest(column: pa.ChunkedArray, shape: tuple[int, int, int]) -> np.ndarray:
    values = column.combine_chunks().flatten().flatten()
    return values.to_numpy(zero_copy_only=False).astype(np.int16).reshape(shape)
