"""Data integrity: were the two sides aligned at all? (metrics spec section 8)

Checked before any number is believed, for every run (scans and ingested logs), in one
streaming pass over the token store (``store.iter_sequence_batches``: whole sequences per batch,
memory bounded by a batch plus fixed-size counts per training step):

* ``placeholder_logprob``: valid tokens where one side is exactly ``0.0`` and the other below
  ``ln 0.5`` (a dummy 0.0 on observation or injected tokens); a warning below 1% of the valid
  tokens, an error at or above;
* ``shifted_by_one``: ``L(k)`` = mean ``|train_lp[t] - rollout_lp[t+k]|`` over pairs of valid
  tokens ``t, t+k`` of one sequence, pooled, for k in {-1, 0, +1}; an error when
  ``min(L(-1), L(+1)) < 0.5 * L(0)`` and ``L(0) > 0.05``; ``sequences`` counts the sequences for
  which the same test holds on their own pairs. The three means run over the same training
  tokens t (the interior ones: those whose t-1 and t+1 are valid tokens of the sequence), so that
  one outlying first or last token, counted in ``L(0)`` but missing from one of ``L(+-1)``,
  cannot look like a shift; ``tokens`` is the number of such t;
* ``trainer_copies_rollout``: on an ingested run, every valid token bitwise identical (at
  least 100 tokens), or at least 5% of the sequences of at least 8 valid tokens each identical
  throughout: a warning (verl's bypass mode copies ``rollout_log_probs`` into ``old_log_probs``);
* ``implausible_logprob``: a finite log-prob below ``-1e4`` on a valid token (a placeholder such
  as -1e9 or ``finfo.min``): an error;
* ``positive_logprob``: any log-prob above ``1e-6``: an error;
* ``nonfinite_logprob``: NaN or infinite log-prob on a valid token: an error. A training-side
  ``-inf`` on a token flagged ``support_flip`` is not counted: the scan's rescorer gives ``-inf``
  to a sampled token outside the training side's top-k/top-p set, a measurement (the metric
  engine reads it as the -9999 floor), not a broken value;
* ``mask_rule``: a format-specific mask the ingest reader could not apply (run metadata
  ``mask_rules``: ``[{"rule", "applied", "detail"}]``): a warning; the masks it applied are
  listed beside the findings (``masks_applied``), not as findings.
* ``temperature_mismatch`` and ``truncated_support``: the misaligned sampling settings, in
  ``metrics.sampling_checks`` (fed here, batch by batch, by ``IntegrityAccumulator.update``).

**Partial faults count** (spec section 8, amended): a check fires when it holds pooled, or on at
least 5% of the valid sequences (at least 2: ``IntegrityAccumulator.partial``), or in any step
of a store with a ``step`` column; every finding carries ``share`` (its sequences, of the valid
sequences) and ``steps`` (the steps it holds in; None without steps). A step's finding is a
finding of the run (``with_steps``): its message then starts ``step 2: ...`` and an error in a
step is an error of the run, so the report's integrity line and ``probe check`` without
``--step`` see it.

A valid token is a row whose two log-probs are not null (null marks padding, as in the metric
engine). Log-probs below ``LOGPROB_FLOOR`` (``-inf`` aside, which is non-finite here) are read as
the floor for ``L(k)``. Sign convention of the metric engine: ``r = train - rollout``.

``integrity.json``: ``{"findings": [{"check", "severity", "tokens", "sequences", "message",
"share", "steps"}],
"masks_applied": [...], "steps": {"<step>": [findings]}}`` (``steps`` for a store with a
``step`` column). Numbers only here; ``report.integrity`` renders them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe.metrics.batch import (
    LOGPROB_FLOOR,
    distinct_sorted,
    distinct_values,
    int_column,
    seq_sums,
    sequence_starts,
)
from mismatch_probe.metrics.compiled import loops
from mismatch_probe.metrics.sampling_checks import DIFFERENT, SAMPLING_CHECKS, SamplingAccumulator
from mismatch_probe.store import (
    METRIC_COLUMNS,
    STEP_COLUMN,
    iter_sequence_batches,
    open_parquet,
    resolve_tokens_path,
)
from mismatch_probe.store.arrays import numpy_of, valid_of

ERROR, WARNING = "error", "warning"
CHECKS = (
    "placeholder_logprob",
    "shifted_by_one",
    "trainer_copies_rollout",
    "implausible_logprob",
    "positive_logprob",
    "nonfinite_logprob",
    "mask_rule",
    *SAMPLING_CHECKS,  # temperature_mismatch, truncated_support (metrics.sampling_checks)
)
PLACEHOLDER_OTHER_BELOW = math.log(0.5)  # the other side below ln 0.5: not a near-certain token
PLACEHOLDER_ERROR_SHARE = 0.01  # an error at or above 1% of the valid tokens
SHIFT_RATIO = 0.5  # min(L(-1), L(+1)) < 0.5 * L(0) ...
SHIFT_MIN_L0 = 0.05  # ... and L(0) > 0.05
COPY_MIN_TOKENS = 100  # bitwise-identical sides on at least this many tokens (pooled)
COPY_MIN_SEQ_TOKENS = 8  # a sequence copied throughout counts from this many valid tokens
POSITIVE_ABOVE = 1e-6  # log-probs up to this are rounding of 0
IMPLAUSIBLE_BELOW = -1e4  # no real distribution gives a finite log-prob below this
PARTIAL_SHARE = 0.05  # a check holds on part of a run from 5% of its valid sequences ...
PARTIAL_MIN_SEQUENCES = 2  # ... and at least 2 of them
STEPS_SHOWN = 5  # steps named in a message before "and N more"
SHIFTS = (-1, 0, 1)
TOKEN_FLAGS = ("placeholder", "implausible", "positive", "nonfinite")
COPY_MESSAGE = (
    "the training side equals the rollout side bit for bit: e.g. verl's bypass mode copies "
    "rollout_log_probs into old_log_probs; no mismatch can be measured"
)


@dataclass(frozen=True)
class Finding:
    """One integrity problem: which check, how bad, how many tokens and sequences, in words.

    ``share``: the sequences it holds on, of the valid sequences (None for ``mask_rule``);
    ``steps``: the training steps it holds in (None for a store without steps)."""

    check: str
    severity: str
    tokens: int
    sequences: int
    message: str
    share: float | None = None
    steps: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "severity": self.severity,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "message": self.message,
            "share": self.share,
            "steps": None if self.steps is None else list(self.steps),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        share, steps = data.get("share"), data.get("steps")
        return cls(
            str(data["check"]),
            str(data["severity"]),
            int(data["tokens"]),
            int(data["sequences"]),
            str(data["message"]),
            None if share is None else float(share),
            None if steps is None else tuple(int(s) for s in steps),
        )


@dataclass(frozen=True)
class Integrity:
    """The findings of a run (all steps together) and, for an ingested run, of each step.

    Attributes:
        findings: errors first, then warnings (each in ``CHECKS`` order); empty when clean.
            A finding of any step is a finding of the run (``steps`` names where it holds).
        steps: ``{step: findings}`` of a store with a ``step`` column, else empty.
        masks_applied: the format-specific masks the reader applied (``mask_rules`` entries).
    """

    findings: tuple[Finding, ...] = ()
    steps: dict[int, tuple[Finding, ...]] = field(default_factory=dict)
    masks_applied: tuple[dict[str, Any], ...] = ()

    def of_step(self, step: int | None) -> tuple[Finding, ...]:
        """The findings of one step (the run's with ``None``)."""
        return self.findings if step is None else self.steps.get(step, ())

    def error_checks(self, step: int | None = None) -> list[str]:
        """The checks with an error finding (of ``step``; the run's with ``None``), each once."""
        return list(dict.fromkeys(f.check for f in errors(self.of_step(step))))

    def blocking_checks(self, step: int | None = None) -> list[str]:
        """The checks that make the recommendation "investigate first" (spec section 7): the
        errors and ``trainer_copies_rollout`` (no mismatch can be measured), each once."""
        copies = [f.check for f in self.of_step(step) if f.check == COPY_CHECK]
        return list(dict.fromkeys([*self.error_checks(step), *copies]))

    def to_json_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"findings": [f.to_dict() for f in self.findings]}
        data["masks_applied"] = list(self.masks_applied)
        if self.steps:
            data["steps"] = {str(s): [f.to_dict() for f in fs] for s, fs in self.steps.items()}
        return data

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> Integrity:
        """Inverse of ``to_json_dict`` (``KeyError``/``TypeError``/``ValueError`` if malformed)."""
        steps = {
            int(s): tuple(Finding.from_dict(f) for f in fs)
            for s, fs in dict(data.get("steps") or {}).items()
        }
        return cls(
            tuple(Finding.from_dict(f) for f in data["findings"]),
            steps,
            tuple(dict(m) for m in data.get("masks_applied") or ()),
        )


COPY_CHECK = "trainer_copies_rollout"


def errors(findings: Iterable[Finding], accepted: Iterable[str] = ()) -> list[Finding]:
    """The error findings whose check is not in ``accepted``."""
    ok = set(accepted)
    return [f for f in findings if f.severity == ERROR and f.check not in ok]


def _pct(share: float) -> str:
    """``30%``, ``3.3%``: a share to two significant digits."""
    return f"{100 * share:.0f}%" if share >= 0.1 else f"{100 * share:.2g}%"


def _of_sequences(held: int, total: int) -> str:
    """``30% of sequences (27 of 90)``."""
    return f"{_pct(held / max(total, 1))} of sequences ({held:,} of {total:,})"


def _order(f: Finding) -> tuple[bool, int]:
    return (f.severity != ERROR, CHECKS.index(f.check) if f.check in CHECKS else len(CHECKS))


def _by_sequence(seq: np.ndarray, pos: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The rows in position order inside each sequence, each sequence's rows together:
    ``(pos, *arrays, starts)`` with ``starts`` ``[S]`` each sequence's first row. Rows that
    already come so (the store's own order) are kept as they are, without a sort."""
    starts = sequence_starts(seq)
    descending = pos[1:] < pos[:-1]  # a row before its predecessor ...
    descending[starts[1:] - 1] = False  # ... of the same sequence
    contiguous = len(np.unique(seq[starts])) == len(starts)
    if not contiguous or descending.any():
        order = np.lexsort((pos, seq))
        seq, pos = seq[order], pos[order]
        arrays = tuple(a[order] for a in arrays)
        starts = sequence_starts(seq)
    return (pos, *arrays, starts)


# What ``_kernels.integrity`` is handed and fills, in its order.
_HANDED = (np.int64, np.float64, np.float64, np.bool_, np.bool_, np.int64)
_LIMITS = np.array([LOGPROB_FLOOR, POSITIVE_ABOVE, IMPLAUSIBLE_BELOW, PLACEHOLDER_OTHER_BELOW,
                    SHIFT_RATIO, SHIFT_MIN_L0, DIFFERENT])  # fmt: skip
_FLAGGED = ("nonfinite", "positive", "implausible", "placeholder")  # TOKEN_FLAGS, its order
_COUNTED = ("valid", "valid_seqs", "identical", "copied_seqs", "copied_tokens",
            *_FLAGGED, *(f"{name}_seqs" for name in _FLAGGED),
            "pairs", "shifted_seqs", "held_n",
            "finite", "finite_seqs", "neg", "pos", "neg_seqs", "pos_seqs")  # fmt: skip
_SUMMED = 2 + 2 * len(SHIFTS)  # positive_max, implausible_min, shift sums, held sums


class IntegrityAccumulator:
    """Fixed-size counts of one run (or one step), fed batch by batch of whole sequences."""

    def __init__(self) -> None:
        self.valid = 0
        self.valid_seqs = 0
        self.identical = 0
        self.counts = dict.fromkeys(TOKEN_FLAGS, 0)
        self.seqs = dict.fromkeys((*TOKEN_FLAGS, "shifted", "copied"), 0)
        self.positive_max = 0.0
        self.implausible_min = 0.0
        self.shift_sum = dict.fromkeys(SHIFTS, 0.0)
        self.shift_n = dict.fromkeys(SHIFTS, 0)
        self.held_sum = dict.fromkeys(SHIFTS, 0.0)  # over the interior tokens of shifted seqs
        self.held_n = 0
        self.copied_tokens = 0  # the valid tokens of the sequences copied throughout
        self.sampling = SamplingAccumulator()  # the misaligned-settings checks

    def update(self, seq: np.ndarray, pos: np.ndarray, train: np.ndarray, rollout: np.ndarray,
               valid: np.ndarray, flip: np.ndarray) -> None:  # fmt: skip
        """Add whole sequences. Shapes ``[N]``: ``seq`` ids (a sequence's rows contiguous),
        ``pos`` response positions, ``train``/``rollout`` float64 log-probs (anything at
        padding), ``valid`` bool (both sides present), ``flip`` bool (a support flip). The
        compiled loop where built (``_kernels.integrity``: the same numbers in one pass), else
        numpy's calls."""
        pos, train, rollout, valid, flip, starts = _by_sequence(
            seq, pos, train, rollout, valid, flip
        )
        kernels = loops()
        if kernels is not None:
            self._update_compiled(kernels, pos, train, rollout, valid, flip, starts)
            return
        seg = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(pos))))
        n_valid = seq_sums(valid.astype(np.float64), starts)
        self.valid += int(np.count_nonzero(valid))
        self.valid_seqs += int((n_valid > 0).sum())
        with np.errstate(invalid="ignore"):
            same = valid & (train == rollout)
            self.identical += int(np.count_nonzero(same))
            n_same = seq_sums(same.astype(np.float64), starts)
            copied = (n_valid >= COPY_MIN_SEQ_TOKENS) & (n_same == n_valid)
            self.seqs["copied"] += int(copied.sum())
            self.copied_tokens += int(n_valid[copied].sum())
            finite = valid & np.isfinite(train) & np.isfinite(rollout)
            outside = (train == -np.inf) & flip  # a support flip: the token left the support
            self._flag("nonfinite", valid & ~finite & ~outside, seg)
            positive = finite & ((train > POSITIVE_ABOVE) | (rollout > POSITIVE_ABOVE))
            if positive.any():
                top = np.maximum(train, rollout)[positive].max()
                self.positive_max = max(self.positive_max, float(top))
            self._flag("positive", positive, seg)
            implausible = finite & ((train < IMPLAUSIBLE_BELOW) | (rollout < IMPLAUSIBLE_BELOW))
            if implausible.any():
                low = np.minimum(train, rollout)[implausible].min()
                self.implausible_min = min(self.implausible_min, float(low))
            self._flag("implausible", implausible, seg)
            low = PLACEHOLDER_OTHER_BELOW
            dummy = ((train == 0.0) & (rollout < low)) | ((rollout == 0.0) & (train < low))
            self._flag("placeholder", finite & dummy, seg)
        self._shift(seg, pos, train, rollout, finite)
        self.sampling.update(seg, train, rollout, finite)

    def _update_compiled(self, kernels: Any, pos: np.ndarray, train: np.ndarray,
                         rollout: np.ndarray, valid: np.ndarray, flip: np.ndarray,
                         starts: np.ndarray) -> None:  # fmt: skip
        """``update``'s numbers from ``_kernels.integrity``, added as its numpy calls add them."""
        n = len(pos)
        counts, sums = np.zeros(len(_COUNTED), np.int64), np.empty(_SUMMED)
        x, y, neg, pos_abs = (np.empty(n) for _ in range(4))
        arrays = zip((pos, train, rollout, valid, flip, starts), _HANDED, strict=True)
        kernels.integrity(*(np.ascontiguousarray(a, dtype) for a, dtype in arrays), _LIMITS,
                          COPY_MIN_SEQ_TOKENS, counts, sums, x, y, neg, pos_abs)  # fmt: skip
        c = dict(zip(_COUNTED, counts.tolist(), strict=True))
        self.valid += c["valid"]
        self.valid_seqs += c["valid_seqs"]
        self.identical += c["identical"]
        self.seqs["copied"] += c["copied_seqs"]
        self.copied_tokens += c["copied_tokens"]
        for name in TOKEN_FLAGS:
            self.counts[name] += c[name]
            self.seqs[name] += c[f"{name}_seqs"]
        if c["positive"]:
            self.positive_max = max(self.positive_max, float(sums[0]))
        if c["implausible"]:
            self.implausible_min = min(self.implausible_min, float(sums[1]))
        for i, k in enumerate(SHIFTS):
            self.shift_sum[k] += float(sums[2 + i])
            self.shift_n[k] += c["pairs"]
            self.held_sum[k] += float(sums[2 + len(SHIFTS) + i])
        self.seqs["shifted"] += c["shifted_seqs"]
        self.held_n += c["held_n"]
        self.sampling.add(x[: c["finite"]], y[: c["finite"]], c["finite_seqs"],
                          {-1: (neg[: c["neg"]], c["neg_seqs"]),
                           1: (pos_abs[: c["pos"]], c["pos_seqs"])})  # fmt: skip

    def merge(self, other: IntegrityAccumulator) -> None:
        """Add another accumulator's sequences (counts and sums added, extremes combined)."""
        self.valid += other.valid
        self.valid_seqs += other.valid_seqs
        self.identical += other.identical
        self.held_n += other.held_n
        self.copied_tokens += other.copied_tokens
        for name in ("counts", "seqs", "shift_sum", "shift_n", "held_sum"):
            mine: dict[Any, Any] = getattr(self, name)
            for key, value in getattr(other, name).items():
                mine[key] += value
        self.positive_max = max(self.positive_max, other.positive_max)
        self.implausible_min = min(self.implausible_min, other.implausible_min)
        self.sampling.merge(other.sampling)

    def _flag(self, name: str, hit: np.ndarray, seg: np.ndarray) -> None:
        self.counts[name] += int(np.count_nonzero(hit))
        self.seqs[name] += distinct_sorted(seg[hit])

    def _shift(self, seg: np.ndarray, pos: np.ndarray, train: np.ndarray, rollout: np.ndarray,
               finite: np.ndarray) -> None:  # fmt: skip
        """``|train[t] - rollout[t+k]|`` summed per sequence for k in {-1, 0, +1}, over the
        tokens t whose neighbours t-1 and t+1 are valid tokens of the same sequence (the
        interior tokens); the sequences for which the shift test holds on their own pairs
        are counted, and their sums kept apart."""
        every = bool(finite.all())
        t = np.maximum(train if every else np.where(finite, train, 0.0), LOGPROB_FLOOR)
        r = np.maximum(rollout if every else np.where(finite, rollout, 0.0), LOGPROB_FLOOR)
        nseg = int(seg[-1]) + 1 if len(seg) else 0
        pair = finite[:-1] & finite[1:] & (seg[:-1] == seg[1:]) & (pos[1:] == pos[:-1] + 1)
        mid = pair[:-1] & pair[1:]  # rows 1 .. N-2 whose both neighbours are paired with them
        inner = t[1:-1]
        diffs = {  # k -> absolute differences at the rows ``mid``, in row order
            0: np.abs(inner - r[1:-1])[mid],
            1: np.abs(inner - r[2:])[mid],  # train[t] vs rollout[t+1]
            -1: np.abs(inner - r[:-2])[mid],  # train[t] vs rollout[t-1]
        }
        labels = seg[1:-1][mid]
        group = np.flatnonzero(np.r_[True, labels[1:] != labels[:-1]]) if len(labels) else labels
        n = np.zeros(nseg, dtype=np.int64)
        n[labels[group]] = np.diff(np.append(group, len(labels)))
        sums = {}
        for k, d in diffs.items():
            self.shift_sum[k] += float(d.sum())
            self.shift_n[k] += len(d)
            sums[k] = np.zeros(nseg)
            if len(labels):
                sums[k][labels[group]] = np.add.reduceat(d, group)
        with np.errstate(invalid="ignore", divide="ignore"):
            held = (n > 0) & shifted(*(sums[k] / n for k in SHIFTS))
        self.seqs["shifted"] += int(held.sum())
        self.held_n += int(n[held].sum())
        for k in SHIFTS:
            self.held_sum[k] += float(sums[k][held].sum())

    def shift_means(self) -> dict[int, float]:
        """Pooled ``L(k)`` (0 where there was no pair)."""
        return {k: self.shift_sum[k] / self.shift_n[k] if self.shift_n[k] else 0.0 for k in SHIFTS}

    def partial(self, sequences: int) -> bool:
        """Whether a check holding on ``sequences`` sequences holds on part of the run (spec
        section 8: at least 5% of the valid sequences, at least 2)."""
        return sequences >= PARTIAL_MIN_SEQUENCES and sequences >= PARTIAL_SHARE * self.valid_seqs

    def share(self, sequences: int) -> float:
        return sequences / self.valid_seqs if self.valid_seqs else 0.0

    def findings(self, ingested: bool) -> list[Finding]:
        """The findings of everything seen, errors first."""
        out = [f for f in (self._nonfinite(), self._positive(), self._implausible(),
                           self._placeholder(), self._shifted(),
                           self._copies(ingested)) if f is not None]  # fmt: skip
        out += [Finding(f["check"], ERROR, f["tokens"], f["sequences"], f["message"],
                        self.share(f["sequences"]))
                for f in self.sampling.findings()]  # fmt: skip
        return sorted(out, key=_order)

    def _token_finding(self, check: str, name: str, severity: str, text: str) -> Finding:
        m = self.seqs[name]
        return Finding(check, severity, self.counts[name], m, text, self.share(m))

    def _nonfinite(self) -> Finding | None:
        n = self.counts["nonfinite"]
        if not n:
            return None
        text = f"{n:,} valid tokens have a NaN or infinite log-prob; they are not measurements"
        return self._token_finding("nonfinite_logprob", "nonfinite", ERROR, text)

    def _positive(self) -> Finding | None:
        n = self.counts["positive"]
        if not n:
            return None
        text = (
            f"{n:,} log-probs above 0 (largest {self.positive_max:.4g}): a log-probability is at "
            "most 0, so these are not log-probs (probabilities, logits or a sign error?)"
        )
        return self._token_finding("positive_logprob", "positive", ERROR, text)

    def _implausible(self) -> Finding | None:
        n = self.counts["implausible"]
        if not n:
            return None
        text = (
            f"{n:,} valid tokens have a log-prob below {IMPLAUSIBLE_BELOW:g} (lowest "
            f"{self.implausible_min:.4g}): a placeholder such as -1e9 or finfo.min, not a "
            "measured log-prob (no real distribution gives one)"
        )
        return self._token_finding("implausible_logprob", "implausible", ERROR, text)

    def _placeholder(self) -> Finding | None:
        n = self.counts["placeholder"]
        if not n:
            return None
        share = n / max(self.valid, 1)
        text = (
            f"{n:,} valid tokens ({share:.2%}) have a log-prob of exactly 0.0 on one side and "
            "below ln 0.5 on the other: a placeholder 0.0 (observation or injected tokens), "
            "not a measured log-prob"
        )
        severity = ERROR if share >= PLACEHOLDER_ERROR_SHARE else WARNING
        return self._token_finding("placeholder_logprob", "placeholder", severity, text)

    def _shifted(self) -> Finding | None:
        """Pooled ``L(k)``, or the shifted sequences' own when they are a part of the run."""
        L, m = self.shift_means(), self.seqs["shifted"]
        pooled = bool(shifted(L[-1], L[0], L[1]))
        if not pooled and not self.partial(m):
            return None
        tokens = self.shift_n[0]
        where = ""
        if not pooled:
            L = {k: self.held_sum[k] / max(self.held_n, 1) for k in SHIFTS}
            tokens = self.held_n
            where = f"{_of_sequences(m, self.valid_seqs)} are shifted by one: on them, "
        k = -1 if L[-1] <= L[1] else 1
        text = (
            f"{where}the training log-probs match the rollout's shifted by {k:+d} token better "
            f"than unshifted: L(-1) = {L[-1]:.4g}, L(0) = {L[0]:.4g}, L(+1) = {L[1]:.4g} (mean "
            "|train_lp[t] - rollout_lp[t+k]|); the two sides are misaligned by one token"
        )
        return Finding("shifted_by_one", ERROR, tokens, m, text, self.share(m))

    def _copies(self, ingested: bool) -> Finding | None:
        if not ingested:
            return None
        if self.valid >= COPY_MIN_TOKENS and self.identical == self.valid:
            return Finding(COPY_CHECK, WARNING, self.valid, self.valid_seqs, COPY_MESSAGE, 1.0)
        m = self.seqs["copied"]
        if not self.partial(m):
            return None
        text = f"on {_of_sequences(m, self.valid_seqs)}, {COPY_MESSAGE} on them"
        return Finding(COPY_CHECK, WARNING, self.copied_tokens, m, text, self.share(m))


def shifted(l_minus: Any, l_zero: Any, l_plus: Any) -> Any:
    """The shift test on ``L(-1), L(0), L(+1)`` (floats or ``[S]`` arrays)."""
    return (np.minimum(l_minus, l_plus) < SHIFT_RATIO * l_zero) & (l_zero > SHIFT_MIN_L0)


def _steps_text(steps: Sequence[int]) -> str:
    """``step 2``, ``steps 2, 3``, ``steps 1, 2, 3, 4, 5 and 7 more``."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    shown = ", ".join(str(s) for s in steps[:STEPS_SHOWN])
    more = len(steps) - STEPS_SHOWN
    return f"steps {shown}" + (f" and {more} more" if more > 0 else "")


def _worst(severities: Iterable[str]) -> str:
    return ERROR if ERROR in set(severities) else WARNING


def _step_text(hits: Sequence[tuple[int, Finding]]) -> str:
    """``step 2: <step 2's message>`` (several steps: the first one's numbers)."""
    numbers = [s for s, _ in hits]
    text = f"{_steps_text(numbers)}: {hits[0][1].message}"
    return text + (f" (the numbers of step {numbers[0]})" if len(hits) > 1 else "")


def with_steps(
    found: Sequence[Finding], steps: Mapping[int, Sequence[Finding]], valid_seqs: int
) -> list[Finding]:
    """The run's findings with every step's: a check that holds in a step is a finding of the
    run (``steps`` the steps it holds in; an error in a step is an error of the run), whether
    or not it holds on the whole run; its message is the step's (``step 2: ...``) unless it
    holds in every step. ``valid_seqs``: the run's, for the ``share`` of a step's finding."""
    held: dict[str, list[tuple[int, Finding]]] = {}
    for step, fs in steps.items():
        for f in fs:
            held.setdefault(f.check, []).append((step, f))
    out = []
    for f in found:
        hits = held.pop(f.check, [])
        severity = _worst([f.severity, *(g.severity for _, g in hits)])
        text = _step_text(hits) if hits and len(hits) < len(steps) else f.message
        out.append(replace(f, severity=severity, message=text, steps=tuple(s for s, _ in hits)))
    for check, hits in held.items():
        sequences = sum(g.sequences for _, g in hits)
        out.append(
            Finding(
                check,
                _worst(g.severity for _, g in hits),
                sum(g.tokens for _, g in hits),
                sequences,
                _step_text(hits) if len(hits) < len(steps) else hits[0][1].message,
                sequences / valid_seqs if valid_seqs else 0.0,
                tuple(s for s, _ in hits),
            )
        )
    return sorted(out, key=_order)


def mask_findings(run: Mapping[str, Any]) -> tuple[list[Finding], list[dict[str, Any]]]:
    """``mask_rule`` warnings (the masks a reader could not apply) and the applied masks, from
    the run metadata's ``mask_rules`` (read defensively: anything malformed is ignored)."""
    rules = run.get("mask_rules")
    if rules is None:
        source = run.get("source")
        rules = source.get("mask_rules") if isinstance(source, Mapping) else None
    found, applied = [], []
    for rule in rules if isinstance(rules, list) else []:
        if not isinstance(rule, Mapping) or not isinstance(rule.get("rule"), str):
            continue
        name, detail = rule["rule"], str(rule.get("detail") or "")
        if rule.get("applied") is True:
            applied.append({"rule": name, "detail": detail})
            continue
        text = f"{name}: a mask of the format that could not be applied" + (
            f" ({detail})" if detail else ""
        )
        found.append(Finding("mask_rule", WARNING, 0, 0, text + "; its tokens are measured"))
    return found, applied


def _columns(table: pa.Table) -> tuple[np.ndarray, ...]:
    """seq_id, position, train and rollout (float64, NaN at null), valid, and the support-flip
    flags (all False without the column), as numpy.

    Raises:
        ProbeError: seq_id or position holds a null or a value int64 cannot hold (as the
            metric pass refuses them: ``batch.int_column``).
    """
    values = []
    valid = np.ones(table.num_rows, dtype=bool)
    for name in ("train_logprob", "rollout_logprob"):
        col = table.column(name)
        valid &= valid_of(col)
        values.append(np.asarray(numpy_of(col, null=np.nan), dtype=np.float64))
    seq, pos = (int_column(table, name) for name in ("seq_id", "position"))
    flip = np.zeros(table.num_rows, dtype=bool)
    if "support_flip" in table.column_names:
        flip = np.asarray(numpy_of(table.column("support_flip"), null=False), dtype=bool)
    return seq, pos, values[0], values[1], valid, flip


def compute_integrity(
    path: Path | str,
    run: Mapping[str, Any] | None = None,
    tables: Iterable[pa.Table] | None = None,
    names: Sequence[str] | None = None,
) -> Integrity:
    """Every integrity check of a token store in one streaming pass (per step when the store
    has a ``step`` column).

    Args:
        path: a run directory or a token store (file or a sharded scan's ``tokens/``).
        run: the run metadata (``run.json``): ``kind == "ingest"`` enables
            ``trainer_copies_rollout``; ``mask_rules`` gives the ``mask_rule`` findings.
        tables: the store's batches as ``store.iter_sequence_batches`` yields them (with at
            least these columns), when the caller reads them anyway (``probe ingest``'s one
            pass); None: read here.
        names: the store's columns, given with ``tables`` handed over while the store is
            written (``metrics.steps.Written``); None: read from its footer.
    """
    run = run if run is not None else {}  # read after the tables: ingest adds mask_rules
    path = resolve_tokens_path(Path(path))
    if names is None:
        names = open_parquet(path).schema_arrow.names
    has_step = STEP_COLUMN in names
    extra = [c for c in ("support_flip", STEP_COLUMN) if c in names]
    columns = [*METRIC_COLUMNS, *extra]
    whole = IntegrityAccumulator()
    per_step: dict[int, IntegrityAccumulator] = {}
    for table in iter_sequence_batches(path, columns) if tables is None else tables:
        arrays = _columns(table)
        batch = IntegrityAccumulator()
        batch.update(*arrays)
        whole.merge(batch)
        if not has_step:
            continue
        step_of_row = numpy_of(table.column(STEP_COLUMN), null=-1)
        held = distinct_values(step_of_row)
        if len(held) == 1:  # the usual batch: one step's rows, the batch's own counts
            per_step.setdefault(int(held[0]), IntegrityAccumulator()).merge(batch)
            continue
        for step in held:
            rows = step_of_row == step
            per_step.setdefault(int(step), IntegrityAccumulator()).update(
                *(a[rows] for a in arrays)
            )
    ingested = run.get("kind") == "ingest"
    masks, applied = mask_findings(run)
    found = {
        s: [replace(f, steps=(s,)) for f in acc.findings(ingested)]
        for s, acc in sorted(per_step.items())
    }
    run_found = whole.findings(ingested)
    if has_step:
        run_found = with_steps(run_found, found, whole.valid_seqs)
    steps = {s: tuple(fs + masks) for s, fs in found.items()}
    return Integrity(tuple(run_found + masks), steps, tuple(applied))
