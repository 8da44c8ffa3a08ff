"""Importance-sampling (IS) weights and their metrics (spec section 1, verl's ``rollout_is_*``).

``is_weights`` turns a batch into raw and truncated weights; ``ISAccumulator`` streams the metrics
over batches. Weights are ``train / rollout`` probability ratios: ``raw_w = exp(clampB(r))`` per
token, or ``exp(clampB(s_i))`` with ``s_i = msum_i(r)`` broadcast over sequence i, where
``r = train_logprob - rollout_logprob``. TIS truncates at U; IcePop zeroes weights outside [L, U].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from mismatch_probe.metrics.accum import (
    Counts,
    Moments,
    clamped_std,
    eff_sample_size,
    exp_capped,
    merge_extremes,
    merge_sums,
    mmean,
)
from mismatch_probe.metrics.batch import (
    EPS,
    SAFETY_BOUND,
    TokenBatch,
    clamp_b,
    clamped_rho,
    count,
    per_batch,
    seg_sum,
    valid,
)
from mismatch_probe.metrics.compiled import loops
from mismatch_probe.metrics.config import ISSpec

# level -> the [N] weight ``exp(clampB(log-weight))`` of every row (before masking).
RAW_WEIGHTS: dict[str, Callable[[TokenBatch], np.ndarray]] = {
    "token": lambda b: clamped_rho(b, None),
    "sequence": lambda b: np.exp(clamp_b(b.s))[b.seg],
}


def truncate(raw: np.ndarray, spec: ISSpec) -> np.ndarray:
    """TIS: ``min(raw, U)``; IcePop: ``raw`` inside ``[L, U]``, else 0. Shape-preserving."""
    if spec.lower is None:
        return np.minimum(raw, spec.upper)
    keep = (raw >= spec.lower) & (raw <= spec.upper)
    return np.where(keep, raw, 0.0)


@per_batch
def is_weights(b: TokenBatch, spec: ISSpec) -> tuple[np.ndarray, np.ndarray]:
    """Raw and truncated IS weights of a batch.

    Returns:
        ``(raw_w, w)``, both ``[N]`` float64, 0 at padding rows; ``0 <= w <= U`` (so the
        clamp to ``[0, U]`` of the metrics leaves ``w`` as it is).
    """
    raw = RAW_WEIGHTS[spec.level](b)
    raw = raw if b.all_valid else raw * b.m
    return raw, truncate(raw, spec)


class ISStats(NamedTuple):
    """What the IS metrics and the presets need of one spec's weights on a batch (``w`` the
    truncated weight, ``raw`` the untruncated one, both 0 at padding)."""

    sum_w: float  # w.sum()
    sum_w2: float  # (w * w).sum()
    seg_w: np.ndarray  # [S_b] seg_sum(w)
    seg_w2: np.ndarray  # [S_b] seg_sum(w * w)
    seg_raw: np.ndarray  # [S_b] seg_sum(raw)
    seg_zeros: np.ndarray  # [S_b] float64: valid rows of weight 0 (IcePop's)
    w_max: float  # over the valid rows (-inf for none)
    w_min: float  # (inf for none)
    n_high: int  # valid rows with raw > U
    n_low: int  # valid rows with raw < spec.low


@per_batch
def is_stats(b: TokenBatch, spec: ISSpec) -> ISStats:
    """``ISStats`` of a batch: one compiled pass (``_kernels.is_stats``, the sums in numpy's
    order) where the package has it, else ``is_stats_numpy`` (the same bits)."""
    kernels = loops()
    if kernels is None:
        return is_stats_numpy(b, spec)
    token = spec.level == "token"
    raw = clamped_rho(b, None) if token else np.exp(clamp_b(b.s))
    seg_sums, zeros = np.zeros(3 * b.num_seqs), np.zeros(b.num_seqs)
    lower = math.nan if spec.lower is None else spec.lower
    seg = _EMPTY_INT if token else b.seg
    mask = _EMPTY_BOOL if b.all_valid else b.m
    sums = kernels.is_stats(raw, not token, seg, mask, spec.upper, lower, b.starts, seg_sums,
                            zeros)  # fmt: skip
    w_sum, w_seg, raw_seg = seg_sums.reshape(3, b.num_seqs)
    return ISStats(sums[0], sums[1], w_sum, w_seg, raw_seg, zeros, *sums[2:])


_EMPTY_INT, _EMPTY_BOOL = np.zeros(0, np.int64), np.zeros(0, bool)


def is_stats_numpy(b: TokenBatch, spec: ISSpec) -> ISStats:
    """``ISStats`` by numpy's calls on the ``is_weights`` arrays."""
    raw, w = is_weights(b, spec)
    zero = (w == 0.0) & b.m
    zeros = seg_sum(b, zero.astype(np.float64)) if zero.any() else np.zeros(b.num_seqs)
    on_valid, raw_valid = valid(b, w), valid(b, raw)
    return ISStats(
        sum_w=float(w.sum()),
        sum_w2=float((w * w).sum()),
        seg_w=seg_sum(b, w),
        seg_w2=seg_sum(b, w * w),
        seg_raw=seg_sum(b, raw),
        seg_zeros=zeros,
        w_max=float(on_valid.max()) if len(on_valid) else -math.inf,
        w_min=float(on_valid.min()) if len(on_valid) else math.inf,
        n_high=count(raw_valid > spec.upper),
        n_low=count(raw_valid < spec.low),
    )


def weight_sums(b: TokenBatch, spec: ISSpec) -> tuple[float, float]:
    """``(sum w, sum w^2)`` over the batch (padding is 0): shared by the IS metrics and the
    presets of the same spec."""
    stats = is_stats(b, spec)
    return stats.sum_w, stats.sum_w2


class ISAccumulator:
    """Streams every ``rollout_is_*`` metric of one ``ISSpec`` (metrics before batch norm)."""

    def __init__(self, spec: ISSpec, batch_normalize: bool) -> None:
        self.spec = spec
        self.batch_normalize = batch_normalize
        self.sum_w = self.sum_w2 = 0.0  # w is in [0, U]: the clamp c of the spec is w itself
        self.w_max, self.w_min = -math.inf, math.inf
        self.n_high = self.n_low = 0  # valid tokens with raw_w > U / < L
        self.s_max, self.s_min = -math.inf, math.inf  # s_i over all sequences
        self.n_s_high = self.n_s_low = 0  # sequences with s_i > log U / < log L
        self.q = Moments()  # q_i = mmean_i(w) over all sequences
        self.q_dev = 0.0  # max |q_i - 1|
        self.n_q_high = self.n_q_low = 0  # sequences with q'_i = mmean_i(raw_w) > U / < L
        self.q_valid_sum = 0.0  # sum of q_i over valid sequences (batch norm, sequence level)

    def update(self, b: TokenBatch) -> None:
        spec, stats = self.spec, is_stats(b, self.spec)
        self.sum_w += stats.sum_w
        self.sum_w2 += stats.sum_w2
        self.w_max = max(self.w_max, stats.w_max)
        self.w_min = min(self.w_min, stats.w_min)
        self.n_high += stats.n_high
        self.n_low += stats.n_low
        s = b.s
        self.s_max, self.s_min = max(self.s_max, s.max()), min(self.s_min, s.min())
        self.n_s_high += count(s > math.log(spec.upper))
        self.n_s_low += count(s < math.log(spec.low))
        q, q_raw = stats.seg_w / (b.n + EPS), stats.seg_raw / (b.n + EPS)  # seg_mean's
        self.q.add(q)
        self.q_dev = max(self.q_dev, float(np.abs(q - 1.0).max()))
        self.n_q_high += count(q_raw > spec.upper)
        self.n_q_low += count(q_raw < spec.low)
        self.q_valid_sum += float(q[b.n > 0].sum())

    def merge(self, other: ISAccumulator) -> None:
        merge_sums(self, other, ("sum_w", "sum_w2", "n_high", "n_low", "n_s_high",
                                 "n_s_low", "n_q_high", "n_q_low", "q_valid_sum"))  # fmt: skip
        merge_extremes(self, other, ("w_max", "s_max", "q_dev"), ("w_min", "s_min"))
        self.q.merge(other.q)

    def _level_metrics(self, counts: Counts) -> dict[str, float]:
        """max/min/fraction_high/low: over tokens (token level) or sequences (sequence level)."""
        if self.spec.level == "token":
            return {
                "rollout_is_max": self.w_max,
                "rollout_is_min": self.w_min,
                "rollout_is_ratio_fraction_high": mmean(self.n_high, counts.tokens),
                "rollout_is_ratio_fraction_low": mmean(self.n_low, counts.tokens),
            }
        return {
            "rollout_is_max": math.exp(min(self.s_max, SAFETY_BOUND)),
            "rollout_is_min": exp_capped(self.s_min),
            "rollout_is_ratio_fraction_high": self.n_s_high / counts.seqs,
            "rollout_is_ratio_fraction_low": self.n_s_low / counts.seqs,
        }

    def _batch_norm_factor(self, counts: Counts) -> float:
        if self.spec.level == "token":
            mean = mmean(self.sum_w, counts.tokens)
        else:
            mean = self.q_valid_sum / max(counts.valid_seqs, EPS)
        return mean if mean > EPS else 1.0

    def scalars(self, counts: Counts) -> dict[str, float]:
        n = counts.tokens
        out = {"rollout_is_mean": mmean(self.sum_w, n), **self._level_metrics(counts)}
        out["rollout_is_std"] = clamped_std(self.sum_w, self.sum_w2, n)
        out["rollout_is_eff_sample_size"] = eff_sample_size(self.sum_w, self.sum_w2, n)
        out["rollout_is_seq_mean"] = self.q.get("mean")
        out["rollout_is_seq_std"] = self.q.std()
        out["rollout_is_seq_max"] = self.q.get("max")
        out["rollout_is_seq_min"] = self.q.get("min")
        out["rollout_is_seq_max_deviation"] = self.q_dev
        out["rollout_is_seq_fraction_high"] = self.n_q_high / counts.seqs
        out["rollout_is_seq_fraction_low"] = self.n_q_low / counts.seqs
        if self.spec.icepop:
            out["rollout_is_oob_ratio"] = mmean(self.n_high + self.n_low, n)
        if self.batch_normalize:
            out["rollout_is_batch_norm_factor"] = self._batch_norm_factor(counts)
        return out
