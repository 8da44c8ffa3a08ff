"""Mismatch attribution: the total log-ratio split into links between rungs (attribution spec).

Rungs are log-probabilities of the same sampled tokens, scored at points between the engine's
decode and the training forward pass (token-store columns, float32, nullable)::

    L0 rollout_logprob                 engine decode
    L1 engine_prefill_logprob          engine prefill, batched
    L2 engine_prefill_single_logprob   engine prefill, one sequence per engine step
    L3 train_rollout_dtype_logprob     transformers at the rollout dtype
    L4 train_logprob                   transformers at the training dtype
       (MoE, replay setting: L4 = train_no_replay_logprob, L4_replay = train_logprob)
    L5 stale_logprob                   transformers at the training dtype, later checkpoint

A link is ``r_link = upper - lower`` (``LINKS``), computed in float64 from the stored float32
values, so ``sum(links except staleness) = train_logprob - rollout_logprob`` per token up to
float64 rounding. A link *applies* to a setting when both of its rungs are present for at least
one valid token; a token enters a link when both rungs are non-null.

Per link, over its tokens: ``k3 = mmean(exp(r) - r - 1)`` (unclamped, capped at the largest
float64 like ``k3_kl``), ``mean_abs = mmean(|r|)``, ``p99_abs`` (nearest-rank 99th percentile of
``|r|`` from a log-spaced histogram: at most ``P99_RELATIVE_RESOLUTION`` above the exact value
from 1e-12 up, 0 when the rank falls on zeros, never above ``max_abs``), ``max_abs``,
``bitwise_identical_fraction`` (``mmean(r == 0)``) and ``share = mmean(r^2) / sum over
applying links of mmean(r_link^2)`` (cross terms left out: shares describe magnitudes, not a
variance split). ``dominant`` is the link of largest share, None when every link is exactly
zero.

The split depends on the path (another order of rungs splits the total differently); reports
say so. Memory is bounded: per (setting, link) a few sums and one fixed histogram.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_probe.metrics.accum import capped, mmean
from mismatch_probe.metrics.batch import LOGPROB_FLOOR, k3_terms
from mismatch_probe.store import (
    RUNG_FIELDS,
    iter_sequence_batches,
    open_parquet,
    resolve_tokens_path,
)
from mismatch_probe.store.arrays import numpy_of, valid_of

ROLLOUT, TRAIN = "rollout_logprob", "train_logprob"
RUNG_COLUMNS = tuple(f.name for f in RUNG_FIELDS)
PREFILL, PREFILL_SINGLE, TRAIN_ROLLOUT_DTYPE, STALE, NO_REPLAY = RUNG_COLUMNS
L4 = "_l4"  # derived rung: train_no_replay_logprob where present, else train_logprob


@dataclass(frozen=True)
class Link:
    """``r = rung[upper] - rung[lower]`` and what it isolates, in words."""

    name: str
    upper: str
    lower: str
    words: str


LINKS: tuple[Link, ...] = (
    Link("decode_vs_prefill", PREFILL, ROLLOUT, "engine decode vs prefill"),
    Link("batch", PREFILL_SINGLE, PREFILL, "batch composition in the engine"),
    Link("kernels", TRAIN_ROLLOUT_DTYPE, PREFILL_SINGLE, "engine vs transformers kernels"),
    Link("precision", L4, TRAIN_ROLLOUT_DTYPE, "rollout vs training dtype"),
    Link("routing", TRAIN, NO_REPLAY, "MoE routing disagreement (what replay changes)"),
    Link("staleness", STALE, L4, "policy drift between checkpoints"),
)
MISMATCH_LINKS = tuple(link.name for link in LINKS if link.name != "staleness")
LINK_STATS = ("k3", "mean_abs", "p99_abs", "max_abs", "bitwise_identical_fraction", "share")

# |r| histogram for p99: a zero bin, then log-spaced bins from 1e-12 to 1e4.
P99_QUANTILE = 0.99
P99_BINS_PER_DECADE = 256
P99_LOW, P99_HIGH = 1e-12, 1e4
P99_RELATIVE_RESOLUTION = 10 ** (1 / P99_BINS_PER_DECADE) - 1  # ~0.9 %
_NBINS = round(math.log10(P99_HIGH / P99_LOW) * P99_BINS_PER_DECADE)
_UPPER_EDGES = P99_LOW * 10 ** (np.arange(1, _NBINS + 1) / P99_BINS_PER_DECADE)


def abs_bin(x: np.ndarray) -> np.ndarray:
    """Histogram bin of each ``|r|`` (``[k] -> [k]``): 0 for exactly 0, else ``1 + i`` with
    ``i`` the first log-spaced bin whose upper edge is above ``x`` (exact comparisons, so a
    value is always below its bin's upper edge; values past ``P99_HIGH`` go to the last bin)."""
    i = np.minimum(np.searchsorted(_UPPER_EDGES, x, side="right"), _NBINS - 1)
    return np.where(x == 0.0, 0, 1 + i)


class LinkStats:
    """Streaming sums of one link over its tokens."""

    def __init__(self) -> None:
        self.n = 0
        self.sum_k3 = self.sum_abs = self.sum_sq = self.max_abs = 0.0
        self.n_zero = 0
        self.hist = np.zeros(_NBINS + 1, dtype=np.int64)

    def add(self, r: np.ndarray) -> None:
        """Merge the link's log-ratios ``r`` (``[k]`` float64, valid tokens only)."""
        if len(r) == 0:
            return
        a = np.abs(r)
        self.n += len(r)
        self.sum_k3 += float(k3_terms(r).sum())
        self.sum_abs += float(a.sum())
        self.sum_sq += float((r * r).sum())
        self.max_abs = max(self.max_abs, float(a.max()))
        self.n_zero += int((r == 0.0).sum())
        self.hist += np.bincount(abs_bin(a), minlength=_NBINS + 1)

    def p99(self) -> float:
        """Nearest-rank 99th percentile of ``|r|``: the upper edge of its bin, at most max."""
        rank = max(math.ceil(P99_QUANTILE * self.n), 1)
        b = int(np.searchsorted(np.cumsum(self.hist), rank))
        return 0.0 if b == 0 else min(float(_UPPER_EDGES[b - 1]), self.max_abs)

    def stats(self, total_sq: float) -> dict[str, float]:
        mean_sq = mmean(self.sum_sq, self.n)
        return {
            "k3": capped(mmean(self.sum_k3, self.n))[0],
            "mean_abs": mmean(self.sum_abs, self.n),
            "p99_abs": self.p99(),
            "max_abs": self.max_abs,
            "bitwise_identical_fraction": mmean(self.n_zero, self.n),
            "share": mean_sq / total_sq if total_sq > 0 else 0.0,
        }


def _rungs(table: pa.Table) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Column -> (float64 values with the log-prob floor, not-null mask ``[N]``), plus L4."""
    out = {}
    for name in (ROLLOUT, TRAIN, *RUNG_COLUMNS):
        if name in table.column_names:
            col = table.column(name)
            ok = valid_of(col)
            values = numpy_of(pc.cast(col, pa.float64()), null=0.0)
            out[name] = (np.maximum(values, LOGPROB_FLOOR), ok)
    train, train_ok = out[TRAIN]
    if NO_REPLAY in out:
        own, own_ok = out[NO_REPLAY]
        out[L4] = (np.where(own_ok, own, train), own_ok | train_ok)
    else:
        out[L4] = (train, train_ok)
    return out


def link_ratios(table: pa.Table) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per link present in ``table``: ``(r [N] float64, valid [N] bool)``; a row is valid when
    the token is a response token (L0 and ``train_logprob`` present) and both of the link's
    rungs are present and not NaN.
    """
    rungs = _rungs(table)
    token_ok = rungs[ROLLOUT][1] & rungs[TRAIN][1]
    out = {}
    for link in LINKS:
        if link.upper in rungs and link.lower in rungs:
            (hi, hi_ok), (lo, lo_ok) = rungs[link.upper], rungs[link.lower]
            ok = token_ok & hi_ok & lo_ok & np.isfinite(hi) & np.isfinite(lo)
            out[link.name] = (np.where(ok, hi - lo, 0.0), ok)
    return out


class AttributionAccumulator:
    """Per-link statistics of one setting."""

    def __init__(self) -> None:
        self.links = {link.name: LinkStats() for link in LINKS}

    def update(self, table: pa.Table) -> None:
        for name, (r, ok) in link_ratios(table).items():
            self.links[name].add(r[ok])

    def result(self) -> dict[str, Any]:
        """``{"links": {link: {stat: value}}, "dominant": link | None}`` (applying links only,
        in path order)."""
        applying = {name: s for name, s in self.links.items() if s.n > 0}
        total = sum(mmean(s.sum_sq, s.n) for s in applying.values())
        links = {name: s.stats(total) for name, s in applying.items()}
        dominant = max(links, key=lambda k: links[k]["share"]) if total > 0 else None
        return {"links": links, "dominant": dominant}


def has_rungs(names: Sequence[str]) -> bool:
    """True when a store's columns carry attribution rungs."""
    return all(c in names for c in (PREFILL, PREFILL_SINGLE, TRAIN_ROLLOUT_DTYPE))


def compute_attribution(path: Path | str) -> dict[str, dict[str, Any]]:
    """Attribution of every setting of a token store, in one streaming pass.

    Args:
        path: a run directory or token store with the rung columns (see ``has_rungs``).

    Returns:
        ``{setting: {"links": {...}, "dominant": ...}}`` in order of first appearance ("" for
        a store without a ``setting`` column); {} when the store has no rungs.
    """
    path = resolve_tokens_path(Path(path))
    names = open_parquet(path).schema_arrow.names
    if not has_rungs(names):
        return {}
    cols = [c for c in ("setting", ROLLOUT, TRAIN, *RUNG_COLUMNS) if c in names]
    acc: dict[str, AttributionAccumulator] = {}
    for table in iter_sequence_batches(path, cols):
        for setting, part in _by_setting(table):
            acc.setdefault(setting, AttributionAccumulator()).update(part)
    results = {setting: a.result() for setting, a in acc.items()}
    return {s: r for s, r in results.items() if r["links"]}


def _by_setting(table: pa.Table) -> list[tuple[str, pa.Table]]:
    if "setting" not in table.column_names:
        return [("", table)]
    values = pc.unique(table.column("setting")).to_pylist()
    return [(v, table.filter(pc.equal(table.column("setting"), v))) for v in values]
