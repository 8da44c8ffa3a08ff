"""Misaligned sampling settings: two integrity checks (metrics spec section 8).

The seed's third cause of mismatch: a temperature or a top-p that the two sides do not share.
Neither leaves noise; each leaves a shape in ``r = train_lp - rollout_lp`` over the valid
tokens whose two log-probs are finite:

* ``temperature_mismatch``: if the rollout side is ``log softmax(z / T)`` and the training side
  ``log softmax(z)``, ``r`` moves with the token's log-prob (a sharper rollout side raises the
  likely tokens and lowers the unlikely ones); numerical noise does not. Fit
  ``r = a + b * train_lp`` by least squares, ``rho_sr`` the Pearson correlation of
  (``train_lp``, ``r``): an error when at least ``TEMPERATURE_MIN_TOKENS`` tokens,
  ``|rho_sr| >= TEMPERATURE_MIN_RHO``, ``|b| >= TEMPERATURE_MIN_SLOPE`` and
  ``truncated_support`` does not hold on the same tokens. ``b < 0``: the rollout side is
  sharper (as if sampled at a lower temperature than the trainer scores at); ``b > 0``: flatter.
  One guard beyond the spec's letter (for the lead to confirm): the correlation of
  (``rollout_lp``, ``r``) must have the same sign and also reach ``TEMPERATURE_MIN_RHO``. A
  temperature gap moves ``r`` with the log-prob of *both* sides (both are monotone in the same
  logits: |rho| 0.99 on each for the tiny model at T = 0.7 and 1.3), while noise on one side
  correlates ``r`` with that side only (``train = rollout + e`` gives ``b = var(e)/var(train)``
  > 0 and a rollout-side correlation of 0), and misaligned tokens (a shift by one, permuted
  rows) with the two sides in opposite signs (``b = 1``, ``rho = +0.71`` and ``-0.71``): without
  the guard a shift by one would also read as a temperature gap.
* ``truncated_support``: rollout log-probs renormalized over a nucleus the trainer does not
  apply give ``rollout_lp = train_lp - log P_train(S) >= train_lp``, so ``r <= 0`` nearly
  everywhere. ``n_neg`` / ``n_pos``: tokens with ``r < -1e-6`` / ``r > 1e-6``; an error when
  ``n_neg + n_pos >= 100``, ``n_neg >= 0.9 (n_neg + n_pos)`` and the median ``r`` of those
  tokens is below ``-1e-3``; the mirror (``n_pos`` dominant, median above ``1e-3``: the trainer
  truncates, the engine does not) likewise. The finding gives the implied nucleus mass
  ``exp(-|median r|)``.

Streaming with fixed-size state: the fit from merged co-moments (Chan et al.), the median from a
histogram of ``log10 |r|`` with ``MEDIAN_BINS_PER_DECADE`` bins per decade whose edges fall on the
powers of ten, so the comparison with ``1e-3`` is exact and the reported median is within 0.6%
(the geometric centre of its bin). Log-probs below ``LOGPROB_FLOOR`` are read as the floor, as in
the metric engine (an implausible placeholder is a check of its own, not a temperature).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mismatch_probe.metrics.accum import products
from mismatch_probe.metrics.batch import LOGPROB_FLOOR, count, distinct_sorted, sequence_starts

TEMPERATURE_CHECK, SUPPORT_CHECK = "temperature_mismatch", "truncated_support"
SAMPLING_CHECKS = (TEMPERATURE_CHECK, SUPPORT_CHECK)
TEMPERATURE_MIN_TOKENS = 100
TEMPERATURE_MIN_RHO = 0.3  # |rho_sr| >= 0.3 ...
TEMPERATURE_MIN_SLOPE = 0.05  # ... and |b| >= 0.05 (an fp8 KV cache measured b = 0.02)
SUPPORT_MIN_TOKENS = 100  # n_neg + n_pos >= 100
SUPPORT_SHARE = 0.9  # the dominant sign on at least 90% of the differing tokens
SUPPORT_MIN_MEDIAN = 1e-3  # |median r| above 1e-3
DIFFERENT = 1e-6  # |r| above this: the two sides differ
MEDIAN_BINS_PER_DECADE = 200
MEDIAN_DECADES = (-6, 5)  # log10 |r| from 1e-6 to 1e5 (larger |r| in the last bin)
_NBINS = MEDIAN_BINS_PER_DECADE * (MEDIAN_DECADES[1] - MEDIAN_DECADES[0])


class SamplingAccumulator:
    """Fixed-size sums of one run (or one step) for the two checks, merged batch by batch."""

    def __init__(self) -> None:
        self.n = 0
        self.mean_x = self.mean_y = 0.0
        self.sxx = self.syy = self.sxy = 0.0  # co-moments about the means
        self.sign_n = {-1: 0, 1: 0}
        self.sign_seqs = {-1: 0, 1: 0}
        self.seqs = 0
        self.hist = {-1: np.zeros(_NBINS, np.int64), 1: np.zeros(_NBINS, np.int64)}

    def update(self, seg: np.ndarray, train: np.ndarray, rollout: np.ndarray,
               finite: np.ndarray) -> None:  # fmt: skip
        """Add tokens: ``seg`` sequence indices (of this batch), float64 ``train``/``rollout``
        log-probs, ``finite`` bool (a valid token whose two log-probs are finite)."""
        every = bool(finite.all())
        x = np.maximum(train if every else train[finite], LOGPROB_FLOOR)
        y = x - np.maximum(rollout if every else rollout[finite], LOGPROB_FLOOR)
        seg = seg if every else seg[finite]  # non-decreasing (``integrity._by_sequence``)
        if not len(x):
            return
        starts = sequence_starts(seg)
        signed = {}
        for sign, hit in ((-1, y < -DIFFERENT), (1, y > DIFFERENT)):
            signed[sign] = (np.abs(y[hit]), count(np.logical_or.reduceat(hit, starts)))
        self.add(x, y, distinct_sorted(seg), signed)

    def add(self, x: np.ndarray, y: np.ndarray, seqs: int,
            signed: dict[int, tuple[np.ndarray, int]]) -> None:  # fmt: skip
        """Add tokens from their values already picked out (by ``update``, or by
        ``_kernels.integrity``): ``x``, ``y`` of the finite valid tokens, the sequences holding
        them, and per sign the ``|r|`` of the tokens of that sign (in row order) and the
        sequences holding one."""
        if not len(x):
            return
        self.seqs += seqs
        self._moments(x, y)
        for sign, (abs_r, held) in signed.items():
            self.sign_n[sign] += len(abs_r)
            self.sign_seqs[sign] += held
            self.hist[sign] += np.bincount(_bins(abs_r), minlength=_NBINS)

    def merge(self, other: SamplingAccumulator) -> None:
        """Add another accumulator's tokens (its co-moments merged as one more batch)."""
        if other.n:
            self._add(other.n, other.mean_x, other.mean_y, other.sxx, other.syy, other.sxy)
        self.seqs += other.seqs
        for sign in (-1, 1):
            self.sign_n[sign] += other.sign_n[sign]
            self.sign_seqs[sign] += other.sign_seqs[sign]
            self.hist[sign] = self.hist[sign] + other.hist[sign]

    def _moments(self, x: np.ndarray, y: np.ndarray) -> None:
        n, mx, my = len(x), float(x.mean()), float(y.mean())
        dx, dy = x - mx, y - my
        self._add(n, mx, my, *products(dx, dy))

    def _add(self, n: int, mx: float, my: float, sxx: float, syy: float, sxy: float) -> None:
        total = self.n + n
        ex, ey = mx - self.mean_x, my - self.mean_y
        w = self.n * n / total
        self.sxx += sxx + ex * ex * w
        self.syy += syy + ey * ey * w
        self.sxy += sxy + ex * ey * w
        self.mean_x += ex * n / total
        self.mean_y += ey * n / total
        self.n = total

    def rollout_rho(self) -> float:
        """The Pearson correlation of (``rollout_lp``, ``r``), ``rollout_lp = train_lp - r``
        (from the same co-moments; 0 without spread)."""
        cov, var = self.sxy - self.syy, self.sxx - 2.0 * self.sxy + self.syy
        return cov / math.sqrt(var * self.syy) if var > 0.0 and self.syy > 0.0 else 0.0

    def fit(self) -> tuple[float, float]:
        """``(b, rho_sr)`` of ``r = a + b * train_lp`` (0, 0 without spread)."""
        if self.n < 2 or self.sxx <= 0.0:
            return 0.0, 0.0
        b = self.sxy / self.sxx
        rho = self.sxy / math.sqrt(self.sxx * self.syy) if self.syy > 0.0 else 0.0
        return b, max(-1.0, min(1.0, rho))

    def median(self) -> float:
        """The median ``r`` of the tokens with ``|r| > 1e-6`` (0 when there is none)."""
        # signed bins in increasing order of r: the negative side from its largest |r| down
        counts = np.concatenate([self.hist[-1][::-1], self.hist[1]])
        total = int(counts.sum())
        if not total:
            return 0.0
        k = int(np.searchsorted(np.cumsum(counts), (total + 1) / 2))
        sign, index = (-1, _NBINS - 1 - k) if k < _NBINS else (1, k - _NBINS)
        return sign * 10.0 ** (MEDIAN_DECADES[0] + (index + 0.5) / MEDIAN_BINS_PER_DECADE)

    def support_sign(self) -> int:
        """-1 when the rollout side is truncated (``r < 0`` dominant), +1 for the mirror
        (the training side truncated), 0 when ``truncated_support`` does not hold."""
        differing = self.sign_n[-1] + self.sign_n[1]
        if differing < SUPPORT_MIN_TOKENS:
            return 0
        median = self.median()
        for sign in (-1, 1):
            dominant = self.sign_n[sign] >= SUPPORT_SHARE * differing
            if dominant and sign * median > SUPPORT_MIN_MEDIAN:
                return sign
        return 0

    def findings(self) -> list[dict[str, Any]]:
        """The two checks' findings (``integrity.Finding`` fields), errors both."""
        out = []
        sign = self.support_sign()
        if sign:
            out.append(self._support(sign))
        b, rho = self.fit()
        slanted = abs(rho) >= TEMPERATURE_MIN_RHO and abs(b) >= TEMPERATURE_MIN_SLOPE
        both = self.rollout_rho() * math.copysign(1.0, rho) >= TEMPERATURE_MIN_RHO  # the guard
        slanted = slanted and both
        if not sign and self.n >= TEMPERATURE_MIN_TOKENS and slanted:
            out.append(self._temperature(b, rho))
        return out

    def _temperature(self, b: float, rho: float) -> dict[str, Any]:
        side = (
            "sharper than the training side, as if sampled at a lower temperature than the "
            "trainer scores at"
            if b < 0
            else "flatter than the training side, as if sampled at a higher temperature than "
            "the trainer scores at"
        )
        text = (
            f"the log ratio moves with the token's log-prob (r = a + b * train_lp over "
            f"{self.n:,} tokens: b = {b:+.3g}, rho = {rho:+.2f}), which a temperature gap does "
            f"and numerical noise does not: the rollout side is {side}; give both sides the "
            "same temperature"
        )
        return {"check": TEMPERATURE_CHECK, "tokens": self.n, "sequences": self.seqs,
                "message": text, "direction": "sharper" if b < 0 else "flatter",
                "b": b, "rho": rho}  # fmt: skip

    def _support(self, sign: int) -> dict[str, Any]:
        n = self.sign_n[sign]
        share = n / (self.sign_n[-1] + self.sign_n[1])
        median = self.median()
        truncated, full = ("rollout", "training") if sign < 0 else ("training", "rollout")
        text = (
            f"r = train_lp - rollout_lp is {'negative' if sign < 0 else 'positive'} on "
            f"{share:.1%} of the {n + self.sign_n[-sign]:,} differing tokens (median r = "
            f"{median:+.4g}): the {truncated} log-probs are renormalized over a nucleus (top-p or "
            f"top-k) that the {full} side does not apply, implied nucleus mass "
            f"{math.exp(-abs(median)):.3f}; apply the same top-p/top-k on both sides (or have "
            "the engine report unprocessed log-probs)"
        )
        return {"check": SUPPORT_CHECK, "tokens": n, "sequences": self.sign_seqs[sign],
                "message": text, "median": median, "mass": math.exp(-abs(median))}  # fmt: skip


def _bins(abs_r: np.ndarray) -> np.ndarray:
    """Histogram bin of each ``|r| > 1e-6``: bin i holds ``(10^(e_i), 10^(e_i + 1/200)]``."""
    with np.errstate(divide="ignore"):
        e = (np.log10(abs_r) - MEDIAN_DECADES[0]) * MEDIAN_BINS_PER_DECADE
    return np.clip(np.ceil(e - 1e-9).astype(np.int64) - 1, 0, _NBINS - 1)
