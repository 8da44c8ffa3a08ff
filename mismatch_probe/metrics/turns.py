"""Per-turn metrics of multi-turn trajectories, and the re-render drift (the multi-turn spec).

``metrics.json`` ``per_turn`` is a list, one row per turn index ``t`` present in the store (only
for a store holding more than one turn index):

* ``turn``; ``sequences`` (sequences with a valid token in turn ``t``); ``tokens`` (valid
  tokens of turn ``t``);
* ``k3_kl = mmean_t(exp(r) - r - 1)``, ``kl = mmean_t(rollout_lp - train_lp)``,
  ``abs_log_ratio_mean = mean_t |r|``, ``token_mult_prob_error = mmean_t(exp(clampB(|r|)))``:
  the run-level definitions (``offpolicy``, ``parity``) restricted to turn ``t``'s valid tokens
  (``mmean`` is verl's ``sum / (n + 1e-8)``; k3 capped at the largest float64 on overflow);
* ``first_token_abs_log_ratio_mean``: mean ``|r|`` over the first valid token (smallest
  position) of turn ``t`` of each sequence: it follows a prefill of the whole context;
* ``context_tokens_mean``: mean over the sequences with turn ``t`` of the trajectory length at
  the turn's start, ``prompt_length + position`` of the turn's first row (``prompt_length`` from
  the sequences store beside the token store; null when there is none).

A store without a ``turn`` column is one turn (``turn`` 0). ``r = train_lp - rollout_lp``.

Re-render drift (``rerender_trajectory_fraction``, ``rerender_token_fraction``) is read from the
sequences store's ``rerender_*`` columns, which the scan fills for multi-turn trajectories.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mismatch_probe.metrics.accum import capped, mmean
from mismatch_probe.metrics.batch import (
    TokenBatch,
    abs_r,
    batch_k3,
    count,
    distinct_values,
    first_rows,
    first_valid_index,
)
from mismatch_probe.metrics.offpolicy import valid_k3_sum, valid_neg_r_sum
from mismatch_probe.metrics.parity import batch_mult, valid_sum
from mismatch_probe.store import SEQUENCES_DIR, SEQUENCES_FILE, TOKENS_DIR, TOKENS_FILE
from mismatch_probe.store.arrays import numpy_of
from mismatch_probe.store.dataset import part_files

TURN_COLUMN = "turn"
_SUMS = ("tokens", "k3", "neg_r", "abs_r", "mult", "first_abs", "first_n")


def _all_rows(b: TokenBatch) -> np.ndarray:
    return np.ones(len(b.m), dtype=bool)


class TurnAccumulator:
    """Streams the per-turn sums; ``rows(prompt_lengths)`` gives ``per_turn``."""

    def __init__(self) -> None:
        self.sums: dict[int, dict[str, float]] = {}
        self.starts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # (seq_id, position)

    def update(self, b: TokenBatch, turn: np.ndarray | None) -> None:
        """Add a batch; ``turn`` is ``[N]`` int64, the turn of each row (None: all turn 0)."""
        r, k3, mult, abs_lr = b.r, batch_k3(b, None), batch_mult(b, None), abs_r(b, None)
        values = [0] if turn is None else distinct_values(turn).tolist()
        # rows None: every row of the batch is of the one turn
        one = len(values) == 1
        turns: list[tuple[int, np.ndarray | None]] = (
            [(values[0], None)] if one else [(t, np.asarray(turn == t)) for t in values]
        )
        for t, rows in turns:
            sums = self.sums.setdefault(int(t), dict.fromkeys(_SUMS, 0.0))
            if rows is None:  # every row: the run-level sums, shared with their modules
                on_valid = b.m
                sums["k3"] += valid_k3_sum(b, None)
                sums["neg_r"] += valid_neg_r_sum(b, None)  # -sum(r), once in a running sum
                sums["abs_r"] += valid_sum(b, "abs_r")
                sums["mult"] += valid_sum(b, "mult")
            else:
                on_valid = rows & b.m
                sums["k3"] += float(k3[on_valid].sum())
                sums["neg_r"] += float(-r[on_valid].sum())
                sums["abs_r"] += float(abs_lr[on_valid].sum())
                sums["mult"] += float(mult[on_valid].sum())
            sums["tokens"] += float(count(on_valid))
            # each sequence's first valid row: as indices where every row is of this turn
            first = first_valid_index(b, None) if rows is None else first_rows(b, on_valid)
            sums["first_abs"] += float(abs_lr[first].sum())
            sums["first_n"] += float(len(first) if rows is None else count(first))
            everyone = b.all_valid and rows is None  # a turn's first row is its first valid row
            start = first if everyone else first_rows(b, _all_rows(b) if rows is None else rows)
            self.starts.setdefault(int(t), []).append((b.seq_id[b.seg[start]], b.position[start]))

    def merge(self, other: TurnAccumulator) -> None:
        for t, sums in other.sums.items():
            mine = self.sums.setdefault(t, dict.fromkeys(_SUMS, 0.0))
            for key in _SUMS:
                mine[key] += sums[key]
            self.starts.setdefault(t, []).extend(other.starts[t])

    def rows(self, prompt_lengths: dict[int, int] | None) -> list[dict[str, Any]]:
        """``per_turn`` (see the module docstring), turns ascending."""
        out = []
        for t in sorted(self.sums):
            s = self.sums[t]
            seq_ids = np.concatenate([x for x, _ in self.starts[t]])
            positions = np.concatenate([p for _, p in self.starts[t]])
            n = s["tokens"]
            k3, _ = capped(mmean(s["k3"], n))
            out.append(
                {
                    "turn": t,
                    "sequences": int(s["first_n"]),
                    "tokens": int(n),
                    "k3_kl": k3,
                    "kl": mmean(s["neg_r"], n),
                    "abs_log_ratio_mean": s["abs_r"] / n if n else 0.0,
                    "token_mult_prob_error": mmean(s["mult"], n),
                    "first_token_abs_log_ratio_mean": (
                        s["first_abs"] / s["first_n"] if s["first_n"] else 0.0
                    ),
                    "context_tokens_mean": _context_mean(seq_ids, positions, prompt_lengths),
                }
            )
        return out


def _context_mean(
    seq_ids: np.ndarray, positions: np.ndarray, prompt_lengths: dict[int, int] | None
) -> float | None:
    if prompt_lengths is None or not len(seq_ids):
        return None
    lengths = [prompt_lengths.get(int(s)) for s in seq_ids]
    if any(x is None for x in lengths):
        return None
    return float(np.mean(np.asarray(lengths, dtype=np.float64) + positions))


def sequences_path(tokens: Path) -> Path | None:
    """The sequences store beside a token store (file or sharded directory), if any."""
    if tokens.name == TOKENS_FILE:
        path = tokens.with_name(SEQUENCES_FILE)
    elif tokens.name == TOKENS_DIR:
        path = tokens.with_name(SEQUENCES_DIR)
    else:
        return None
    return path if path.exists() else None


def _sequence_table(path: Path | None, columns: list[str], setting: str | None) -> pa.Table | None:
    """The sequences store's ``columns`` (rows of ``setting``), or None when it lacks them."""
    if path is None:
        return None
    try:
        parts = part_files(path)
        names = pq.ParquetFile(parts[0]).schema_arrow.names
        wanted = [c for c in ["setting", "seq_id", *columns] if c in names]
        if not set(columns) <= set(names):
            return None
        table = pa.concat_tables([pq.read_table(p, columns=wanted) for p in parts])
    except (pa.ArrowException, OSError, ValueError):
        return None  # an unreadable sequences store: what depends on it is left out
    if setting is not None and "setting" in table.column_names:
        table = table.filter(pc.equal(table.column("setting"), setting))
    return table


def prompt_lengths(tokens: Path, setting: str | None) -> dict[int, int] | None:
    """``seq_id -> prompt_length`` from the sequences store beside ``tokens`` (None if none)."""
    table = _sequence_table(sequences_path(tokens), ["prompt_length"], setting)
    if table is None:
        return None
    ids = table.column("seq_id").to_pylist()
    return dict(zip(ids, table.column("prompt_length").to_pylist(), strict=True))


def rerender_scalars(tokens: Path, setting: str | None) -> dict[str, float]:
    """``rerender_trajectory_fraction`` (trajectories whose re-rendered ids differ anywhere)
    and ``rerender_token_fraction`` (generated tokens that differ or have no aligned
    counterpart, over the generated tokens of those trajectories); {} where the scan measured
    no trajectory."""
    cols = ["rerender_differs", "rerender_mismatched_tokens", "response_length"]
    table = _sequence_table(sequences_path(tokens), cols, setting)
    if table is None:
        return {}
    table = table.filter(pc.is_valid(table.column("rerender_differs")))
    if table.num_rows == 0:
        return {}
    differs = numpy_of(table.column("rerender_differs")).astype(bool)
    bad = numpy_of(table.column("rerender_mismatched_tokens")).astype(np.float64)
    total = numpy_of(table.column("response_length")).astype(np.float64)
    return {
        "rerender_trajectory_fraction": float(differs.mean()),
        "rerender_token_fraction": float(bad.sum() / total.sum()) if total.sum() else 0.0,
    }


def rerender_example(tokens: Path, setting: str | None) -> str | None:
    """The first re-render difference of the first trajectory that has one, in context
    (``rerender_context`` of the sequences store), or None."""
    table = _sequence_table(sequences_path(tokens), ["rerender_context"], setting)
    if table is None:
        return None
    found = table.column("rerender_context").drop_null()
    return str(found[0]) if len(found) else None
