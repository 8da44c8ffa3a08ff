"""From numbers to decisions (spec section 7): clip fractions and the threshold sweep.

Valid tokens only; ``r = train_logprob - rollout_logprob``, ``rho = exp(clampB(r))``.

* ``clip_fraction_<eps>`` for eps in ``CLIP_EPS``: ``mmean(|rho - 1| > eps)``, the share of
  tokens PPO/GRPO's ratio clip (0.2; DAPO's upper 0.28) would touch at learning rate 0.
* ``threshold_sweep`` (a list of rows, not flat keys): for each family and threshold,
  ``{family, threshold, token_fraction, seq_fraction}``:

  ====================  ===========================================  ==========================
  family                a token is masked (or truncated) when        thresholds
  ====================  ===========================================  ==========================
  ``token_tis``         ``rho > C``                                  ``RATIO_THRESHOLDS``
  ``token_icepop``      ``rho < 1/C`` or ``rho > C``                 ``RATIO_THRESHOLDS``
  ``seq_is``            its sequence has ``q'_i > C``                ``RATIO_THRESHOLDS``
  ``seq_mean_k3``       its sequence has ``mmean_i(k3) > U``         ``K3_THRESHOLDS``
  ====================  ===========================================  ==========================

  ``q'_i = mmean_i(exp(clampB(s_i)))`` is the untruncated sequence weight (the ``q'`` of
  ``rollout_is_seq_fraction_high``; the truncated ``q_i`` never exceeds C), and
  ``k3 = expm1(rs) - rs`` on ``rs = clampB(r)`` (spec section 2). ``token_fraction`` is
  ``mmean`` of the masked tokens; ``seq_fraction`` is the share of all sequences with at least
  one masked token (the denominator of the presets' ``seq_masked_fraction``).
* ``seq_weight_hist`` (a curve): counts of the sequence log-weight ``s_i = msum_i(r)`` of valid
  sequences in ``SEQ_WEIGHT_BINS`` equal bins over ``SEQ_WEIGHT_RANGE``, plus ``underflow`` and
  ``overflow``.

Fixed-size state: a few integer counts per family and threshold, one histogram.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mismatch_probe.metrics.accum import (
    Counts,
    Thresholded,
    merge_sums,
    mmean,
    thresholds,
    uniform_hist,
)
from mismatch_probe.metrics.batch import (
    EPS,
    TokenBatch,
    clamp_b,
    clamped_k3,
    clamped_rho,
    count,
    per_batch,
    seg_max,
    seg_mean,
    seg_min,
    valid,
)

CLIP_EPS = (0.2, 0.28)
RATIO_THRESHOLDS = (1.2, 1.5, 2.0, 3.0, 5.0, 10.0)
K3_THRESHOLDS = (1e-4, 1e-3, 1e-2, 0.1)
SEQ_WEIGHT_RANGE = (-3.0, 3.0)
SEQ_WEIGHT_BINS = 121


def clip_key(eps: float) -> str:
    return f"clip_fraction_{eps:g}"


@per_batch
def _seq_weight(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[S_b]`` ``q'_i = mmean_i(exp(clampB(s_i)))``."""
    return np.exp(clamp_b(b.s)) * b.n / (b.n + EPS)


@per_batch
def token_k3(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[N]`` ``k3 = expm1(rs) - rs`` on ``rs = clampB(r)`` (memoised: outliers share it)."""
    return clamped_k3(b, None)


@per_batch
def _seq_mean_k3(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[S_b]`` ``mmean_i(k3(clampB(r)))``."""
    return seg_mean(b, token_k3(b, None))


@per_batch
def _rho_counts(b: TokenBatch, ratios: tuple[float, ...]) -> Thresholded:
    """Valid tokens with ``rho > C`` and with ``rho < 1 / C``, for each ratio ``C`` (one pass
    for both token families)."""
    return thresholds(valid(b, clamped_rho(b, None)), ratios, [1.0 / c for c in ratios])


@per_batch
def _rho_extremes(b: TokenBatch, _: None = None) -> tuple[np.ndarray, np.ndarray]:
    """``[S_b]`` each sequence's largest and smallest ``rho``."""
    rho = clamped_rho(b, None)
    return seg_max(b, rho), seg_min(b, rho)


def _token_counts(
    b: TokenBatch,
    hit: Callable[[np.ndarray, float], np.ndarray],
    masked: Callable[[Thresholded], np.ndarray],
    ratios: tuple[float, ...],
) -> tuple[list[int], list[int]]:
    """Token-level family: masked tokens per threshold (``masked`` of ``_rho_counts``), and
    sequences holding one (from the per-sequence max / min of rho: a sequence holds a masked
    token iff its extreme is)."""
    seqs = b.n > 0
    hi, lo = _rho_extremes(b, None)
    sequences = [count(seqs & (hit(hi, t) | hit(lo, t))) for t in ratios]
    return masked(_rho_counts(b, ratios)).tolist(), sequences


def _seq_counts(
    b: TokenBatch, value: np.ndarray, thresholds: tuple[float, ...]
) -> tuple[list[int], list[int]]:
    """Sequence-level family: sequences with ``value > threshold`` and their valid tokens."""
    hit = [(b.n > 0) & (value > t) for t in thresholds]
    return [int(b.n[h].sum()) for h in hit], [int(h.sum()) for h in hit]


Counter = Callable[[TokenBatch, tuple[float, ...]], tuple[list[int], list[int]]]
# family -> (thresholds, counts(batch, thresholds) -> (masked tokens, masked sequences)).
FAMILIES: dict[str, tuple[tuple[float, ...], Counter]] = {
    "token_tis": (
        RATIO_THRESHOLDS,
        lambda b, ts: _token_counts(b, lambda x, c: x > c, lambda t: t.above, ts),
    ),
    # every ratio exceeds 1, so rho > C and rho < 1 / C never hold together: counts add up
    "token_icepop": (
        RATIO_THRESHOLDS,
        lambda b, ts: _token_counts(
            b, lambda x, c: (x > c) | (x < 1.0 / c), lambda t: t.above + t.below, ts
        ),
    ),
    "seq_is": (RATIO_THRESHOLDS, lambda b, ts: _seq_counts(b, _seq_weight(b, None), ts)),
    "seq_mean_k3": (K3_THRESHOLDS, lambda b, ts: _seq_counts(b, _seq_mean_k3(b, None), ts)),
}


class DecisionAccumulator:
    """Streams the clip fractions, the threshold sweep and the sequence-weight histogram."""

    def __init__(self) -> None:
        self.n_clip = np.zeros(len(CLIP_EPS), dtype=np.int64)
        self.grid = [(f, t) for f, (ts, _) in FAMILIES.items() for t in ts]
        self.n_tok = np.zeros(len(self.grid), dtype=np.int64)
        self.n_seq = np.zeros(len(self.grid), dtype=np.int64)
        self.hist = np.zeros(SEQ_WEIGHT_BINS, dtype=np.int64)
        self.under = self.over = 0

    def update(self, b: TokenBatch) -> None:
        self.n_clip += thresholds(valid(b, clamped_rho(b, None)), CLIP_EPS, center=1.0).above
        tokens, seqs = [], []
        for family_thresholds, counter in FAMILIES.values():
            t, q = counter(b, family_thresholds)
            tokens += t
            seqs += q
        self.n_tok += tokens
        self.n_seq += seqs
        s = b.s[b.n > 0]
        hist, under, over = uniform_hist(s, SEQ_WEIGHT_BINS, *SEQ_WEIGHT_RANGE)
        self.hist += hist
        self.under += under
        self.over += over

    def merge(self, other: DecisionAccumulator) -> None:
        merge_sums(self, other, ("n_clip", "n_tok", "n_seq", "hist", "under", "over"))

    def scalars(self, counts: Counts) -> dict[str, float]:
        pairs = zip(CLIP_EPS, self.n_clip, strict=True)
        return {clip_key(eps): mmean(int(k), counts.tokens) for eps, k in pairs}

    def sweep(self, counts: Counts) -> list[dict[str, Any]]:
        """The ``threshold_sweep`` rows, families in ``FAMILIES`` order, thresholds ascending."""
        return [
            {
                "family": family,
                "threshold": threshold,
                "token_fraction": mmean(int(self.n_tok[i]), counts.tokens),
                "seq_fraction": int(self.n_seq[i]) / counts.seqs,
            }
            for i, (family, threshold) in enumerate(self.grid)
        ]

    def curves(self, counts: Counts) -> dict[str, Any]:
        return {
            "seq_weight_hist": {
                "lo": SEQ_WEIGHT_RANGE[0],
                "hi": SEQ_WEIGHT_RANGE[1],
                "counts": self.hist.tolist(),
                "underflow": self.under,
                "overflow": self.over,
            }
        }
