"""The recommendation (spec section 7): one preset, or none, with the reason, in one sentence.

The rule, checked in this order (``RULE`` states it for the reports):

1. **investigate first** when an integrity finding (spec section 8) is an error, when
   ``trainer_copies_rollout`` is present (no mismatch can be measured), when a ``*_overflow``
   flag is set, or when the mismatch is concentrated: ``outlier_share_top1pct > CONCENTRATED``
   with at least ``MIN_CONCENTRATED_SEQS`` sequences (below, the top 1% is one sequence);
2. **none needed** when no verdict fails (a check whose metric was not computed does not count)
   and ``k3_kl < NONE_NEEDED_K3``;
3. otherwise the candidates are the presets the report evaluates **with IS weights** (token or
   sequence TIS, IcePop, and their combinations with an RS part): a pure rejection preset never
   reweights, so its effective sample size is 1 by construction and says nothing about the
   correction. Among the candidates whose ``token_masked_fraction`` is below ``MAX_MASKED`` and
   whose ``eff_sample_size`` is at least ``MIN_ESS``: the highest ESS; ties (equal to 9 decimal
   places): the least masking, then the simplest (token-level before sequence-level, then fewer
   parts, then ``PRESETS`` order);
4. **no preset fits** otherwise, naming the closest candidate: the one of smallest
   ``max(token_masked_fraction / MAX_MASKED, (1 - ESS) / (1 - MIN_ESS))``.

The effective sample size is at most 1 (``accum.eff_sample_size`` clamps the rounding of the
``1e-8`` in its denominator).
Stored as ``recommendation: {outcome, preset, reason, masked_token_fraction, ess, closest}``
(``preset`` only for outcome ``preset``; the two numbers are the chosen or closest preset's, or
null). The integrity input is a list of the names of error findings (``integrity.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mismatch_probe.metrics.config import PresetSpec, parse_preset
from mismatch_probe.metrics.integrity import COPY_CHECK
from mismatch_probe.metrics.presets import PRESET_PREFIX, PRESETS
from mismatch_probe.metrics.verdicts import FAIL, evaluate

CONCENTRATED = 0.5
MIN_CONCENTRATED_SEQS = 100  # below, the top 1% is one sequence and says nothing
OVERFLOW_SUFFIX = "_overflow"
NONE_NEEDED_K3 = 1e-4
MAX_MASKED = 0.01
MIN_ESS = 0.9
RULE = (
    "Checked in order: investigate first when an integrity check finds an error or a copy of "
    "the rollout side, when an overflow flag is set, or when more than "
    f"{CONCENTRATED:.0%} of the mismatch (k3) sits in the top 1% of at least "
    f"{MIN_CONCENTRATED_SEQS} sequences; none needed when no verdict fails and k3_kl < "
    f"{NONE_NEEDED_K3:g}; else, among the presets with IS weights (alone or beside an RS part) "
    f"that mask under {MAX_MASKED:.0%} of tokens and keep an effective sample size of at least "
    f"{MIN_ESS:g}, the one with the highest effective sample size (ties: less masking, then "
    "token-level before sequence-level); else no preset fits, and the closest is named."
)
OUTCOMES = ("investigate_first", "none_needed", "preset", "no_preset_fits")


@dataclass(frozen=True)
class Recommendation:
    """The rule's outcome (one of ``OUTCOMES``) and its one-sentence reason."""

    outcome: str
    reason: str
    preset: str | None = None
    masked_token_fraction: float | None = None
    ess: float | None = None
    closest: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pct(x: float) -> str:
    """A share as a percentage to two significant digits, never in exponent form: 0.003 ->
    ``0.3%``, 1 -> ``100%``, below 0.01% -> ``<0.01%``."""
    value = 100 * x
    if value == 0 or value >= 10:
        return f"{value:.0f}%"
    return f"{value:.2g}%" if value >= 0.01 else "<0.01%"


def label(spec: PresetSpec) -> str:
    """``Token TIS at C=2``, ``Sequence IcePop in [0.5, 5]``, ``seq_mean_k3 RS at 0.01``."""
    parts = []
    if spec.is_spec is not None:
        level = spec.is_spec.level.capitalize()
        if spec.is_spec.lower is None:
            parts.append(f"{level} TIS at C={spec.is_spec.upper:g}")
        else:
            parts.append(f"{level} IcePop in [{spec.is_spec.lower:g}, {spec.is_spec.upper:g}]")
    parts += [f"{rs.option} RS at {rs.spec}" for rs in spec.rs_specs]
    return " + ".join(parts)


def _simplicity(spec: PresetSpec) -> tuple[int, int, int]:
    seq_is = spec.is_spec is not None and spec.is_spec.level == "sequence"
    seq_rs = any(rs.aggregation != "token" for rs in spec.rs_specs)
    parts = (spec.is_spec is not None) + len(spec.rs_specs)
    order = list(PRESETS).index(spec.name) if spec.name in PRESETS else len(PRESETS)
    return (int(seq_is or seq_rs), parts, order)


def _truncated(spec: PresetSpec, sweep: Sequence[dict[str, Any]]) -> str | None:
    """``truncate 0.3% of tokens`` for a TIS-only preset, from the threshold sweep."""
    if spec.is_spec is None or spec.is_spec.lower is not None or spec.rs_specs:
        return None
    family, what, unit = (
        ("token_tis", "token_fraction", "tokens")
        if spec.is_spec.level == "token"
        else ("seq_is", "seq_fraction", "sequence weights")
    )
    row = next(
        (r for r in sweep if r["family"] == family and r["threshold"] == spec.is_spec.upper), None
    )
    return None if row is None else f"truncate {pct(row[what])} of {unit}"


def _effect(spec: PresetSpec, masked: float, sweep: Sequence[dict[str, Any]]) -> str:
    truncated = _truncated(spec, sweep)
    return truncated if truncated and masked == 0 else f"mask {pct(masked)} of tokens"


class _Candidate:
    def __init__(self, spec: PresetSpec, metrics: dict[str, float]) -> None:
        p = f"{PRESET_PREFIX}{spec.name}"
        self.spec = spec
        self.masked = metrics[f"{p}/token_masked_fraction"]
        self.ess = metrics[f"{p}/eff_sample_size"]

    @property
    def fits(self) -> bool:
        return self.masked < MAX_MASKED and self.ess >= MIN_ESS

    def rank(self) -> tuple[float, float, tuple[int, int, int]]:
        return (-round(self.ess, 9), round(self.masked, 9), _simplicity(self.spec))

    def distance(self) -> float:
        return max(self.masked / MAX_MASKED, (1.0 - self.ess) / (1.0 - MIN_ESS))


def _candidates(metrics: dict[str, float], config: dict[str, Any]) -> list[_Candidate]:
    names = [n for n in (config.get("presets") or {}) if n in PRESETS]
    keys = ("token_masked_fraction", "eff_sample_size")
    present = [n for n in names if all(f"{PRESET_PREFIX}{n}/{k}" in metrics for k in keys)]
    specs = [parse_preset(n) for n in present]
    return [_Candidate(spec, metrics) for spec in specs if spec.is_spec is not None]


def _overflowed(metrics: dict[str, float]) -> list[str]:
    """The ``*_overflow`` flags that are set (a metric capped at the largest float64)."""
    return sorted(k for k, v in metrics.items() if k.endswith(OVERFLOW_SUFFIX) and v >= 1.0)


def _investigate(metrics: dict[str, float], blocking: Sequence[str]) -> Recommendation | None:
    """Rule 1: an integrity error, a copy of the rollout side, an overflow flag, or the
    mismatch concentrated in few sequences (from ``MIN_CONCENTRATED_SEQS`` sequences)."""
    found = list(dict.fromkeys(blocking))
    errors = [c for c in found if c != COPY_CHECK]
    if errors:
        return Recommendation(
            "investigate_first",
            f"Investigate first: the integrity check {', '.join(errors)} found an error; "
            "no number is to be believed before it is fixed (see Data integrity).",
        )
    if COPY_CHECK in found:
        return Recommendation(
            "investigate_first",
            f"Investigate first: the training side equals the rollout side bit for bit "
            f"({COPY_CHECK}), so no mismatch can be measured (see Data integrity).",
        )
    flags = _overflowed(metrics)
    if flags:
        return Recommendation(
            "investigate_first",
            f"Investigate first: {', '.join(flags)} is set (a metric overflowed and was capped "
            "at the largest float64); no number is to be believed before it is explained.",
        )
    share = metrics.get("outlier_share_top1pct", 0.0)
    if share > CONCENTRATED and metrics.get("num_sequences", 0.0) >= MIN_CONCENTRATED_SEQS:
        return Recommendation(
            "investigate_first",
            f"Investigate first: {pct(share)} of the mismatch sits in 1% of sequences, "
            "see Outliers.",
        )
    return None


def recommend(
    metrics: dict[str, float],
    config: dict[str, Any],
    sweep: Sequence[dict[str, Any]] = (),
    integrity_errors: Sequence[str] = (),
) -> Recommendation:
    """Apply the rule (module docstring) to one run's (or setting's) metrics.

    Args:
        metrics: flat metrics (``MetricsResult.flat()``).
        config: ``MetricsConfig.describe()``: which presets were evaluated.
        sweep: the ``threshold_sweep`` rows (for the share a TIS preset truncates).
        integrity_errors: names of the integrity checks that block a recommendation: those
            that found an error, and ``trainer_copies_rollout`` when present
            (``Integrity.blocking_checks``).
    """
    found = _investigate(metrics, integrity_errors)
    if found is not None:
        return found
    k3 = metrics.get("k3_kl", float("inf"))
    if all(v.status != FAIL for v in evaluate(metrics)) and k3 < NONE_NEEDED_K3:
        return Recommendation(
            "none_needed",
            f"None needed: no verdict fails and k3_kl is {k3:.2g} (below {NONE_NEEDED_K3:g}).",
        )
    candidates = _candidates(metrics, config)
    fitting = sorted((c for c in candidates if c.fits), key=_Candidate.rank)
    if fitting:
        c = fitting[0]
        effect = _effect(c.spec, c.masked, sweep)
        reason = f"{label(c.spec)} would {effect} and keep the effective sample size at "
        reason += f"{c.ess:.2f}: use it (preset {c.spec.name})."
        return Recommendation("preset", reason, c.spec.name, c.masked, c.ess)
    if not candidates:
        return Recommendation(
            "no_preset_fits", "No preset fits: no preset with IS weights was evaluated."
        )
    c = min(candidates, key=lambda c: (c.distance(), _simplicity(c.spec)))
    reason = (
        f"No preset fits: the closest, {label(c.spec)} (preset {c.spec.name}), would mask "
        f"{pct(c.masked)} of tokens (limit {MAX_MASKED:.0%}) and keep an effective sample size "
        f"of {c.ess:.2f} (limit {MIN_ESS:g})."
    )
    return Recommendation("no_preset_fits", reason, None, c.masked, c.ess, c.spec.name)
