"""Token batches: whole sequences, flattened, plus the per-sequence reductions over them.

A ``TokenBatch`` holds the rows of one or more *complete* sequences (``iter_sequence_batches``
guarantees it), one array entry per row, rows of a sequence contiguous. Every metric module
works on these flat ``[N]`` arrays and reduces per sequence with ``seg_sum`` / ``seg_mean`` /
``seg_max`` into ``[S_b]`` arrays (``S_b`` = sequences in the batch).

Input rules, shared with the dense reference (``normalize_logprobs``):

* a row whose ``train_logprob`` or ``rollout_logprob`` is null is padding (``m = 0``); a
  sequence whose rows are all padding is an *empty* sequence (counted, not valid);
* log-probabilities below ``LOGPROB_FLOOR`` (-9999, vLLM's JSON floor), ``-inf`` included, are
  read as the floor, so every log-ratio is finite; NaN or ``+inf`` is an error;
* probabilities (for the ``dp`` diagnostics) are ``prob(lp) = exp(min(lp, 0))``; the log-ratio
  metrics use the log-probs as given.

Sign convention: ``r = train_logprob - rollout_logprob`` (log of rho = train / rollout).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_probe.errors import ProbeError
from mismatch_probe.store import ROW_COLUMN
from mismatch_probe.store.arrays import numpy_of, valid_of

LOGPROB_FLOOR = -9999.0
SAFETY_BOUND = 20.0  # verl's B: exp of a log-ratio goes through clamp(x, -B, B)
EPS = 1e-8  # verl's masked_mean denominator guard


class TokenBatch(NamedTuple):
    """Whole sequences, flat. Shapes: ``[N]`` rows, ``[S_b]`` sequences.

    Attributes:
        train: ``[N]`` float64 training-side log-probs (0 at padding).
        rollout: ``[N]`` float64 rollout log-probs (0 at padding).
        r: ``[N]`` float64 ``train - rollout`` (0 at padding).
        m: ``[N]`` bool, True for a real response token.
        seg: ``[N]`` int64 index of the row's sequence in the batch.
        starts: ``[S_b]`` int64 first row of each sequence.
        n: ``[S_b]`` float64 valid tokens per sequence.
        s: ``[S_b]`` float64 ``s_i = msum_i(r)``, the sequence log-ratio.
        seq_id: ``[S_b]`` int64 ``seq_id`` of each sequence.
        position: ``[N]`` int64 response position of each row.
        flip: ``[N]`` bool support-flip flags, or None when the store has no such column.
        token_id: ``[N]`` int64 token ids, or None.
        memo: results of ``per_batch`` functions on this batch (filled lazily).
        prompt_id: ``[S_b]`` int64 ``prompt_id`` of each sequence, or None.
        sample_id: ``[S_b]`` int64 ``sample_id`` of each sequence, or None.
        entropy: ``[N]`` float64 ``train_entropy`` (nats; NaN where null or padding), or None
            when the store has no such column.
        all_valid: True when ``m`` is True everywhere (the common case: a store without
            padding), so the valid rows are the arrays themselves, no copy.
        row: ``[N]`` int64 each row's place in the store (``store.ROW_COLUMN``), or None: read
            in place of ``token_id``, whose few values the outputs name are read afterwards.
    """

    train: np.ndarray
    rollout: np.ndarray
    r: np.ndarray
    m: np.ndarray
    seg: np.ndarray
    starts: np.ndarray
    n: np.ndarray
    s: np.ndarray
    seq_id: np.ndarray
    position: np.ndarray
    flip: np.ndarray | None
    token_id: np.ndarray | None
    memo: dict[Any, Any]
    prompt_id: np.ndarray | None = None
    sample_id: np.ndarray | None = None
    entropy: np.ndarray | None = None
    all_valid: bool = False  # every row is a valid token (no padding): ``valid(b, x)`` is ``x``
    row: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.starts)


def normalize_logprobs(
    values: np.ndarray, valid: np.ndarray, name: str, all_valid: bool = False
) -> np.ndarray:
    """Float64 copy of ``values`` with the floor applied and padding set to 0 (``all_valid``:
    ``valid`` is True everywhere, so there is no padding to zero).

    Raises:
        ProbeError: a valid entry is NaN or ``+inf``.
    """
    x = np.asarray(values, dtype=np.float64)
    if all_valid:  # the largest value finds NaN (it propagates) and +inf, the smallest the floor
        if not x.max(initial=-np.inf) < np.inf:
            raise ProbeError(
                f"{name} holds NaN or +inf in a response token (data integrity: nonfinite_logprob)"
            )
        if x.min(initial=0.0) >= LOGPROB_FLOOR:  # the floor changes nothing (the usual case)
            return x.copy() if x is values else x
        return np.maximum(x, LOGPROB_FLOOR)
    bad = valid & (np.isnan(x) | (x == np.inf))
    if bad.any():
        raise ProbeError(
            f"{name} holds NaN or +inf in a response token (data integrity: nonfinite_logprob)"
        )
    with np.errstate(invalid="ignore"):
        return np.where(valid, np.maximum(x, LOGPROB_FLOOR), 0.0)


def _column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Values (nulls as NaN) and the not-null mask of a numeric column."""
    col = table.column(name)
    valid = valid_of(col)
    if pa.types.is_floating(col.type):  # the store's float32: no Arrow cast, one numpy copy
        return numpy_of(col, null=np.nan), valid
    try:
        values = numpy_of(pc.cast(col, pa.float64()), null=np.nan)
    except pa.ArrowInvalid as exc:
        raise ProbeError(f"column {name} does not hold numbers ({exc})") from None
    return values, valid


_FAST_INTS = (pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32())


def int_column(table: pa.Table, name: str) -> np.ndarray:
    """``[N]`` int64 values of an integer column.

    Raises:
        ProbeError: the column holds nulls, or a value int64 cannot hold (a uint64 beyond it).
    """
    col = table.column(name)
    if col.null_count:
        raise ProbeError(f"column {name} holds nulls")
    if col.type in _FAST_INTS:  # every value fits int64: a numpy cast
        return np.asarray(numpy_of(col), dtype=np.int64)
    try:
        return np.asarray(numpy_of(pc.cast(col, pa.int64())), dtype=np.int64)
    except pa.ArrowInvalid as exc:  # e.g. a uint64 beyond int64
        raise ProbeError(f"column {name} does not hold int64 integers ({exc})") from None


def _bool_column(table: pa.Table, name: str) -> np.ndarray:
    """``[N]`` bool, nulls as False."""
    col = table.column(name)
    return np.asarray(numpy_of(col, null=False), dtype=bool)


def batch_from_table(table: pa.Table) -> TokenBatch:
    """A pyarrow table of whole, contiguous sequences -> ``TokenBatch``.

    Reads ``seq_id``, ``position``, ``train_logprob``, ``rollout_logprob`` and, when present,
    ``support_flip``, ``token_id``, ``prompt_id``, ``sample_id``, ``train_entropy`` and the
    rows' locators (``store.ROW_COLUMN``).
    """
    seq = int_column(table, "seq_id")
    train_raw, train_ok = _column(table, "train_logprob")
    rollout_raw, rollout_ok = _column(table, "rollout_logprob")
    m = train_ok & rollout_ok
    all_valid = bool(m.all())
    train = normalize_logprobs(train_raw, m, "train_logprob", all_valid)
    rollout = normalize_logprobs(rollout_raw, m, "rollout_logprob", all_valid)
    r = train - rollout
    starts = sequence_starts(seq)
    lengths = np.diff(np.append(starts, len(seq)))
    seg = np.repeat(np.arange(len(starts), dtype=np.int64), lengths)
    n = lengths.astype(np.float64) if all_valid else np.add.reduceat(m.astype(np.float64), starts)
    names = table.column_names
    flip = _bool_column(table, "support_flip") if "support_flip" in names else None
    token_id = int_column(table, "token_id") if "token_id" in names else None
    ids = {k: int_column(table, k)[starts] for k in ("prompt_id", "sample_id") if k in names}
    return TokenBatch(
        train=train,
        rollout=rollout,
        r=r,
        m=m,
        seg=seg,
        starts=starts,
        n=n,
        s=seq_sums(r, starts),  # r is 0 at padding
        seq_id=seq[starts],
        position=int_column(table, "position"),
        flip=flip,
        token_id=token_id,
        memo={},
        prompt_id=ids.get("prompt_id"),
        sample_id=ids.get("sample_id"),
        entropy=_entropy_column(table, m) if _holds_values(table, "train_entropy") else None,
        all_valid=all_valid,
        row=int_column(table, ROW_COLUMN) if ROW_COLUMN in names else None,
    )


def _holds_values(table: pa.Table, name: str) -> bool:
    """Whether ``table`` has the column ``name`` with a value that is not null (an ingested
    run's ``train_entropy`` is null throughout: its logs hold no logits)."""
    return name in table.column_names and table.column(name).null_count < table.num_rows


def _entropy_column(table: pa.Table, m: np.ndarray) -> np.ndarray:
    """``[N]`` float64 ``train_entropy``, NaN where null, non-finite or padding."""
    values, ok = _column(table, "train_entropy")
    values = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(ok & m & np.isfinite(values), values, np.nan)


def prob(logprob: np.ndarray) -> np.ndarray:
    """Probabilities ``exp(min(lp, 0))``: a (noisy) positive log-prob counts as probability 1.
    Where no log-prob is positive (the usual case: one reduction finds it) the minimum is the
    log-prob itself, so ``exp(lp)`` gives the same bits without the extra pass."""
    if len(logprob) and logprob.max() <= 0.0:
        return np.exp(logprob)
    return np.exp(np.minimum(logprob, 0.0))


def sequence_starts(seq: np.ndarray) -> np.ndarray:
    """``[S]`` int64 first row of each run of equal ``seq`` ids (``[0]`` for no rows)."""
    return np.concatenate([[0], np.flatnonzero(seq[1:] != seq[:-1]) + 1]).astype(np.int64)


def seq_sums(x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``[N] -> [S_b]`` sum over each sequence's rows (contiguous; none empty, except the one
    "sequence" of a table without rows)."""
    return np.add.reduceat(x, starts) if len(x) else np.zeros(len(starts))


def valid(b: TokenBatch, x: np.ndarray) -> np.ndarray:
    """``x`` at the valid rows only: ``x`` itself (no copy) when every row is valid."""
    return x if b.all_valid else x[b.m]


def seg_sum(b: TokenBatch, x: np.ndarray) -> np.ndarray:
    """``msum_i(x)``: ``[N] -> [S_b]`` sum over each sequence's valid tokens."""
    return seq_sums(x if b.all_valid else np.where(b.m, x, 0.0), b.starts)


def seg_mean(b: TokenBatch, x: np.ndarray) -> np.ndarray:
    """``mmean_i(x) = msum_i(x) / (n_i + 1e-8)``: ``[N] -> [S_b]`` (0 for an empty sequence)."""
    return seg_sum(b, x) / (b.n + EPS)


def seg_max(b: TokenBatch, x: np.ndarray) -> np.ndarray:
    """``[N] -> [S_b]`` max over each sequence's valid tokens (0 for an empty sequence)."""
    if b.all_valid and len(x):
        return np.maximum.reduceat(x, b.starts)
    out = np.maximum.reduceat(np.where(b.m, x, -np.inf), b.starts)
    return np.where(b.n > 0, out, 0.0)


def seg_min(b: TokenBatch, x: np.ndarray) -> np.ndarray:
    """``[N] -> [S_b]`` min over each sequence's valid tokens (0 for an empty sequence)."""
    if b.all_valid and len(x):
        return np.minimum.reduceat(x, b.starts)
    out = np.minimum.reduceat(np.where(b.m, x, np.inf), b.starts)
    return np.where(b.n > 0, out, 0.0)


def distinct_sorted(labels: np.ndarray) -> int:
    """Number of distinct values of a non-decreasing array."""
    return int(np.count_nonzero(labels[1:] != labels[:-1])) + 1 if len(labels) else 0


def distinct_values(x: np.ndarray) -> np.ndarray:
    """``np.unique(x)``: the distinct values, ascending; without a sort when all are equal
    (a batch of one step, of one turn)."""
    if len(x) and x.min() == x.max():
        return np.unique(x[:1])
    return np.unique(x)


def count(mask: np.ndarray) -> int:
    """Number of True entries of a bool array (``count_nonzero``: no int64 sum)."""
    return int(np.count_nonzero(mask))


def clamp_b(x: np.ndarray) -> np.ndarray:
    """``clampB(x) = clamp(x, -B, B)`` with verl's safety bound ``B = 20``."""
    return np.clip(x, -SAFETY_BOUND, SAFETY_BOUND)


T = TypeVar("T")


def per_batch(fn: Callable[[TokenBatch, Any], T]) -> Callable[[TokenBatch, Any], T]:
    """Memoise ``fn(batch, spec)`` on the batch (``spec`` hashable): the presets, IS and RS
    modules ask for the same weights and statistics; each is computed once per batch.
    Callers must not modify the arrays they get back."""

    @functools.wraps(fn)
    def cached(b: TokenBatch, spec: Any) -> T:
        key = (fn.__name__, spec)
        if key not in b.memo:
            b.memo[key] = fn(b, spec)
        return b.memo[key]

    return cached


# Per-token arrays several modules need, computed once per batch (callers must not modify them).


@per_batch
def within_bound(b: TokenBatch, _: None = None) -> bool:
    """True when every ``|r| <= B`` (the usual case): ``clampB`` changes nothing, so the
    clamped and unclamped per-token arrays are the same values and are computed once."""
    abs_lr = abs_r(b, None)
    return not len(abs_lr) or float(abs_lr.max()) <= SAFETY_BOUND


@per_batch
def clamped_r(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[N]`` ``clampB(r)`` (``r`` itself when ``within_bound``)."""
    return b.r if within_bound(b, None) else clamp_b(b.r)


def k3_terms(r: np.ndarray) -> np.ndarray:
    """Per-token ``exp(r) - r - 1`` (as ``expm1(r) - r``); ``+inf`` where ``exp(r)`` overflows."""
    with np.errstate(over="ignore"):
        return np.expm1(r) - r


@per_batch
def batch_k3(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[N]`` ``k3_terms(r)``, unclamped (the per-turn metrics and ``clamped_k3`` share it)."""
    return k3_terms(b.r)


@per_batch
def clamped_k3(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[N]`` ``k3_terms(clampB(r))``: ``batch_k3`` itself when ``within_bound`` (the same
    inputs, so the same bits)."""
    return batch_k3(b, None) if within_bound(b, None) else k3_terms(clamped_r(b, None))


@per_batch
def clamped_rho(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[N]`` ``rho = exp(clampB(r))`` (1 at padding)."""
    return np.exp(clamped_r(b, None))


@per_batch
def abs_r(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[N]`` ``|r|``."""
    return np.abs(b.r)


@per_batch
def probs(b: TokenBatch, _: None = None) -> tuple[np.ndarray, np.ndarray]:
    """``([N], [N])`` ``prob(train)``, ``prob(rollout)``."""
    return prob(b.train), prob(b.rollout)


@per_batch
def abs_prob_diff(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[N]`` ``|prob(train) - prob(rollout)|``."""
    p_train, p_rollout = probs(b, None)
    return np.abs(p_train - p_rollout)


@per_batch
def valid_float(b: TokenBatch, _: None = None) -> np.ndarray:
    """``[N]`` float64 1.0 at valid rows, 0.0 at padding."""
    return b.m.astype(np.float64)


@per_batch
def positions_ascending(b: TokenBatch, _: None = None) -> bool:
    """True when each sequence's rows come in non-decreasing position order (our writers'
    order), so a sequence's first row by position is its first row."""
    if len(b.position) < 2:
        return True
    ok = b.position[1:] >= b.position[:-1]
    ok[b.starts[1:] - 1] = True  # a sequence's first row may start lower than the one before
    return bool(ok.all())


def first_rows(b: TokenBatch, rows: np.ndarray) -> np.ndarray:
    """``[N]`` bool: among ``rows``, the one of smallest position in each sequence (ties: the
    first in row order)."""
    if rows is b.m:
        return first_valid_rows(b, None)
    return _first_rows(b, rows)


@per_batch
def first_valid_rows(b: TokenBatch, _: None = None) -> np.ndarray:
    """``first_rows(b, b.m)``: each valid sequence's first valid token (by position)."""
    if b.all_valid and positions_ascending(b, None):  # each sequence's first row
        first = np.zeros(len(b.m), dtype=bool)
        first[b.starts[b.n > 0]] = True
        return first
    return _first_rows(b, b.m)


@per_batch
def first_valid_index(b: TokenBatch, _: None = None) -> np.ndarray:
    """``np.flatnonzero(first_valid_rows(b))``: the rows of each valid sequence's first valid
    token, ascending (each sequence's first row where every row is valid and in order)."""
    if b.all_valid and positions_ascending(b, None):
        return b.starts[b.n > 0]
    return np.flatnonzero(first_valid_rows(b, None))


def _first_rows(b: TokenBatch, rows: np.ndarray) -> np.ndarray:
    idx = np.flatnonzero(rows)
    first = np.zeros(len(rows), dtype=bool)
    if not len(idx):
        return first
    if not positions_ascending(b, None):
        idx = idx[np.lexsort((b.position[idx], b.seg[idx]))]
    seg = b.seg[idx]
    first[idx[np.r_[True, seg[1:] != seg[:-1]]]] = True
    return first
