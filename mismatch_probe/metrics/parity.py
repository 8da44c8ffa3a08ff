"""Other frameworks' names and the bitwise measures (metric spec section 6).

Users put ``probe`` numbers next to NeMo-RL, TorchTitan and Miles logs, so these carry their
names. All over valid tokens, ``r = train_lp - rollout_lp``:

* ``token_mult_prob_error = mmean(exp(clampB(|r|)))``: NeMo-RL's multiplicative token probability
  error (1.0 is identity); ``seq_mult_prob_error_max`` / ``_mean`` / ``_min`` over valid
  sequences of ``mmean_i(exp(clampB(|r|)))``.
* ``k3_kl_reverse = mmean(exp(-r) + r - 1)``: the k3 estimator with the ratio inverted (NeMo-RL's
  ``policy_kl_error``; our ``k3_kl`` is its ``gen_kl_error``). Unclamped like ``k3_kl``: an
  overflow is capped at the largest float64 and flagged by ``k3_kl_reverse_overflow``.
* ``bitwise_identical_fraction``: share of valid tokens with ``train_lp == rollout_lp`` exactly
  (the stored float32 values; float32 -> float64 is exact, so equality is preserved).
* ``ratio_tokens_different``: share of valid tokens with ``|r| > 1e-6`` (TorchTitan).
* ``first_token_abs_log_ratio_mean``: mean ``|r|`` over the first response token (smallest
  position among its valid tokens) of each valid sequence; ``rest_abs_log_ratio_mean``: mean
  ``|r|`` over every other valid token. Plain means (0 when there is no such token).

Worked example (the spec's): one token, ``rollout_lp = -5``, ``train_lp = -15``, ``r = -10``:
``k3_kl = e^-10 + 9 = 9.00005``, ``k3_kl_reverse = e^10 - 11 = 22015.5``,
``token_mult_prob_error = e^10 = 22026.5`` (each divided by ``1 + 1e-8``, the masked-mean guard).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_probe.metrics.accum import (
    Counts,
    Moments,
    Thresholded,
    capped,
    merge_sums,
    mmean,
    thresholds,
)
from mismatch_probe.metrics.batch import (
    LOGPROB_FLOOR,
    TokenBatch,
    abs_r,
    batch_k3,
    clamp_b,
    count,
    first_valid_index,
    k3_terms,
    per_batch,
    seg_mean,
    valid,
    within_bound,
)
from mismatch_probe.metrics.offpolicy import valid_k3_sum
from mismatch_probe.store.arrays import numpy_of, valid_of

DIFFERENT_ABS_LOG_RATIO = 1e-6  # TorchTitan's bitwise-parity threshold on |r|
NEMO_MULT_PROB_ERROR_LIMIT = 1.05  # NeMo-RL docs, "Adding New Models", expected error threshold


def mult_prob_error(r: np.ndarray) -> np.ndarray:
    """Per token ``exp(clampB(|r|))`` (``>= 1``; at most ``e^20``)."""
    return np.exp(clamp_b(np.abs(r)))


@per_batch
def batch_mult(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[N]`` ``mult_prob_error(r)`` (memoised: the per-turn metrics and the diagnostics'
    ratio spread share it): ``exp(|r|)`` where no ``|r|`` exceeds B (the clamp changes
    nothing: the same bits)."""
    return np.exp(abs_r(b, None)) if within_bound(b, None) else mult_prob_error(b.r)


@per_batch
def abs_r_stats(b: TokenBatch, _: None = None) -> Thresholded:
    """The valid tokens' ``|r|``: how many exceed ``DIFFERENT_ABS_LOG_RATIO``, and the largest
    (one pass; the diagnostics share the largest)."""
    return thresholds(valid(b, abs_r(b, None)), (DIFFERENT_ABS_LOG_RATIO,))


@per_batch
def valid_sum(b: TokenBatch, name: str) -> float:
    """The sum over the valid rows of ``abs_r`` or ``mult`` (``batch_mult``): each shared by
    the modules that add it (diagnostics, parity, the per-turn sums)."""
    return float(valid(b, _SUMMED[name](b, None)).sum())


_SUMMED = {"abs_r": abs_r, "mult": batch_mult}


class ParityAccumulator:
    """Streams the section-6 measures."""

    def __init__(self) -> None:
        self.sum_mult = self.sum_k3_rev = 0.0
        self.n_identical = self.n_different = 0
        self.seq_mult = Moments()  # mmean_i(exp(|r|)) over valid sequences
        self.first_sum = self.rest_sum = 0.0
        self.first_n = self.rest_n = 0

    def update(self, b: TokenBatch) -> None:
        m = b.m
        r, abs_lr = valid(b, b.r), abs_r(b, None)
        mult = batch_mult(b, None)
        self.sum_mult += valid_sum(b, "mult")
        self.sum_k3_rev += float(k3_terms(-r).sum())
        self.n_identical += count(valid(b, b.train) == valid(b, b.rollout))
        self.n_different += int(abs_r_stats(b, None).above[0])
        self.seq_mult.add(seg_mean(b, mult)[b.n > 0])
        first = first_valid_index(b, None)
        self.first_sum += float(abs_lr[first].sum())
        self.first_n += len(first)
        rest = m.copy()
        rest[first] = False
        self.rest_sum += float(abs_lr[rest].sum())
        self.rest_n += count(rest)

    def merge(self, other: ParityAccumulator) -> None:
        merge_sums(self, other, ("sum_mult", "sum_k3_rev", "n_identical", "n_different",
                                 "first_sum", "rest_sum", "first_n", "rest_n"))  # fmt: skip
        self.seq_mult.merge(other.seq_mult)

    def scalars(self, counts: Counts) -> dict[str, float]:
        n = counts.tokens
        k3_rev, over = capped(mmean(self.sum_k3_rev, n))
        return {
            "token_mult_prob_error": mmean(self.sum_mult, n),
            "seq_mult_prob_error_max": self.seq_mult.get("max"),
            "seq_mult_prob_error_mean": self.seq_mult.get("mean"),
            "seq_mult_prob_error_min": self.seq_mult.get("min"),
            "k3_kl_reverse": k3_rev,
            "k3_kl_reverse_overflow": float(over),
            "bitwise_identical_fraction": mmean(self.n_identical, n),
            "ratio_tokens_different": mmean(self.n_different, n),
            "first_token_abs_log_ratio_mean": _mean(self.first_sum, self.first_n),
            "rest_abs_log_ratio_mean": _mean(self.rest_sum, self.rest_n),
        }


def _mean(total: float, count: int) -> float:
    return total / count if count else 0.0


# --- the parity block (metrics spec section 9) --------------------------------------------------

PARITY_PREFIX = "parity/"
# UniRL's names (UniRL#430/#431), in the order of their fixed block.
PARITY_KEYS = tuple(
    PARITY_PREFIX + name
    for name in (
        "token_count",
        "torch_equal_fp32",
        "mismatch_count",
        "max_absdiff_fp32",
        "k3_mean",
        "k3_max",
    )
)


class ParityBlockAccumulator:
    """Streams the parity block, over valid tokens, both log-probs cast to float32 (the store's
    own type, so the cast is exact for a stored value):

    * ``parity/token_count``: valid tokens; ``parity/mismatch_count``: those whose two float32
      log-probs differ; ``parity/torch_equal_fp32``: 1.0 when none does, else 0.0;
    * ``parity/max_absdiff_fp32``: max ``|train_lp - rollout_lp|``, the difference in float32;
    * ``parity/k3_mean``: ``k3_kl`` (the same sums, so the same value bit for bit);
      ``parity/k3_max``: the largest per-token ``exp(r) - r - 1``, capped like ``k3_kl``.

    The log-probs are the metric engine's (``-inf`` and anything below it read as the -9999
    floor); ``first_mismatch`` reads the store itself for the first differing token.
    """

    def __init__(self) -> None:
        self.mismatches = 0
        self.max_absdiff = 0.0
        self.k3_max = 0.0
        self.sum_k3 = 0.0

    def update(self, b: TokenBatch) -> None:
        train = valid(b, b.train).astype(np.float32)
        rollout = valid(b, b.rollout).astype(np.float32)
        self.mismatches += count(train != rollout)
        if len(train):
            self.max_absdiff = max(self.max_absdiff, float(np.abs(train - rollout).max()))
            k3 = valid(b, batch_k3(b, None))
            self.k3_max = max(self.k3_max, float(k3.max()))
            self.sum_k3 += valid_k3_sum(b, None)  # OffPolicyAccumulator's own sum

    def merge(self, other: ParityBlockAccumulator) -> None:
        merge_sums(self, other, ("mismatches", "sum_k3"))
        self.max_absdiff = max(self.max_absdiff, other.max_absdiff)
        self.k3_max = max(self.k3_max, other.k3_max)

    def scalars(self, counts: Counts) -> dict[str, float]:
        values = (
            counts.tokens,
            float(self.mismatches == 0),
            self.mismatches,
            self.max_absdiff,
            capped(mmean(self.sum_k3, counts.tokens))[0],
            capped(self.k3_max)[0],
        )
        return {key: float(v) for key, v in zip(PARITY_KEYS, values, strict=True)}


def first_mismatch(tables: Iterable[pa.Table]) -> dict[str, Any] | None:
    """The first valid token (in store order) whose float32 log-probs differ, read as the
    metric engine reads them (the -9999 floor): ``{seq_id, position, train_logprob,
    rollout_logprob}``, or None. ``tables``: batches with ``seq_id``, ``position``,
    ``train_logprob`` and ``rollout_logprob`` (a null on either side marks padding)."""
    for table in tables:
        valid = np.ones(table.num_rows, dtype=bool)
        sides = []
        for name in ("train_logprob", "rollout_logprob"):
            col = table.column(name)
            valid &= valid_of(col)
            x = numpy_of(pc.cast(col, pa.float32()), null=np.float32(np.nan))
            with np.errstate(invalid="ignore"):
                sides.append(np.where(x < LOGPROB_FLOOR, np.float32(LOGPROB_FLOOR), x))
        rows = np.flatnonzero(valid & (sides[0] != sides[1]))
        if len(rows):
            i = int(rows[0])
            return {
                "seq_id": int(table.column("seq_id")[i].as_py()),
                "position": int(table.column("position")[i].as_py()),
                "train_logprob": float(sides[0][i]),
                "rollout_logprob": float(sides[1][i]),
            }
    return None
