"""Streaming building blocks: mergeable moments, counts and the finishing formulas.

Every metric module accumulates float64 sums, counts, maxima and mergeable moments (Chan et al.'s
pairwise update, so a standard deviation over 20,000 sequences or a Pearson correlation over
10 million tokens is exact to rounding and independent of how rows are split into batches).
Nothing here keeps per-token or per-sequence lists.

Merging: every accumulator has ``merge(other)``, which adds another accumulator's state as if
its batches had come next (sums added, extremes combined, ``Moments`` replaying the other's
batch statistics). The metric engine computes each batch into a fresh accumulator (on any core)
and merges them in batch order: the exact arithmetic of one serial pass.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from mismatch_probe.metrics.batch import EPS, TokenBatch
from mismatch_probe.metrics.compiled import loops

FLOAT_MAX = sys.float_info.max  # an overflowing metric is reported as this, and flagged
DEGENERATE_VAR = 1e-20  # a per-item variance below this counts as zero (constant list)


def merge_sums(target: object, other: object, names: tuple[str, ...]) -> None:
    """``target.x += other.x`` for each name (floats, ints or arrays), in ``names`` order."""
    for name in names:
        setattr(target, name, getattr(target, name) + getattr(other, name))


def merge_extremes(target: object, other: object, maxes: tuple[str, ...],
                   mins: tuple[str, ...] = ()) -> None:  # fmt: skip
    """``target.x = max(target.x, other.x)`` for ``maxes``, ``min`` for ``mins``."""
    for name in maxes:
        setattr(target, name, max(getattr(target, name), getattr(other, name)))
    for name in mins:
        setattr(target, name, min(getattr(target, name), getattr(other, name)))


def uniform_hist(x: np.ndarray, bins: int, lo: float, hi: float) -> tuple[np.ndarray, int, int]:
    """``np.histogram(x, bins, (lo, hi))`` counts (bins bounded by the same ``linspace`` edges,
    the last one closed), plus the values below ``lo`` and above ``hi``, in one ``bincount``
    (``uniform_slots``)."""
    counts = uniform_slots(x, bins, lo, hi)
    return counts[1 : bins + 1], int(counts[0]), int(counts[bins + 1 :].sum())


def uniform_bounds(bins: int, lo: float, hi: float) -> tuple[np.ndarray, float, float]:
    """``(E, scale, offset)`` of ``uniform_slots``: the ``bins + 4`` slot bounds and the guess
    ``x * scale + offset``."""
    edges = np.linspace(lo, hi, bins + 1)
    bounds = np.concatenate([[-np.inf], edges[:-1], [np.nextafter(hi, np.inf), np.inf, np.inf]])
    scale = bins / (hi - lo)
    return bounds, scale, 1.0 - lo * scale


def uniform_slots(x: np.ndarray, bins: int, lo: float, hi: float) -> np.ndarray:
    """``[bins + 3]`` counts of ``x`` by slot: underflow, the bins, overflow, ``+inf``.

    Slot ``s`` holds ``E[s] <= x < E[s + 1]`` for ``E = [-inf, edges[:-1], nextafter(hi, inf),
    inf]``. A value's slot is guessed from ``(x - lo) * bins / (hi - lo)`` (at most one off, at
    an edge) and corrected against ``E``.
    """
    bounds, scale, offset = uniform_bounds(bins, lo, hi)
    with np.errstate(over="ignore"):  # a huge |x| overflows to an infinity: clipped
        guess = np.clip(x * scale + offset, 0.0, bins + 1.0).astype(np.intp)
    guess -= x < bounds.take(guess)
    guess += x >= bounds[1:].take(guess)  # bounds[guess + 1]
    return np.bincount(guess, minlength=bins + 3)  # slot bins + 2: +inf (never a finite x)


_FEW_THRESHOLDS = 3


class Thresholded(NamedTuple):
    """What ``thresholds`` counts of an array: ``above[k]`` values ``> above_t[k]``,
    ``below[k]`` values ``< below_t[k]``, and the largest and smallest value."""

    above: np.ndarray  # int64, one per threshold
    below: np.ndarray
    max: float  # -inf for no value
    min: float  # inf for no value


def thresholds(x: np.ndarray, above: Sequence[float] = (), below: Sequence[float] = (),
               center: float | None = None, compiled: bool = True) -> Thresholded:  # fmt: skip
    """Counts of ``v > t`` for each ``t`` of ``above`` and ``v < t`` for each of ``below``, with
    ``v = x`` (no NaN) or ``v = |x - center|``, and ``v``'s extremes: one compiled pass
    (``_kernels.thresholds``) where the package has it and ``compiled``, else numpy's compares
    (the same counts and extremes: each compares the same values)."""
    n_above, n_below = np.zeros(len(above), np.int64), np.zeros(len(below), np.int64)
    # the compiled pass pays from a few thresholds or a center on; numpy's passes are as fast
    few = center is None and len(above) + len(below) < _FEW_THRESHOLDS
    kernels = loops(compiled and not few)
    if kernels is not None:
        x = np.ascontiguousarray(x, dtype=np.float64)
        hi, lo = kernels.thresholds(x, math.nan if center is None else center,
                                    np.asarray(above, np.float64), np.asarray(below, np.float64),
                                    n_above, n_below)  # fmt: skip
        return Thresholded(n_above, n_below, hi, lo)
    v = x if center is None else np.abs(x - center)
    n_above[:] = [np.count_nonzero(v > t) for t in above]
    n_below[:] = [np.count_nonzero(v < t) for t in below]
    if not len(v):
        return Thresholded(n_above, n_below, -math.inf, math.inf)
    return Thresholded(n_above, n_below, float(v.max()), float(v.min()))


def products(dx: np.ndarray, dy: np.ndarray) -> tuple[float, float, float]:
    """``(sum dx^2, sum dy^2, sum dx dy)``, each sum one fused pass over its pair (``einsum``:
    no temporary, and no BLAS, whose threads would spin beside the metric pass's)."""
    return (float(np.einsum("i,i->", dx, dx)), float(np.einsum("i,i->", dy, dy)),
            float(np.einsum("i,i->", dx, dy)))  # fmt: skip


class Moments:
    """Count, mean, sum of squared deviations, min and max of a stream of values.

    ``merge`` replays the other stream's batches (``parts``: each ``add``'s batch statistics) in
    their order, with the formula ``add`` applies, so a stream split into per-batch partial
    accumulators and merged in batch order equals the serial one bit for bit.
    """

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.parts: list[tuple[int, float, float, float, float]] = []

    def add(self, x: np.ndarray) -> None:
        """Merge the values ``x`` (``[k]``) into the running moments."""
        if len(x) == 0:
            return
        nb, mb = len(x), float(np.mean(x))
        part = (nb, mb, float(np.sum((x - mb) ** 2)), float(np.min(x)), float(np.max(x)))
        self.parts.append(part)
        self._add(*part)

    def _add(self, nb: int, mb: float, ss: float, lo: float, hi: float) -> None:
        n = self.n + nb
        delta = mb - self.mean
        self.m2 += ss + delta * delta * self.n * nb / n
        self.mean += delta * nb / n
        self.n = n
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)

    def merge(self, other: Moments) -> None:
        for part in other.parts:
            self._add(*part)

    def std(self) -> float:
        """Unbiased (n-1) standard deviation; 0 for fewer than two values."""
        return math.sqrt(max(self.m2, 0.0) / (self.n - 1)) if self.n > 1 else 0.0

    def get(self, attr: str) -> float:
        """``mean``/``min``/``max``, 0 when no value was seen."""
        return float(getattr(self, attr)) if self.n else 0.0


class CoMoments:
    """Count, means and co-moments of a stream of (x, y) pairs: correlation and LS slope.
    ``merge`` replays the other stream's batches, as ``Moments.merge``."""

    def __init__(self) -> None:
        self.n = 0
        self.mx = self.my = 0.0
        self.sxx = self.syy = self.sxy = 0.0
        self.parts: list[tuple[int, float, float, float, float, float]] = []

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        """Merge the pairs ``(x[k], y[k])``."""
        if len(x) == 0:
            return
        nb, mxb, myb = len(x), float(np.mean(x)), float(np.mean(y))
        part = (nb, mxb, myb, *products(x - mxb, y - myb))
        self.parts.append(part)
        self._add(*part)

    def _add(self, nb: int, mxb: float, myb: float, sxx: float, syy: float, sxy: float) -> None:
        n = self.n + nb
        dx, dy, w = mxb - self.mx, myb - self.my, self.n * nb / n
        self.sxx += sxx + dx * dx * w
        self.syy += syy + dy * dy * w
        self.sxy += sxy + dx * dy * w
        self.mx += dx * nb / n
        self.my += dy * nb / n
        self.n = n

    def merge(self, other: CoMoments) -> None:
        for part in other.parts:
            self._add(*part)

    def _flat(self, s: float) -> bool:
        return s <= DEGENERATE_VAR * max(self.n, 1)

    def pearson(self, identical: bool) -> float:
        """Pearson r; for a constant list, 1.0 when the two lists are identical, else 0.0."""
        if self._flat(self.sxx) or self._flat(self.syy):
            return 1.0 if identical else 0.0
        return max(-1.0, min(1.0, self.sxy / math.sqrt(self.sxx * self.syy)))

    def slope(self) -> float:
        """Least-squares slope of y on x; 0 when every x is the same."""
        return 0.0 if self._flat(self.sxx) else self.sxy / self.sxx

    def intercept(self) -> float:
        return self.my - self.slope() * self.mx


def mmean(total: float, n_tokens: float) -> float:
    """verl's masked mean from a masked sum: ``sum / (count + 1e-8)``."""
    return total / (n_tokens + EPS)


def clamped_std(sum_c: float, sum_c2: float, n_tokens: float) -> float:
    """``sqrt(max(0, mmean(c^2) - mmean(c)^2))``; 0 with fewer than two tokens."""
    if n_tokens < 2:
        return 0.0
    return math.sqrt(max(0.0, mmean(sum_c2, n_tokens) - mmean(sum_c, n_tokens) ** 2))


def eff_sample_size(sum_c: float, sum_c2: float, n_tokens: float) -> float:
    """``1 / mmean((c / (mmean(c) + 1e-8))^2)``, at most 1 (equal weights give 1 up to the
    rounding of the ``1e-8``: 1.00000002, clamped); 0 when every weight is 0."""
    if sum_c2 <= 0.0:
        return 0.0
    mu = mmean(sum_c, n_tokens)
    return min(1.0, 1.0 / mmean(sum_c2 / (mu + EPS) ** 2, n_tokens))


def capped(value: float) -> tuple[float, bool]:
    """A finite version of ``value`` and whether it overflowed (+-inf -> +-FLOAT_MAX)."""
    if math.isinf(value):
        return math.copysign(FLOAT_MAX, value), True
    return value, False


def exp_capped(x: float) -> float:
    """``exp(x)``, ``FLOAT_MAX`` where it would overflow (the unclamped ``rollout_is_min``)."""
    return math.exp(x) if x < math.log(FLOAT_MAX) else FLOAT_MAX


@dataclass
class Counts:
    """Tokens and sequences seen so far: the denominators every module shares."""

    tokens: int = 0  # valid response tokens, N = sum(m)
    seqs: int = 0  # all sequences, S (empty ones included)
    valid_seqs: int = 0  # sequences with at least one valid token

    def update(self, b: TokenBatch) -> None:
        self.tokens += int(np.count_nonzero(b.m))
        self.seqs += b.num_seqs
        self.valid_seqs += int(np.count_nonzero(b.n > 0))

    def merge(self, other: Counts) -> None:
        merge_sums(self, other, ("tokens", "seqs", "valid_seqs"))

    def scalars(self) -> dict[str, float]:
        return {
            "num_tokens": float(self.tokens),
            "num_sequences": float(self.seqs),
            "num_valid_sequences": float(self.valid_seqs),
        }
