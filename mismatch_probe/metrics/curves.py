"""Bounded-size curves for the reports stage, filled in the same single pass.

``to_json_dict()["curves"]`` holds (all sizes fixed, whatever the number of tokens):

* ``log_ratio_hist``: counts of ``r`` in ``LOG_RATIO_BINS`` equal bins over ``[-3, 3]`` plus
  ``underflow`` (``r < -3``) and ``overflow`` (``r > 3``);
* ``prob_hist2d``: ``PROB_HIST_BINS`` x ``PROB_HIST_BINS`` counts over ``[0, 1]^2``,
  ``counts[i][j]``: rollout probability in bin i, train probability in bin j (equal bins,
  1.0 in the last one);
* ``position_bins`` / ``rollout_prob_bins``: per bin of response position (``POSITION_EDGES``,
  last bin open) or of ``exp(rollout_lp)`` (``PROB_EDGES``): token count, mean ``r``, mean
  ``|r|``, mean ``k3(clampB(r))``, mean ``dp`` and the bin's share of the total ``|r|``;
* ``worst_tokens``: the ``WORST_TOKENS`` valid tokens of largest ``|r|`` (ties: smaller seq_id,
  then smaller position first);
* ``seq_log_ratio_vs_length``: least-squares line of ``s_i = msum_i(r)`` on the response length
  in thousands of tokens over valid sequences, plus up to ``SEQ_SAMPLE`` points: the sequences
  whose hashed seq_id is smallest (a reservoir that does not depend on row order or batching).

The slope is also the flat key ``seq_log_ratio_slope_per_1k``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.accum import (
    CoMoments,
    Counts,
    merge_sums,
    uniform_bounds,
    uniform_slots,
)
from mismatch_probe.metrics.batch import (
    TokenBatch,
    abs_prob_diff,
    abs_r,
    clamped_k3,
    probs,
    seg_max,
    valid,
)
from mismatch_probe.metrics.compiled import loops

LOG_RATIO_RANGE = (-3.0, 3.0)
LOG_RATIO_BINS = 121
PROB_HIST_BINS = 50
POSITION_EDGES = (0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
PROB_EDGES = (0.0, 0.001, 0.01, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)
WORST_TOKENS = 10
SEQ_SAMPLE = 2000
_BIN_SUMS = ("log_ratio", "abs_log_ratio", "k3", "prob_abs_diff")


def bin_index(values: np.ndarray, edges: tuple[float, ...], open_last: bool) -> np.ndarray:
    """Bin of each value: ``edges[i] <= x < edges[i+1]``; the last bin takes the rest."""
    nbins = len(edges) if open_last else len(edges) - 1
    return np.clip(np.searchsorted(edges, values, side="right") - 1, 0, nbins - 1)


def _position_lookup() -> np.ndarray:
    """``bin_index`` of every position ``0 .. POSITION_EDGES[-1]`` (a position beyond is in the
    open last bin, as the last entry)."""
    return bin_index(np.arange(POSITION_EDGES[-1] + 1), POSITION_EDGES, open_last=True)


_POSITION_BIN = _position_lookup()
# bin i: [bounds[i], bounds[i+1]); the last bin's upper bound is never reached (NaN: even +inf
# stays in it, as bin_index clips)
_PROB_BOUNDS = np.array([-np.inf, *PROB_EDGES[1:-1], np.nan])
_PROB_SCALE = 1000  # every PROB_EDGES entry is a multiple of 1/1000
_PROB_GUESS = bin_index(np.arange(_PROB_SCALE + 1) / _PROB_SCALE, PROB_EDGES, open_last=False)


def position_bin(position: np.ndarray) -> np.ndarray:
    """``bin_index(position, POSITION_EDGES, open_last=True)`` by table lookup."""
    return _POSITION_BIN.take(np.clip(position, 0, POSITION_EDGES[-1]))


def prob_bin(p: np.ndarray) -> np.ndarray:
    """``bin_index(p, PROB_EDGES, open_last=False)`` for probabilities: the bin of
    ``floor(1000 p) / 1000`` (off by at most one bin where ``1000 p`` rounds across an integer),
    corrected by comparing with the edges themselves (the first and last bins unbounded, as
    ``bin_index`` clips)."""
    guess = np.clip(p * _PROB_SCALE, 0.0, float(_PROB_SCALE)).astype(np.intp)
    idx = _PROB_GUESS.take(guess)
    idx -= p < _PROB_BOUNDS.take(idx)
    idx += p >= _PROB_BOUNDS[1:].take(idx)  # _PROB_BOUNDS[idx + 1]
    return idx


def prob_hist2d(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``[B, B]`` counts of pairs in ``[0, 1]^2``: bin ``min(floor(v * B), B - 1)`` per axis
    (``v`` clipped to ``[0, 1]``: the same bin as ``floor(clip(v * B, 0, B - 1))``)."""
    nb = PROB_HIST_BINS
    ix = np.clip(x * nb, 0.0, nb - 1.0).astype(np.intp)
    iy = np.clip(y * nb, 0.0, nb - 1.0).astype(np.intp)
    ix *= nb
    ix += iy
    return np.bincount(ix, minlength=nb * nb).reshape(nb, nb)


def seq_hash(seq_id: np.ndarray) -> np.ndarray:
    """splitmix64 of int64 ids (``[k]`` -> ``[k]`` uint64): an order-free sampling key."""
    z = seq_id.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class BinnedStats:
    """Counts and sums of ``_BIN_SUMS`` per bin."""

    def __init__(self, edges: tuple[float, ...], open_last: bool) -> None:
        self.edges, self.open_last = edges, open_last
        self.nbins = len(edges) if open_last else len(edges) - 1
        self.count = np.zeros(self.nbins, dtype=np.int64)
        self.sums = {name: np.zeros(self.nbins) for name in _BIN_SUMS}

    @staticmethod
    def add_crossed(rows: BinnedStats, cols: BinnedStats, count: np.ndarray,
                    sums: dict[str, np.ndarray]) -> None:  # fmt: skip
        """Add one table over the crossed bins (``[rows.nbins, cols.nbins]`` counts and sums of
        each of ``_BIN_SUMS``): ``rows`` gets its row margins, ``cols`` its column margins."""
        rows.count += count.sum(axis=1)
        cols.count += count.sum(axis=0)
        for name, table in sums.items():
            rows.sums[name] += table.sum(axis=1)
            cols.sums[name] += table.sum(axis=0)

    def merge(self, other: BinnedStats) -> None:
        self.count = self.count + other.count
        for name in _BIN_SUMS:
            self.sums[name] = self.sums[name] + other.sums[name]

    def rows(self) -> list[dict[str, Any]]:
        total = float(self.sums["abs_log_ratio"].sum())
        out = []
        for i in range(self.nbins):
            k = int(self.count[i])
            row: dict[str, Any] = {
                "lo": self.edges[i],
                "hi": self.edges[i + 1] if i + 1 < len(self.edges) else None,
                "count": k,
            }
            row.update({f"mean_{n}": float(self.sums[n][i]) / k if k else 0.0 for n in _BIN_SUMS})
            share = float(self.sums["abs_log_ratio"][i]) / total if total else 0.0
            row["abs_log_ratio_share"] = share
            out.append(row)
        return out


class CurvesAccumulator:
    """Streams the histograms, binned tables, worst tokens and the length regression."""

    def __init__(self) -> None:
        self.hist = np.zeros(LOG_RATIO_BINS, dtype=np.int64)
        self.under = self.over = 0
        self.hist2d = np.zeros((PROB_HIST_BINS, PROB_HIST_BINS), dtype=np.int64)
        self.by_position = BinnedStats(POSITION_EDGES, open_last=True)
        self.by_prob = BinnedStats(PROB_EDGES, open_last=False)
        self.worst: list[dict[str, Any]] = []
        self.line = CoMoments()  # (length / 1000, s_i) over valid sequences
        self.sample = (np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))

    def update(self, b: TokenBatch) -> None:
        p_train, p_rollout = probs(b, None)
        tables = token_tables(TokenColumns(
            r=valid(b, b.r), abs_r=valid(b, abs_r(b, None)), k3=valid(b, clamped_k3(b, None)),
            dp=valid(b, abs_prob_diff(b, None)), p_rollout=valid(b, p_rollout),
            p_train=valid(b, p_train), position=valid(b, b.position)))  # fmt: skip
        self.hist += tables.slots[1 : LOG_RATIO_BINS + 1]
        self.under += int(tables.slots[0])
        self.over += int(tables.slots[LOG_RATIO_BINS + 1 :].sum())
        self.hist2d += tables.hist2d
        BinnedStats.add_crossed(self.by_position, self.by_prob, tables.tokens, tables.sums)
        self._update_worst(b)
        self._update_line(b)

    def _update_worst(self, b: TokenBatch) -> None:
        rows = _worst_candidates(b)
        abs_lr = abs_r(b, None)[rows]
        if len(rows) > WORST_TOKENS:  # keep every row tied with the k-th largest |r|
            kth = np.partition(abs_lr, len(rows) - WORST_TOKENS)[len(rows) - WORST_TOKENS]
            rows, abs_lr = rows[abs_lr >= kth], abs_lr[abs_lr >= kth]
        seq_ids = b.seq_id[b.seg[rows]]
        order = np.lexsort((b.position[rows], seq_ids, -abs_lr))[:WORST_TOKENS]
        candidates = [_token_record(b, int(row)) for row in rows[order]]
        merged = sorted(self.worst + candidates, key=_worst_key)
        self.worst = merged[:WORST_TOKENS]

    def _update_line(self, b: TokenBatch) -> None:
        valid = b.n > 0
        length, s = b.n[valid], b.s[valid]
        self.line.add(length / 1000.0, s)
        batch = (seq_hash(b.seq_id[valid]), b.seq_id[valid], length, s)
        self.sample = _keep_sample(self.sample, batch)

    def merge(self, other: CurvesAccumulator) -> None:
        merge_sums(self, other, ("hist", "under", "over", "hist2d"))
        self.by_position.merge(other.by_position)
        self.by_prob.merge(other.by_prob)
        self.worst = sorted(self.worst + other.worst, key=_worst_key)[:WORST_TOKENS]
        self.line.merge(other.line)
        self.sample = _keep_sample(self.sample, other.sample)

    def scalars(self, counts: Counts) -> dict[str, float]:
        return {"seq_log_ratio_slope_per_1k": self.line.slope()}

    def read_token_ids(self, read: Callable[[list[int]], list[Any]]) -> None:
        """Fill the worst tokens' ``token_id`` where the pass read locators instead
        (``read``: the store's values at those locators, ``store.read_rows``).

        Raises:
            ProbeError: a null token id (the pass would have refused the column).
        """
        pending = [rec for rec in self.worst if _ROW_KEY in rec]
        for rec, token in zip(pending, read([rec[_ROW_KEY] for rec in pending]), strict=True):
            if token is None:
                raise ProbeError("column token_id holds nulls")
            rec["token_id"] = int(token)
            del rec[_ROW_KEY]

    def curves(self, counts: Counts) -> dict[str, Any]:
        _, ids, lengths, sums = self.sample
        order = np.argsort(ids, kind="stable")
        return {
            "log_ratio_hist": {
                "lo": LOG_RATIO_RANGE[0],
                "hi": LOG_RATIO_RANGE[1],
                "counts": self.hist.tolist(),
                "underflow": self.under,
                "overflow": self.over,
            },
            "prob_hist2d": {"x": "rollout_prob", "y": "train_prob", "counts": self.hist2d.tolist()},
            "position_bins": self.by_position.rows(),
            "rollout_prob_bins": self.by_prob.rows(),
            "worst_tokens": self.worst,
            "seq_log_ratio_vs_length": {
                "slope_per_1k": self.line.slope(),
                "intercept": self.line.intercept() if self.line.n else 0.0,
                "seq_id": ids[order].tolist(),
                "length": lengths[order].astype(int).tolist(),
                "log_ratio_sum": sums[order].tolist(),
            },
        }


class TokenColumns(NamedTuple):
    """The valid tokens of a batch, ``[N]`` each (float64; ``position`` int64)."""

    r: np.ndarray
    abs_r: np.ndarray
    k3: np.ndarray  # k3(clampB(r))
    dp: np.ndarray  # |prob(train) - prob(rollout)|
    p_rollout: np.ndarray
    p_train: np.ndarray
    position: np.ndarray


class TokenTables(NamedTuple):
    """What ``CurvesAccumulator`` counts of a batch's tokens."""

    slots: np.ndarray  # [LOG_RATIO_BINS + 3] ``uniform_slots`` of r
    hist2d: np.ndarray  # [PROB_HIST_BINS, PROB_HIST_BINS] ``prob_hist2d``
    tokens: np.ndarray  # [position bins, probability bins] token counts
    sums: dict[str, np.ndarray]  # each of _BIN_SUMS, per crossed bin


_CROSSED = (len(POSITION_EDGES), len(PROB_EDGES) - 1)
_HIST = uniform_bounds(LOG_RATIO_BINS, *LOG_RATIO_RANGE)
# the histogram's inner bounds as np.linspace computes them (the loop checks they are), and
# the inner edges of the crossed table's bins
_HIST_LINE = (LOG_RATIO_RANGE[0], (LOG_RATIO_RANGE[1] - LOG_RATIO_RANGE[0]) / LOG_RATIO_BINS)
_INNER_EDGES = (np.array(POSITION_EDGES[1:], np.int64), np.array(PROB_EDGES[1:-1]))


def token_tables(t: TokenColumns, compiled: bool = True) -> TokenTables:
    """The histograms and the table over crossed (position, rollout probability) bins of the
    tokens ``t``: one compiled pass (``_kernels.curves``) where the package has it and
    ``compiled``, else the numpy calls (the same bits: bins by the same comparisons, sums in
    row order as ``bincount`` adds them)."""
    kernels = loops(compiled)
    if kernels is None:
        return _token_tables_numpy(t)
    slots = np.zeros(LOG_RATIO_BINS + 3, dtype=np.int64)
    hist2d = np.zeros((PROB_HIST_BINS, PROB_HIST_BINS), dtype=np.int64)
    tokens = np.zeros(_CROSSED, dtype=np.int64)
    sums = np.zeros((len(_BIN_SUMS), *_CROSSED))
    columns = [np.ascontiguousarray(x, dtype=np.float64) for x in t[:6]]
    position = np.ascontiguousarray(t.position, dtype=np.int64)
    kernels.curves(*columns, position, *_HIST, *_HIST_LINE, *_INNER_EDGES, PROB_HIST_BINS,
                   slots, hist2d, tokens, sums)  # fmt: skip
    return TokenTables(slots, hist2d, tokens, dict(zip(_BIN_SUMS, sums, strict=True)))


def _token_tables_numpy(t: TokenColumns) -> TokenTables:
    cell = position_bin(t.position) * _CROSSED[1]
    cell += prob_bin(t.p_rollout)
    size = _CROSSED[0] * _CROSSED[1]
    values = (t.r, t.abs_r, t.k3, t.dp)
    sums = {name: np.bincount(cell, weights=v, minlength=size).reshape(_CROSSED)
            for name, v in zip(_BIN_SUMS, values, strict=True)}  # fmt: skip
    return TokenTables(
        slots=uniform_slots(t.r, LOG_RATIO_BINS, *LOG_RATIO_RANGE),
        hist2d=prob_hist2d(t.p_rollout, t.p_train),
        tokens=np.bincount(cell, minlength=size).reshape(_CROSSED),
        sums=sums,
    )


def _worst_candidates(b: TokenBatch) -> np.ndarray:
    """The valid rows that can be among the batch's ``WORST_TOKENS`` of largest ``|r|`` (every
    row tied with the last of them included): those at or above the ``WORST_TOKENS``-th largest
    of the sequences' largest ``|r|``. At least ``WORST_TOKENS`` valid rows reach that value
    (one in each of those sequences), so the ``WORST_TOKENS``-th largest ``|r|`` of the batch is
    no smaller, and a partial sort of the few candidates finds what one of every row would."""
    abs_lr = abs_r(b, None)
    seq_max = seg_max(b, abs_lr)[b.n > 0]
    if len(seq_max) <= WORST_TOKENS:
        return np.flatnonzero(b.m)
    floor = np.partition(seq_max, len(seq_max) - WORST_TOKENS)[len(seq_max) - WORST_TOKENS]
    reach = abs_lr >= floor
    return np.flatnonzero(reach if b.all_valid else reach & b.m)


Sample = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _keep_sample(held: Sample, new: Sample) -> Sample:
    """The ``SEQ_SAMPLE`` sequences of smallest hash among ``held`` then ``new`` (each
    ``(keys, seq_ids, lengths, log-ratio sums)``); ties keep that order."""
    keys, ids, lengths, sums = (np.concatenate([a, b]) for a, b in zip(held, new, strict=True))
    keep = np.argsort(keys, kind="stable")[:SEQ_SAMPLE]
    return (keys[keep], ids[keep], lengths[keep], sums[keep])


def _token_record(b: TokenBatch, row: int) -> dict[str, Any]:
    record = {
        "seq_id": int(b.seq_id[b.seg[row]]),
        "position": int(b.position[row]),
        "token_id": int(b.token_id[row]) if b.token_id is not None else None,
        "log_ratio": float(b.r[row]),
        "train_logprob": float(b.train[row]),
        "rollout_logprob": float(b.rollout[row]),
        "support_flip": bool(b.flip[row]) if b.flip is not None else None,
    }
    if b.token_id is None and b.row is not None:  # its token id is read at the end
        record[_ROW_KEY] = int(b.row[row])
    return record


_ROW_KEY = "_row"  # a worst token's locator until ``read_token_ids`` replaces it


def _worst_key(rec: dict[str, Any]) -> tuple[float, int, int]:
    return (-abs(rec["log_ratio"]), rec["seq_id"], rec["position"])
