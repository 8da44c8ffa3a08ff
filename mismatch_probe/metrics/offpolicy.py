"""Off-policy metrics, always computed (spec section 3; verl's ``compute_offpolicy_metrics``).

Direction: ``kl = mmean(rollout_lp - train_lp)`` is the k1 estimate of KL(rollout || train);
``r = train_lp - rollout_lp``. "Mean over sequences" divides by all S sequences, empty ones
included (their per-sequence means are 0), as verl's ``.mean()`` over the batch does.

Overflow: ``k3_kl`` (unclamped ``exp(r)``), ``*_ppl`` and ``ppl_ratio`` can exceed float64. Such a
value is reported as the largest float64 (1.797e308) and flagged: ``k3_kl_overflow`` = 1.0, or
``ppl_overflow`` = 1.0 for any of ``training_ppl``, ``rollout_ppl``, ``ppl_ratio``. Both flags are
always present (0.0 when nothing overflowed).
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.metrics.accum import Counts, Moments, capped, merge_sums, mmean
from mismatch_probe.metrics.batch import (
    TokenBatch,
    batch_k3,
    clamp_b,
    clamped_rho,
    per_batch,
    seg_mean,
    valid,
)

PPL_KEYS = ("training_ppl", "rollout_ppl", "ppl_ratio")
_OFFPOLICY_SUMS = ("sum_neg_r", "sum_k3", "sum_rho2", "sum_ppl_train", "sum_lppl_train",
                   "sum_ppl_rollout", "sum_lppl_rollout", "sum_abs_d", "sum_exp_d",
                   "sum_rho2_seq")  # fmt: skip


@per_batch
def valid_k3_sum(b: TokenBatch, _: None = None) -> float:
    """The sum of ``batch_k3`` over the valid rows (``k3_kl``'s numerator, shared)."""
    return float(valid(b, batch_k3(b, None)).sum())


@per_batch
def valid_neg_r_sum(b: TokenBatch, _: None = None) -> float:
    """The sum of ``rollout - train`` (``-r``) over the valid rows (``kl``'s numerator, shared
    with the per-turn sums: ``-sum(r)``, the same number once added to a running sum)."""
    return float(valid(b, b.rollout - b.train).sum())


class OffPolicyAccumulator:
    """Streams kl, k3_kl, the perplexities, log-ppl differences and chi-square metrics."""

    def __init__(self) -> None:
        self.sum_neg_r = self.sum_k3 = self.sum_rho2 = 0.0  # over valid tokens
        self.sum_ppl_train = self.sum_lppl_train = 0.0  # over all sequences
        self.sum_ppl_rollout = self.sum_lppl_rollout = 0.0
        self.d = Moments()  # d_i = mmean_i(rollout) - mmean_i(train), all sequences
        self.sum_abs_d = self.sum_exp_d = self.sum_rho2_seq = 0.0

    def update(self, b: TokenBatch) -> None:
        self.sum_neg_r += valid_neg_r_sum(b, None)
        self.sum_k3 += valid_k3_sum(b, None)
        rho = valid(b, clamped_rho(b, None))
        self.sum_rho2 += float((rho * rho).sum())
        mean_train, mean_rollout = seg_mean(b, b.train), seg_mean(b, b.rollout)
        d = mean_rollout - mean_train
        with np.errstate(over="ignore"):
            self.sum_ppl_train += float(np.exp(-mean_train).sum())
            self.sum_ppl_rollout += float(np.exp(-mean_rollout).sum())
            self.sum_exp_d += float(np.exp(d).sum())
        self.sum_lppl_train += float((-mean_train).sum())
        self.sum_lppl_rollout += float((-mean_rollout).sum())
        self.d.add(d)
        self.sum_abs_d += float(np.abs(d).sum())
        self.sum_rho2_seq += float(np.exp(2.0 * clamp_b(b.s)).sum())

    def merge(self, other: OffPolicyAccumulator) -> None:
        merge_sums(self, other, _OFFPOLICY_SUMS)
        self.d.merge(other.d)

    def scalars(self, counts: Counts) -> dict[str, float]:
        n, s = counts.tokens, counts.seqs
        k3_kl, k3_over = capped(mmean(self.sum_k3, n))
        ppl = {
            "training_ppl": capped(self.sum_ppl_train / s),
            "rollout_ppl": capped(self.sum_ppl_rollout / s),
            "ppl_ratio": capped(self.sum_exp_d / s),
        }
        return {
            "training_ppl": ppl["training_ppl"][0],
            "training_log_ppl": self.sum_lppl_train / s,
            "kl": mmean(self.sum_neg_r, n),
            "k3_kl": k3_kl,
            "rollout_ppl": ppl["rollout_ppl"][0],
            "rollout_log_ppl": self.sum_lppl_rollout / s,
            "log_ppl_diff": self.d.get("mean"),
            "log_ppl_abs_diff": self.sum_abs_d / s,
            "log_ppl_diff_max": self.d.get("max"),
            "log_ppl_diff_min": self.d.get("min"),
            "ppl_ratio": ppl["ppl_ratio"][0],
            "chi2_token": mmean(self.sum_rho2, n) - 1.0,
            "chi2_seq": self.sum_rho2_seq / s - 1.0,
            "k3_kl_overflow": float(k3_over),
            "ppl_overflow": float(any(over for _, over in ppl.values())),
        }
