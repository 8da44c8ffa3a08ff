"""Mismatch by training-side entropy (spec section 7).

``train_entropy`` is the entropy in nats of the training-side distribution each token was
scored under (the scan's logprobs mode: raw, or after temperature / top-k / top-p), written by
the rescorer. Stores without it (an ingested run's logs hold log-probabilities, not logits; a
store written before the column existed) or tokens where it is null are left out: then
``entropy_mean`` is absent and the curve says ``available: false``; nothing is made up.

* ``entropy_mean``: mean ``train_entropy`` over valid tokens that have one.
* ``curves["entropy"]``: ``{available, tokens, bins}``; ``bins`` are entropy deciles, each
  ``{q_lo, q_hi, lo, hi, count, mean_entropy, mean_abs_log_ratio, mean_k3}`` (``q``: the
  cumulative share of tokens below the bin; ``lo``/``hi``: the edges of the grid bins its
  tokens fall in, nats; ``k3`` on ``clampB(r)``). Deciles are built from the fixed ``GRID``
  (log-spaced below 0.1 nats, 0.005 nats wide above) and never split a grid bin, so a decile
  that shares a grid bin with the next is merged into it (many tokens of exactly zero entropy
  give one wide first bin).

Fixed-size state: counts and float64 sums per grid bin.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mismatch_probe.metrics.accum import Counts, merge_sums
from mismatch_probe.metrics.batch import TokenBatch, clamped_k3

# Edges (last bin open): 0, log-spaced from 1e-6 to 0.1 nats (confident tokens), then every
# 0.005 nats up to 16 (ln of a 8.9M-token vocabulary): fine enough for deciles of any model.
GRID = np.concatenate([[0.0], np.geomspace(1e-6, 0.1, 500), np.linspace(0.1, 16.0, 3181)[1:]])
GRID_BINS = len(GRID)
QUANTILES = 10
_SUMS = ("entropy", "abs_log_ratio", "k3")


class EntropyAccumulator:
    """Streams ``entropy_mean`` and the per-decile mismatch."""

    def __init__(self) -> None:
        self.count = np.zeros(len(GRID), dtype=np.int64)
        self.sums = {name: np.zeros(len(GRID)) for name in _SUMS}

    def update(self, b: TokenBatch) -> None:
        if b.entropy is None:
            return
        ok = b.m & ~np.isnan(b.entropy)
        h = np.maximum(b.entropy[ok], 0.0)  # a rounding error below 0 counts as 0
        r = b.r[ok]
        idx = np.clip(np.searchsorted(GRID, h, side="right") - 1, 0, len(GRID) - 1)
        values = {"entropy": h, "abs_log_ratio": np.abs(r), "k3": clamped_k3(b, None)[ok]}
        self.count += np.bincount(idx, minlength=len(GRID))
        for name in _SUMS:
            self.sums[name] += np.bincount(idx, weights=values[name], minlength=len(GRID))

    def merge(self, other: EntropyAccumulator) -> None:
        merge_sums(self, other, ("count",))
        for name in _SUMS:
            self.sums[name] = self.sums[name] + other.sums[name]

    def scalars(self, counts: Counts) -> dict[str, float]:
        n = int(self.count.sum())
        return {"entropy_mean": float(self.sums["entropy"].sum()) / n} if n else {}

    def curves(self, counts: Counts) -> dict[str, Any]:
        n = int(self.count.sum())
        return {"entropy": {"available": n > 0, "tokens": n, "bins": self._deciles(n)}}

    def _deciles(self, n: int) -> list[dict[str, Any]]:
        if not n:
            return []
        cum = np.cumsum(self.count)
        ends = np.searchsorted(cum, n * np.arange(1, QUANTILES + 1) / QUANTILES, side="left")
        rows, start = [], 0
        for end in sorted(set(np.minimum(ends, len(GRID) - 1).tolist())):
            if end < start:
                continue
            part = slice(start, end + 1)
            k = int(self.count[part].sum())
            if k:
                first = start + int(np.flatnonzero(self.count[part])[0])  # its lowest token
                rows.append(self._row(first, end, k, n, self.sums, part))
            start = end + 1
        return rows

    def _row(
        self, start: int, end: int, k: int, n: int, sums: dict[str, np.ndarray], part: slice
    ) -> dict[str, Any]:
        below = int(self.count[:start].sum())
        hi = float(GRID[end + 1]) if end + 1 < len(GRID) else None
        return {
            "q_lo": below / n,
            "q_hi": (below + k) / n,
            "lo": float(GRID[start]),
            "hi": hi,
            "count": k,
            **{f"mean_{name}": float(sums[name][part].sum()) / k for name in _SUMS},
        }
