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
* ``trainer_copies_rollout``: every valid token bitwise identical, on at least 100 tokens of an
  ingested run: a warning (verl's bypass mode copies ``rollout_log_probs`` into
  ``old_log_probs``);
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

A valid token is a row whose two log-probs are not null (null marks padding, as in the metric
engine). Log-probs below ``LOGPROB_FLOOR`` (``-inf`` aside, which is non-finite here) are read as
the floor for ``L(k)``. Sign convention of the metric engine: ``r = train - rollout``.

``integrity.json``: ``{"findings": [{"check", "severity", "tokens", "sequences", "message"}],
"masks_applied": [...], "steps": {"<step>": [findings]}}`` (``steps`` for a store with a
``step`` column). Numbers only here; ``report.integrity`` renders them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_probe.metrics.batch import LOGPROB_FLOOR
from mismatch_probe.metrics.sampling_checks import SAMPLING_CHECKS, SamplingAccumulator
from mismatch_probe.store import (
    METRIC_COLUMNS,
    STEP_COLUMN,
    iter_sequence_batches,
    open_parquet,
    resolve_tokens_path,
)

ERROR, WARNING = "error", "warning"
CHECKS = (
    "placeholder_logprob",
    "shifted_by_one",
    "trainer_copies_rollout",
    "positive_logprob",
    "nonfinite_logprob",
    "mask_rule",
    *SAMPLING_CHECKS,  # temperature_mismatch, truncated_support (metrics.sampling_checks)
)
PLACEHOLDER_OTHER_BELOW = math.log(0.5)  # the other side below ln 0.5: not a near-certain token
PLACEHOLDER_ERROR_SHARE = 0.01  # an error at or above 1% of the valid tokens
SHIFT_RATIO = 0.5  # min(L(-1), L(+1)) < 0.5 * L(0) ...
SHIFT_MIN_L0 = 0.05  # ... and L(0) > 0.05
COPY_MIN_TOKENS = 100  # bitwise-identical sides on at least this many tokens
POSITIVE_ABOVE = 1e-6  # log-probs up to this are rounding of 0
SHIFTS = (-1, 0, 1)
COPY_MESSAGE = (
    "the training side equals the rollout side bit for bit: e.g. verl's bypass mode copies "
    "rollout_log_probs into old_log_probs; no mismatch can be measured"
)


@dataclass(frozen=True)
class Finding:
    """One integrity problem: which check, how bad, how many tokens and sequences, in words."""

    check: str
    severity: str
    tokens: int
    sequences: int
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "severity": self.severity,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "message": self.message,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        return cls(
            str(data["check"]),
            str(data["severity"]),
            int(data["tokens"]),
            int(data["sequences"]),
            str(data["message"]),
        )


@dataclass(frozen=True)
class Integrity:
    """The findings of a run (all steps together) and, for an ingested run, of each step.

    Attributes:
        findings: errors first, then warnings (each in ``CHECKS`` order); empty when clean.
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


def errors(findings: Iterable[Finding], accepted: Iterable[str] = ()) -> list[Finding]:
    """The error findings whose check is not in ``accepted``."""
    ok = set(accepted)
    return [f for f in findings if f.severity == ERROR and f.check not in ok]


class IntegrityAccumulator:
    """Fixed-size counts of one run (or one step), fed batch by batch of whole sequences."""

    def __init__(self) -> None:
        self.valid = 0
        self.valid_seqs = 0
        self.identical = 0
        self.counts = dict.fromkeys(("placeholder", "positive", "nonfinite"), 0)
        self.seqs = dict.fromkeys(("placeholder", "positive", "nonfinite", "shifted"), 0)
        self.positive_max = 0.0
        self.shift_sum = dict.fromkeys(SHIFTS, 0.0)
        self.shift_n = dict.fromkeys(SHIFTS, 0)
        self.sampling = SamplingAccumulator()  # the misaligned-settings checks

    def update(self, seq: np.ndarray, pos: np.ndarray, train: np.ndarray, rollout: np.ndarray,
               valid: np.ndarray, flip: np.ndarray) -> None:  # fmt: skip
        """Add whole sequences. Shapes ``[N]``: ``seq`` ids (a sequence's rows contiguous),
        ``pos`` response positions, ``train``/``rollout`` float64 log-probs (anything at
        padding), ``valid`` bool (both sides present), ``flip`` bool (a support flip)."""
        order = np.lexsort((pos, seq))  # position order inside each sequence
        arrays = (seq, pos, train, rollout, valid, flip)
        seq, pos, train, rollout, valid, flip = (a[order] for a in arrays)
        _, seg = np.unique(seq, return_inverse=True)
        self.valid += int(valid.sum())
        self.valid_seqs += len(np.unique(seg[valid]))
        with np.errstate(invalid="ignore"):
            self.identical += int((valid & (train == rollout)).sum())
            finite = valid & np.isfinite(train) & np.isfinite(rollout)
            outside = (train == -np.inf) & flip  # a support flip: the token left the support
            self._flag("nonfinite", valid & ~finite & ~outside, seg)
            positive = finite & ((train > POSITIVE_ABOVE) | (rollout > POSITIVE_ABOVE))
            if positive.any():
                top = np.maximum(train, rollout)[positive].max()
                self.positive_max = max(self.positive_max, float(top))
            self._flag("positive", positive, seg)
            low = PLACEHOLDER_OTHER_BELOW
            dummy = ((train == 0.0) & (rollout < low)) | ((rollout == 0.0) & (train < low))
            self._flag("placeholder", finite & dummy, seg)
        self._shift(seg, pos, train, rollout, finite)
        self.sampling.update(seg, train, rollout, finite)

    def _flag(self, name: str, hit: np.ndarray, seg: np.ndarray) -> None:
        self.counts[name] += int(hit.sum())
        self.seqs[name] += len(np.unique(seg[hit]))

    def _shift(self, seg: np.ndarray, pos: np.ndarray, train: np.ndarray, rollout: np.ndarray,
               finite: np.ndarray) -> None:  # fmt: skip
        """``|train[t] - rollout[t+k]|`` summed per sequence for k in {-1, 0, +1}, over the
        tokens t whose neighbours t-1 and t+1 are valid tokens of the same sequence (the
        interior tokens)."""
        t = np.maximum(np.where(finite, train, 0.0), LOGPROB_FLOOR)
        r = np.maximum(np.where(finite, rollout, 0.0), LOGPROB_FLOOR)
        nseg = int(seg.max()) + 1 if len(seg) else 0
        pair = finite[:-1] & finite[1:] & (seg[:-1] == seg[1:]) & (pos[1:] == pos[:-1] + 1)
        mid = np.flatnonzero(pair[:-1] & pair[1:]) + 1  # rows t with both neighbours paired
        diffs = {  # k -> absolute differences at the rows ``mid``
            0: np.abs(t[mid] - r[mid]),
            1: np.abs(t[mid] - r[mid + 1]),  # train[t] vs rollout[t+1]
            -1: np.abs(t[mid] - r[mid - 1]),  # train[t] vs rollout[t-1]
        }
        n = np.bincount(seg[mid], minlength=nseg)
        sums = {}
        for k, d in diffs.items():
            self.shift_sum[k] += float(d.sum())
            self.shift_n[k] += len(d)
            sums[k] = np.bincount(seg[mid], weights=d, minlength=nseg)
        with np.errstate(invalid="ignore", divide="ignore"):
            held = (n > 0) & shifted(*(sums[k] / n for k in SHIFTS))
        self.seqs["shifted"] += int(held.sum())

    def shift_means(self) -> dict[int, float]:
        """Pooled ``L(k)`` (0 where there was no pair)."""
        return {k: self.shift_sum[k] / self.shift_n[k] if self.shift_n[k] else 0.0 for k in SHIFTS}

    def findings(self, ingested: bool) -> list[Finding]:
        """The findings of everything seen, errors first."""
        out = [f for f in (self._nonfinite(), self._positive(), self._placeholder(),
                           self._shifted(), self._copies(ingested)) if f is not None]  # fmt: skip
        out += [Finding(f["check"], ERROR, f["tokens"], f["sequences"], f["message"])
                for f in self.sampling.findings()]  # fmt: skip
        return sorted(out, key=lambda f: (f.severity != ERROR, CHECKS.index(f.check)))

    def _nonfinite(self) -> Finding | None:
        n = self.counts["nonfinite"]
        if not n:
            return None
        text = f"{n:,} valid tokens have a NaN or infinite log-prob; they are not measurements"
        return Finding("nonfinite_logprob", ERROR, n, self.seqs["nonfinite"], text)

    def _positive(self) -> Finding | None:
        n = self.counts["positive"]
        if not n:
            return None
        text = (
            f"{n:,} log-probs above 0 (largest {self.positive_max:.4g}): a log-probability is at "
            "most 0, so these are not log-probs (probabilities, logits or a sign error?)"
        )
        return Finding("positive_logprob", ERROR, n, self.seqs["positive"], text)

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
        return Finding("placeholder_logprob", severity, n, self.seqs["placeholder"], text)

    def _shifted(self) -> Finding | None:
        L = self.shift_means()
        if not bool(shifted(L[-1], L[0], L[1])):
            return None
        k = -1 if L[-1] <= L[1] else 1
        text = (
            f"the training log-probs match the rollout's shifted by {k:+d} token better than "
            f"unshifted: L(-1) = {L[-1]:.4g}, L(0) = {L[0]:.4g}, L(+1) = {L[1]:.4g} (mean "
            "|train_lp[t] - rollout_lp[t+k]|); the two sides are misaligned by one token"
        )
        return Finding("shifted_by_one", ERROR, self.shift_n[0], self.seqs["shifted"], text)

    def _copies(self, ingested: bool) -> Finding | None:
        if not ingested or self.valid < COPY_MIN_TOKENS or self.identical != self.valid:
            return None
        return Finding("trainer_copies_rollout", WARNING, self.valid, self.valid_seqs, COPY_MESSAGE)


def shifted(l_minus: Any, l_zero: Any, l_plus: Any) -> Any:
    """The shift test on ``L(-1), L(0), L(+1)`` (floats or ``[S]`` arrays)."""
    return (np.minimum(l_minus, l_plus) < SHIFT_RATIO * l_zero) & (l_zero > SHIFT_MIN_L0)


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
    flags (all False without the column), as numpy."""
    values = []
    valid = np.ones(table.num_rows, dtype=bool)
    for name in ("train_logprob", "rollout_logprob"):
        col = table.column(name)
        if col.null_count:
            valid &= ~pc.is_null(col).to_numpy(zero_copy_only=False)
        values.append(pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False))
    seq = pc.cast(table.column("seq_id"), pa.int64()).to_numpy(zero_copy_only=False)
    pos = pc.cast(table.column("position"), pa.int64()).to_numpy(zero_copy_only=False)
    flip = np.zeros(table.num_rows, dtype=bool)
    if "support_flip" in table.column_names:
        flips = pc.fill_null(table.column("support_flip"), False)
        flip = np.asarray(flips.to_numpy(zero_copy_only=False), dtype=bool)
    return seq, pos, values[0], values[1], valid, flip


def compute_integrity(
    path: Path | str, run: Mapping[str, Any] | None = None, tables: Iterable[pa.Table] | None = None
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
    """
    run = run or {}
    path = resolve_tokens_path(Path(path))
    names = open_parquet(path).schema_arrow.names
    has_step = STEP_COLUMN in names
    extra = [c for c in ("support_flip", STEP_COLUMN) if c in names]
    columns = [*METRIC_COLUMNS, *extra]
    whole = IntegrityAccumulator()
    per_step: dict[int, IntegrityAccumulator] = {}
    for table in iter_sequence_batches(path, columns) if tables is None else tables:
        arrays = _columns(table)
        whole.update(*arrays)
        if not has_step:
            continue
        steps = pc.fill_null(table.column(STEP_COLUMN), -1).to_numpy(zero_copy_only=False)
        for step in np.unique(steps):
            rows = steps == step
            per_step.setdefault(int(step), IntegrityAccumulator()).update(
                *(a[rows] for a in arrays)
            )
    ingested = run.get("kind") == "ingest"
    masks, applied = mask_findings(run)
    steps = {s: tuple(acc.findings(ingested) + masks) for s, acc in sorted(per_step.items())}
    return Integrity(tuple(whole.findings(ingested) + masks), steps, tuple(applied))
