"""Metric configuration: which IS weights, which rejection masks, which presets.

Everything a user can get wrong is parsed and validated here, once, when a ``MetricsConfig`` is
built; the metric code downstream trusts the parsed records (``ISSpec``, ``RSSpec``,
``PresetSpec``). Bad input raises ``ProbeError`` with a one-line message naming the bad part.

Threshold grammar (verl's ``rollout_is_threshold`` / ``rollout_rs_threshold``):

* IS: ``"C"`` -> TIS (``w = min(raw_w, C)``; ``L = 1/C`` is used by the metrics only);
  ``"L_U"`` -> IcePop (``w = raw_w`` inside ``[L, U]``, else 0).
* RS: one spec shared by all options or exactly one per option, comma-separated. k1 options take
  ``"L_U"`` or ``"X"`` (meaning ``L = 1/X, U = X``) and keep ``log L <= k1 <= log U`` with
  ``k1 = -r``; k2/k3 options take one number ``U`` and keep ``stat <= U``.

This module imports nothing numeric; it knows names and numbers, not arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.presets import PRESETS

IS_LEVELS = ("token", "sequence")
RS_AGGREGATIONS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_ESTIMATORS = ("k1", "k2", "k3")
# verl's option set: every aggregation x estimator except seq_max_k1.
RS_OPTIONS = tuple(
    f"{agg}_{est}" for agg in RS_AGGREGATIONS for est in RS_ESTIMATORS if agg + est != "seq_maxk1"
)


@dataclass(frozen=True)
class ISSpec:
    """Parsed IS weighting: ``level`` in ``IS_LEVELS``, ``upper`` U, ``lower`` L or None (TIS)."""

    level: str
    upper: float
    lower: float | None

    @property
    def icepop(self) -> bool:
        return self.lower is not None

    @property
    def low(self) -> float:
        """The lower ratio bound of the metrics: L for IcePop, 1/C for TIS."""
        return self.lower if self.lower is not None else 1.0 / self.upper

    def describe(self) -> str:
        if self.lower is None:
            return f"{self.level} TIS {self.upper:g}"
        return f"{self.level} IcePop [{self.lower:g}, {self.upper:g}]"


@dataclass(frozen=True)
class RSSpec:
    """One parsed rejection option, thresholds already in statistic space.

    Keep where ``lo <= stat <= hi``: for k1 options ``lo = log L, hi = log U``; for k2/k3
    ``lo = None`` (no lower test) and ``hi = U``.
    """

    option: str
    aggregation: str
    estimator: str
    hi: float
    lo: float | None
    spec: str

    def describe(self) -> str:
        return f"{self.option} {self.spec}"


@dataclass(frozen=True)
class PresetSpec:
    """A parsed preset: IS weighting (or None) and rejection options (maybe empty)."""

    name: str
    is_spec: ISSpec | None
    rs_specs: tuple[RSSpec, ...]

    def describe(self) -> str:
        parts = [self.is_spec.describe()] if self.is_spec else []
        return " + ".join(parts + [rs.describe() for rs in self.rs_specs])


def _spec_text(value: object, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ProbeError(f"{what} {value!r}: expected a number or a string")
    text = str(value).strip()
    if not text:
        raise ProbeError(f"{what} is empty")
    return text


def _positive(text: str, what: str) -> float:
    """One bound: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise ProbeError(f"{what}: {text.strip()!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ProbeError(f"{what}: bound {text.strip()} must be a finite number > 0")
    return value


def _bounds(text: str, what: str) -> tuple[float | None, float]:
    """``"C"`` -> (None, C); ``"L_U"`` -> (L, U), checking ``0 < L <= U``."""
    parts = text.split("_")
    if len(parts) > 2:
        raise ProbeError(f"{what}: expected one number or L_U")
    values = [_positive(part, what) for part in parts]
    if len(values) == 1:
        return None, values[0]
    if values[0] > values[1]:
        raise ProbeError(f"{what}: lower bound {parts[0]} is above upper bound {parts[1]}")
    return values[0], values[1]


def parse_is(level: str | None, threshold: object) -> ISSpec | None:
    """``rollout_is`` + ``rollout_is_threshold`` -> ``ISSpec`` (None when IS is off)."""
    if level is None or level == "none":
        return None
    if level not in IS_LEVELS:
        raise ProbeError(f"rollout_is {level!r}: expected token, sequence or none")
    what = "rollout_is_threshold"
    text = _spec_text(threshold, what)
    lower, upper = _bounds(text, f"{what} {text!r}")
    return ISSpec(level, upper, lower)


def _rs_option_names(options: object) -> list[str]:
    names = [part.strip() for part in _spec_text(options, "rollout_rs").split(",")]
    names = list(dict.fromkeys(name for name in names if name))
    for name in names:
        if name not in RS_OPTIONS:
            raise ProbeError(f"rollout_rs {name!r}: unknown option; valid: {', '.join(RS_OPTIONS)}")
    if not names:
        raise ProbeError("rollout_rs names no option")
    return names


def _rs_spec(option: str, text: str) -> RSSpec:
    aggregation, estimator = option.rsplit("_", 1)
    what = f"rollout_rs_threshold {text!r} for {option}"
    if estimator != "k1":
        if "_" in text:
            raise ProbeError(f"{what}: a k2/k3 option takes one number U, not L_U")
        return RSSpec(option, aggregation, estimator, _positive(text, what), None, text)
    lower, upper = _bounds(text, what)
    if lower is None:
        lower = 1.0 / upper
        if lower > upper:
            raise ProbeError(f"{what}: one number X means L = 1/X, U = X, so X must be >= 1")
    return RSSpec(option, aggregation, estimator, math.log(upper), math.log(lower), text)


def parse_rs(options: object, thresholds: object) -> tuple[RSSpec, ...]:
    """``rollout_rs`` + ``rollout_rs_threshold`` -> one ``RSSpec`` per distinct option."""
    if options is None:
        if thresholds is not None:
            raise ProbeError("rollout_rs_threshold is set but rollout_rs is not")
        return ()
    names = _rs_option_names(options)
    if thresholds is None:
        raise ProbeError(f"rollout_rs {options!r} needs rollout_rs_threshold")
    raw = _spec_text(thresholds, "rollout_rs_threshold")
    texts = [part.strip() for part in raw.split(",") if part.strip()]
    if len(texts) not in (1, len(names)):
        raise ProbeError(
            f"rollout_rs_threshold {raw!r}: {len(texts)} thresholds for {len(names)} options "
            f"({', '.join(names)}); give 1 or {len(names)}"
        )
    texts = texts * len(names) if len(texts) == 1 else texts
    return tuple(_rs_spec(name, text) for name, text in zip(names, texts, strict=True))


def parse_preset(name: str) -> PresetSpec:
    if name not in PRESETS:
        raise ProbeError(f"preset {name!r}: unknown; valid: {', '.join(PRESETS)}")
    p = PRESETS[name]
    return PresetSpec(
        name,
        parse_is(p.rollout_is, p.rollout_is_threshold),
        parse_rs(p.rollout_rs, p.rollout_rs_threshold),
    )


@dataclass(frozen=True)
class MetricsConfig:
    """What ``compute_metrics`` computes; validated at construction (``ProbeError``).

    Args:
        rollout_is: IS level, ``"token"`` or ``"sequence"``; ``None``/``"none"`` turns IS off.
        rollout_is_threshold: ``"C"`` (TIS) or ``"L_U"`` (IcePop); a float means ``"C"``.
        rollout_rs: comma-separated rejection options (``RS_OPTIONS``) or ``None``.
        rollout_rs_threshold: one spec for all options or one per option, comma-separated.
        batch_normalize: report ``rollout_is_batch_norm_factor`` (verl's batch normalisation).
        presets: names from ``PRESETS`` to evaluate (default: all of them).
    """

    rollout_is: str | None = "token"
    rollout_is_threshold: str | float = "2.0"
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    batch_normalize: bool = False
    presets: tuple[str, ...] = tuple(PRESETS)
    is_spec: ISSpec | None = field(init=False, repr=False, compare=False)
    rs_specs: tuple[RSSpec, ...] = field(init=False, repr=False, compare=False)
    preset_specs: tuple[PresetSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        presets = tuple(dict.fromkeys(self.presets))
        object.__setattr__(self, "presets", presets)
        object.__setattr__(self, "is_spec", parse_is(self.rollout_is, self.rollout_is_threshold))
        object.__setattr__(self, "rs_specs", parse_rs(self.rollout_rs, self.rollout_rs_threshold))
        object.__setattr__(self, "preset_specs", tuple(parse_preset(n) for n in presets))

    def describe(self) -> dict[str, Any]:
        """The configuration as JSON-ready values (for ``metrics.json``)."""
        return {
            "rollout_is": self.is_spec.level if self.is_spec else None,
            "rollout_is_threshold": str(self.rollout_is_threshold) if self.is_spec else None,
            "rollout_rs": ",".join(rs.option for rs in self.rs_specs) or None,
            "rollout_rs_threshold": ",".join(rs.spec for rs in self.rs_specs) or None,
            "batch_normalize": self.batch_normalize,
            "presets": {p.name: p.describe() for p in self.preset_specs},
        }
