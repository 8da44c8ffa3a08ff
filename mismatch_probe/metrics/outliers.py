"""Outliers (spec section 7): the sequences that carry the run's mismatch.

A sequence's weight in the mismatch is ``seq_k3_sum_i = msum_i(k3)`` with
``k3 = expm1(rs) - rs`` on ``rs = clampB(r)``, ``r = train_logprob - rollout_logprob`` (the
statistic of spec section 2, finite for any input). Its ``share`` is that sum over the run's
total (0 when the total is 0).

* ``outliers``: the ``TOP_OUTLIERS`` valid sequences of largest ``seq_k3_sum`` (ties: smaller
  ``seq_id`` first), each ``{seq_id, prompt_id, sample_id, tokens, seq_k3_sum, share,
  worst_position, worst_abs_log_ratio}``; ``worst_*`` is the token of largest ``|r|`` (ties:
  smaller position). ``prompt_id``/``sample_id`` are None when the store has no such columns.
  The caller adds ``setting`` and the re-scan ``command``.
* ``outlier_share_top1pct``: the share of the total carried by the ``ceil(0.01 * S)`` sequences
  of largest ``seq_k3_sum`` (``S`` all sequences, at least one).

Memory: the top records (fixed size) and one float64 per valid sequence (the exact top 1% of a
stream needs every candidate: 8 bytes a sequence, 160 KB for 20,000 sequences), never per token.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mismatch_probe.metrics.accum import Counts
from mismatch_probe.metrics.batch import TokenBatch, abs_r, positions_ascending, seg_sum
from mismatch_probe.metrics.decisions import token_k3

TOP_OUTLIERS = 20
TOP_SHARE = 0.01  # outlier_share_top1pct: the top 1% of sequences


def _rank_key(rec: dict[str, Any]) -> tuple[float, int]:
    return (-rec["seq_k3_sum"], rec["seq_id"])


def _id(values: np.ndarray | None, i: int) -> int | None:
    return int(values[i]) if values is not None else None


class OutlierAccumulator:
    """Streams every valid sequence's k3 sum and the records of the largest ones."""

    def __init__(self) -> None:
        self.sums: list[np.ndarray] = []  # per batch: [valid S_b] float64 seq_k3_sum
        self.top: list[dict[str, Any]] = []

    def update(self, b: TokenBatch) -> None:
        seq_k3 = seg_sum(b, token_k3(b, None))
        valid = np.flatnonzero(b.n > 0)
        self.sums.append(seq_k3[valid])
        if len(valid) > TOP_OUTLIERS:  # only the batch's own top can enter the run's top
            order = np.lexsort((b.seq_id[valid], -seq_k3[valid]))[:TOP_OUTLIERS]
            valid = valid[order]
        candidates = [self._record(b, int(i), float(seq_k3[i])) for i in valid]
        self.top = sorted(self.top + candidates, key=_rank_key)[:TOP_OUTLIERS]

    @staticmethod
    def _record(b: TokenBatch, i: int, k3_sum: float) -> dict[str, Any]:
        start = int(b.starts[i])
        stop = int(b.starts[i + 1]) if i + 1 < b.num_seqs else len(b.m)
        if b.all_valid and positions_ascending(b, None):  # the first largest |r| in row order
            worst = start + int(np.argmax(abs_r(b, None)[start:stop]))
        else:
            rows = start + np.flatnonzero(b.m[start:stop])
            abs_lr = abs_r(b, None)[rows]
            worst = rows[np.lexsort((b.position[rows], -abs_lr))[0]]
        return {
            "seq_id": int(b.seq_id[i]),
            "prompt_id": _id(b.prompt_id, i),
            "sample_id": _id(b.sample_id, i),
            "tokens": int(b.n[i]),
            "seq_k3_sum": k3_sum,
            "worst_position": int(b.position[worst]),
            "worst_abs_log_ratio": float(abs(b.r[worst])),
        }

    def merge(self, other: OutlierAccumulator) -> None:
        self.sums += other.sums
        self.top = sorted(self.top + other.top, key=_rank_key)[:TOP_OUTLIERS]

    def _all_sums(self) -> np.ndarray:
        return np.concatenate(self.sums) if self.sums else np.zeros(0)

    def scalars(self, counts: Counts) -> dict[str, float]:
        sums = self._all_sums()
        total = float(sums.sum())
        k = max(1, math.ceil(TOP_SHARE * counts.seqs))
        top = np.partition(sums, len(sums) - k)[len(sums) - k :] if len(sums) > k else sums
        return {"outlier_share_top1pct": float(top.sum()) / total if total > 0 else 0.0}

    def outliers(self) -> list[dict[str, Any]]:
        """The top records with their ``share`` (largest first)."""
        total = float(self._all_sums().sum())
        return [
            {**rec, "share": rec["seq_k3_sum"] / total if total > 0 else 0.0} for rec in self.top
        ]
