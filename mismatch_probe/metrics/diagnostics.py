"""Token-level diagnostics verl does not report (spec section 4; our names).

* ``prob_abs_diff_*``: ``dp = |exp(train_lp) - exp(rollout_lp)|`` over valid tokens; per response
  its max (``seq_prob_abs_diff_max_mean``: mean over all sequences of that max, 0 for an empty
  one; ``seq_prob_abs_diff_max_gt_0.5``: fraction of all sequences whose max exceeds 0.5).
* ``prob_pearson``: Pearson correlation of the two probability lists (1.0 when both are constant
  and identical, 0.0 when constant and different).
* ``f_tau_<tau>``: fraction of valid tokens with ``max(rho, 1/rho) = exp(|r|) > tau``; the
  ``f_tau`` curve covers ``TAU_GRID`` (a superset of the spec's ``SPEC_TAUS``).
* ``ipo_masked_fraction_<eps>``: fraction of valid tokens with ``dp > eps``.
* ``log_ratio_abs_mean`` / ``_max``: ``mmean(|r|)`` and ``max |r|`` (the spec's "mean abs(r)").
* Only when the store has ``support_flip``: ``support_flip_fraction`` (share of valid tokens
  flagged), ``support_flip_abs_log_ratio_share`` and ``support_flip_k3_share`` (share of the
  batch's total ``|r|`` / ``k3(clampB(r))`` carried by flagged tokens; 0 when the total is 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mismatch_probe.metrics.accum import (
    CoMoments,
    Counts,
    merge_extremes,
    merge_sums,
    mmean,
    thresholds,
)
from mismatch_probe.metrics.batch import (
    TokenBatch,
    abs_prob_diff,
    abs_r,
    clamped_k3,
    count,
    prob,
    probs,
    seg_max,
    valid,
    within_bound,
)
from mismatch_probe.metrics.parity import abs_r_stats, batch_mult, valid_sum

SPEC_TAUS = (1.01, 1.1, 1.5, 2.0, 5.0, 10.0)
TAU_GRID = (1.001, 1.003, 1.01, 1.03, 1.1, 1.2, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 100.0)
IPO_EPS = (0.1, 0.2, 0.3)
SEQ_DP_LIMIT = 0.5


def f_tau_key(tau: float) -> str:
    return f"f_tau_{tau:g}"


def prob_abs_diff(train: np.ndarray, rollout: np.ndarray) -> np.ndarray:
    """``|p_train - p_rollout|`` elementwise (any shape), ``p = prob(lp)``."""
    return np.abs(prob(train) - prob(rollout))


def ratio_spread(r: np.ndarray) -> np.ndarray:
    """``max(rho, 1/rho) = exp(|r|)``, with ``|r|`` capped at 700 (far above any tau)."""
    return spread_of_abs(np.abs(r))


def spread_of_abs(abs_r: np.ndarray) -> np.ndarray:
    """``ratio_spread`` from ``|r|``."""
    return np.exp(np.minimum(abs_r, 700.0))


def share(part: float, total: float) -> float:
    return part / total if total > 0 else 0.0


class DiagnosticsAccumulator:
    """Streams the token-level diagnostics; ``has_flip`` adds the support-flip shares."""

    def __init__(self, has_flip: bool) -> None:
        self.has_flip = has_flip
        self.sum_abs_r = self.max_abs_r = self.sum_dp = self.max_dp = 0.0
        self.sum_seq_dp_max = 0.0
        self.n_seq_dp_high = 0
        self.probs = CoMoments()  # (exp(train), exp(rollout)) over valid tokens
        self.n_tau = np.zeros(len(TAU_GRID), dtype=np.int64)
        self.n_ipo = np.zeros(len(IPO_EPS), dtype=np.int64)
        self.sum_k3 = self.n_flip = self.flip_abs_r = self.flip_k3 = 0.0

    def update(self, b: TokenBatch) -> None:
        dp_all = abs_prob_diff(b, None)
        dp, abs_lr = valid(b, dp_all), valid(b, abs_r(b, None))
        self.sum_abs_r += valid_sum(b, "abs_r")
        self.sum_dp += float(dp.sum())
        dp_counts = thresholds(dp, IPO_EPS)
        if len(dp):
            self.max_abs_r = max(self.max_abs_r, abs_r_stats(b, None).max)
            self.max_dp = max(self.max_dp, dp_counts.max)
        seq_dp = seg_max(b, dp_all)
        self.sum_seq_dp_max += float(seq_dp.sum())
        self.n_seq_dp_high += count(seq_dp > SEQ_DP_LIMIT)
        p_train, p_rollout = probs(b, None)
        self.probs.add(valid(b, p_train), valid(b, p_rollout))
        # exp(min(|r|, 700)) is NeMo-RL's exp(clampB(|r|)) when no |r| exceeds B: the same array
        spread = valid(b, batch_mult(b, None)) if within_bound(b, None) else spread_of_abs(abs_lr)
        self.n_tau += thresholds(spread, TAU_GRID).above
        self.n_ipo += dp_counts.above
        if self.has_flip and b.flip is not None:
            k3 = valid(b, clamped_k3(b, None))
            flip = valid(b, b.flip)
            self.sum_k3 += float(k3.sum())
            self.n_flip += float(count(flip))
            self.flip_abs_r += float(abs_lr[flip].sum())
            self.flip_k3 += float(k3[flip].sum())

    def merge(self, other: DiagnosticsAccumulator) -> None:
        merge_sums(self, other, ("sum_abs_r", "sum_dp", "sum_seq_dp_max", "n_seq_dp_high",
                                 "n_tau", "n_ipo", "sum_k3", "n_flip", "flip_abs_r",
                                 "flip_k3"))  # fmt: skip
        merge_extremes(self, other, ("max_abs_r", "max_dp"))
        self.probs.merge(other.probs)

    def scalars(self, counts: Counts) -> dict[str, float]:
        n, s = counts.tokens, counts.seqs
        out = {
            "log_ratio_abs_mean": mmean(self.sum_abs_r, n),
            "log_ratio_abs_max": self.max_abs_r,
            "prob_abs_diff_mean": mmean(self.sum_dp, n),
            "prob_abs_diff_max": self.max_dp,
            "seq_prob_abs_diff_max_mean": self.sum_seq_dp_max / s,
            f"seq_prob_abs_diff_max_gt_{SEQ_DP_LIMIT:g}": self.n_seq_dp_high / s,
            "prob_pearson": self.probs.pearson(identical=self.max_dp == 0.0),
        }
        fractions = dict(zip(TAU_GRID, (mmean(int(k), n) for k in self.n_tau), strict=True))
        out.update({f_tau_key(tau): fractions[tau] for tau in SPEC_TAUS})
        for eps, k in zip(IPO_EPS, self.n_ipo, strict=True):
            out[f"ipo_masked_fraction_{eps:g}"] = mmean(int(k), n)
        if self.has_flip:
            out["support_flip_fraction"] = mmean(self.n_flip, n)
            out["support_flip_abs_log_ratio_share"] = share(self.flip_abs_r, self.sum_abs_r)
            out["support_flip_k3_share"] = share(self.flip_k3, self.sum_k3)
        return out

    def curves(self, counts: Counts) -> dict[str, Any]:
        return {
            "f_tau": [
                {"tau": tau, "fraction": mmean(int(k), counts.tokens)}
                for tau, k in zip(TAU_GRID, self.n_tau, strict=True)
            ]
        }
