"""Rejection sampling (RS): masks that drop tokens or whole sequences (spec section 2).

An option is an estimator x an aggregation, both looked up in a table:

* ``ESTIMATORS`` map ``rs = clampB(r)`` (``r = train - rollout``) to a per-token statistic:
  ``k1 = -rs``, ``k2 = rs^2 / 2``, ``k3 = exp(rs) - 1 - rs`` (computed as ``expm1(rs) - rs``);
* ``AGGREGATIONS`` turn it into ``(token_stat [N], v [S_b])``: the statistic every row is tested
  on and the per-sequence value ``v_i`` the metrics summarise. Sequence aggregations broadcast
  their sequence value to the sequence's rows, so a sequence is kept or dropped whole.

A row survives when ``lo <= token_stat <= hi`` (``RSSpec``) for every option (logical AND).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mismatch_probe.metrics.accum import (
    Counts,
    Moments,
    clamped_std,
    merge_extremes,
    merge_sums,
    mmean,
)
from mismatch_probe.metrics.batch import (
    TokenBatch,
    clamped_k3,
    clamped_r,
    per_batch,
    seg_max,
    seg_mean,
    seg_sum,
)
from mismatch_probe.metrics.config import RSSpec

Reduction = Callable[[TokenBatch, np.ndarray], np.ndarray]
Aggregation = Callable[[TokenBatch, np.ndarray], tuple[np.ndarray, np.ndarray]]

ESTIMATORS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "k1": lambda rs: -rs,
    "k2": lambda rs: 0.5 * rs * rs,
    "k3": lambda rs: np.expm1(rs) - rs,
}


def _per_token(b: TokenBatch, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x, seg_mean(b, x)


def _per_sequence(reduce: Reduction) -> Aggregation:
    def aggregate(b: TokenBatch, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        v = reduce(b, x)
        return v[b.seg], v

    return aggregate


# sequence aggregation -> its reduction ``[N] -> [S_b]`` over each sequence's valid tokens
SEQ_REDUCTIONS: dict[str, Reduction] = {
    "seq_sum": seg_sum,
    "seq_mean": seg_mean,
    "seq_max": seg_max,
}
AGGREGATIONS: dict[str, Aggregation] = {
    "token": _per_token,
    **{name: _per_sequence(reduce) for name, reduce in SEQ_REDUCTIONS.items()},
}


@per_batch
def _estimate(b: TokenBatch, estimator: str) -> np.ndarray:
    """``[N]`` one estimator on ``clampB(r)`` (memoised: options share it)."""
    return clamped_k3(b, None) if estimator == "k3" else ESTIMATORS[estimator](clamped_r(b, None))


@per_batch
def option_stats(b: TokenBatch, spec: RSSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One option on one batch.

    Returns:
        ``(token_stat [N], v [S_b], keep [N] bool)``; ``keep`` is also True at padding rows.
    """
    stat, v = AGGREGATIONS[spec.aggregation](b, _estimate(b, spec.estimator))
    keep = stat <= spec.hi
    if spec.lo is not None:
        keep &= stat >= spec.lo
    return stat, v, keep | ~b.m


def rs_keep(b: TokenBatch, specs: tuple[RSSpec, ...]) -> np.ndarray:
    """``[N]`` bool: the rows every option keeps (the new mask is ``m' = m & keep``)."""
    keep = np.ones(len(b.r), dtype=bool)
    for spec in specs:
        keep &= option_stats(b, spec)[2]
    return keep


@per_batch
def seq_keep(b: TokenBatch, spec: RSSpec) -> np.ndarray:
    """``[S_b]`` bool: the sequences a sequence-level option keeps (``lo <= v_i <= hi``, the
    test ``option_stats`` applies to each of their rows)."""
    v = SEQ_REDUCTIONS[spec.aggregation](b, _estimate(b, spec.estimator))
    keep = v <= spec.hi
    return keep & (v >= spec.lo) if spec.lo is not None else keep


def rs_seq_keep(b: TokenBatch, specs: tuple[RSSpec, ...]) -> np.ndarray:
    """``[S_b]`` bool: the sequences every (sequence-level) option keeps."""
    keep = np.ones(b.num_seqs, dtype=bool)
    for spec in specs:
        keep &= seq_keep(b, spec)
    return keep


def dropped_seqs(b: TokenBatch, keep: np.ndarray) -> np.ndarray:
    """``[S_b]`` bool: sequences with at least one valid token that ``keep`` drops."""
    out = np.zeros(b.num_seqs, dtype=bool)
    out[b.seg[~keep]] = True
    return out


class OptionAccumulator:
    """Streams the ``rollout_rs_<option>_*`` metrics of one option."""

    def __init__(self, spec: RSSpec) -> None:
        self.spec = spec
        self.is_seq = spec.aggregation != "token"
        self.sum_stat = self.sum_c = self.sum_c2 = 0.0
        self.tok_max, self.tok_min = -math.inf, math.inf
        self.n_tok_high = self.n_tok_low = 0
        self.v = Moments()  # v_i over valid sequences
        self.v_absmax = 0.0
        self.n_v_high = self.n_v_low = 0
        self.n_drop = self.n_seq_drop = 0

    def update(self, b: TokenBatch) -> np.ndarray:
        """Accumulate a batch; returns this option's ``keep`` ``[N]`` for the overall mask."""
        spec, m = self.spec, b.m
        stat, v, keep = option_stats(b, spec)
        lo = spec.lo if spec.lo is not None else -math.inf
        ts = stat[m]
        c = np.clip(ts, spec.lo if spec.lo is not None else 0.0, spec.hi)
        self.sum_stat += float(ts.sum())
        self.sum_c += float(c.sum())
        self.sum_c2 += float((c * c).sum())
        if len(ts):
            self.tok_max, self.tok_min = max(self.tok_max, ts.max()), min(self.tok_min, ts.min())
        self.n_tok_high += int((ts > spec.hi).sum())
        self.n_tok_low += int((ts < lo).sum())
        vv = v[b.n > 0]
        self.v.add(vv)
        if len(vv):
            self.v_absmax = max(self.v_absmax, float(np.abs(vv).max()))
        self.n_v_high += int((vv > spec.hi).sum())
        self.n_v_low += int((vv < lo).sum())
        self.n_drop += int((~keep).sum())
        self.n_seq_drop += int(dropped_seqs(b, keep).sum())
        return keep

    def merge(self, other: OptionAccumulator) -> None:
        merge_sums(self, other, ("sum_stat", "sum_c", "sum_c2", "n_tok_high", "n_tok_low",
                                 "n_v_high", "n_v_low", "n_drop", "n_seq_drop"))  # fmt: skip
        merge_extremes(self, other, ("tok_max", "v_absmax"), ("tok_min",))
        self.v.merge(other.v)

    def scalars(self, counts: Counts) -> dict[str, float]:
        p, n, nv = f"rollout_rs_{self.spec.option}", counts.tokens, counts.valid_seqs
        k1 = self.spec.lo is not None
        if self.is_seq:
            high, low = self.n_v_high / nv, self.n_v_low / nv
            vmax, vmin = self.v.get("max"), self.v.get("min")
        else:
            high, low = mmean(self.n_tok_high, n), mmean(self.n_tok_low, n)
            vmax, vmin = self.tok_max, self.tok_min
        out = {
            f"{p}_mean": mmean(self.sum_stat, n),
            f"{p}_max": float(vmax),
            f"{p}_min": float(vmin),
            f"{p}_fraction_high": high,
            f"{p}_fraction_low": low if k1 else 0.0,
            f"{p}_std": clamped_std(self.sum_c, self.sum_c2, n),
            f"{p}_seq_mean": self.v.get("mean"),
            f"{p}_seq_std": self.v.std(),
            f"{p}_seq_max": self.v.get("max"),
            f"{p}_seq_min": self.v.get("min"),
            f"{p}_seq_max_deviation": self.v_absmax,
            f"{p}_seq_fraction_high": self.n_v_high / nv,
        }
        if k1:
            out[f"{p}_seq_fraction_low"] = self.n_v_low / nv
        out[f"{p}_masked_fraction"] = mmean(self.n_drop, n)
        out[f"{p}_seq_masked_fraction"] = self.n_seq_drop / nv
        return out


class RSAccumulator:
    """Streams every option's metrics and the overall ``rollout_rs_*masked_fraction``."""

    def __init__(self, specs: tuple[RSSpec, ...]) -> None:
        self.options = [OptionAccumulator(spec) for spec in specs]
        self.n_drop = self.n_seq_drop = 0

    def update(self, b: TokenBatch) -> None:
        keep = np.ones(len(b.r), dtype=bool)
        for option in self.options:
            keep &= option.update(b)
        self.n_drop += int((~keep).sum())
        self.n_seq_drop += int(dropped_seqs(b, keep).sum())

    def merge(self, other: RSAccumulator) -> None:
        for mine, theirs in zip(self.options, other.options, strict=True):
            mine.merge(theirs)
        merge_sums(self, other, ("n_drop", "n_seq_drop"))

    def scalars(self, counts: Counts) -> dict[str, float]:
        out: dict[str, float] = {}
        for option in self.options:
            out.update(option.scalars(counts))
        out["rollout_rs_masked_fraction"] = mmean(self.n_drop, counts.tokens)
        out["rollout_rs_seq_masked_fraction"] = self.n_seq_drop / counts.seqs
        return out
