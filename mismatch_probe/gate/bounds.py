"""``probe check``: bounds on a run's metrics, for a CI job on each pull request.

``--max k3_kl=1e-3`` holds when ``k3_kl <= 1e-3``; ``--min prob_pearson=0.99`` when
``prob_pearson >= 0.99``. Bad usage (no bound, ``METRIC=VALUE`` unparsable, a metric the run
does not have) raises ``ProbeError`` (exit 2 at the CLI); the caller exits 1 when any bound
fails. Metric names are the flat keys of ``metrics.json`` (``probe metrics --json``).
``baseline`` runs these bounds beside the growth bounds against a baseline run;
``report.gate`` renders them.

A few keys are gated from one side only (``ONE_SIDED``): ``first_divergent_layer`` (``probe
scan --layers``) takes ``--min`` (``--min first_divergent_layer=2`` fails when layer 0 or 1
diverges); a run where no layer diverges (``null``) has it at ``inf`` and passes.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.verdicts import RULES


@dataclass(frozen=True)
class Bound:
    """``metric`` must stay at or below (``max``) or at or above (``min``) ``limit``."""

    metric: str
    kind: str
    limit: float


def parse_bound(spec: str, kind: str) -> Bound:
    """``"k3_kl=1e-3"`` -> ``Bound("k3_kl", kind, 0.001)``."""
    name, sep, text = (part.strip() for part in spec.partition("="))
    if not sep or not name:
        raise ProbeError(f"--{kind} {spec!r}: expected METRIC=VALUE, e.g. k3_kl=1e-3")
    try:
        limit = float(text)
    except ValueError:
        raise ProbeError(f"--{kind} {spec!r}: {text!r} is not a number") from None
    if not math.isfinite(limit):
        raise ProbeError(f"--{kind} {spec!r}: the bound must be a finite number")
    return Bound(name, kind, limit)


def parse_bounds(maxima: list[str], minima: list[str]) -> tuple[Bound, ...]:
    """Every ``--max`` then every ``--min``; at least one is required."""
    bounds = [parse_bound(s, "max") for s in maxima] + [parse_bound(s, "min") for s in minima]
    if not bounds:
        raise ProbeError("no bound given: use --max METRIC=VALUE and/or --min METRIC=VALUE")
    return tuple(bounds)


# Keys gated from one side only: the bound that makes sense, and why (a later first divergent
# layer is better, no divergent layer best: --max or a growth bound would gate the wrong way).
ONE_SIDED: dict[str, tuple[str, str]] = {
    "first_divergent_layer": (
        "min",
        "a later first divergence is better: --min first_divergent_layer=N fails when a layer "
        "below N diverges (no divergent layer passes)",
    ),
}
# Keys only some runs have, and what writes them (said when the run lacks one).
WRITTEN_BY = {
    "first_divergent_layer": "the run has no layers.json for it: probe scan --layers "
    "(or probe layers RUN_DIR) writes one",
}


def check_sides(bounds: tuple[Bound, ...], increases: tuple[Increase, ...]) -> None:
    """Refuse a bound on a ``ONE_SIDED`` key from its wrong side, or a growth bound on one.

    Raises:
        ProbeError: ``--max first_divergent_layer=...`` or ``--max-increase`` of it.
    """
    wrong = [(f"--{b.kind}", b.metric) for b in bounds if b.metric in ONE_SIDED]
    wrong = [(opt, m) for opt, m in wrong if opt != f"--{ONE_SIDED[m][0]}"]
    wrong += [("--max-increase", i.metric) for i in increases if i.metric in ONE_SIDED]
    if wrong:
        option, metric = wrong[0]
        raise ProbeError(f"{option} {metric}: {ONE_SIDED[metric][1]}")


def shown(value: float) -> str:
    """A gated value as written: ``none`` for ``inf`` (no layer diverges), else ``.6g``."""
    return "none" if value == math.inf else f"{value:.6g}"


def did_you_mean(metric: str, metrics: dict[str, float]) -> str:
    """`` (did you mean k3_kl?)`` with the closest metric names, or ``""``."""
    close = difflib.get_close_matches(metric, list(metrics), n=3)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def check_names(bounds: tuple[Bound, ...], metrics: dict[str, float]) -> None:
    """Fail on the first bound whose metric the run does not have, suggesting close names."""
    for b in bounds:
        if b.metric not in metrics and b.metric in WRITTEN_BY:
            raise ProbeError(f"--{b.kind} {b.metric}: {WRITTEN_BY[b.metric]}")
        if b.metric not in metrics:
            raise ProbeError(
                f"--{b.kind} {b.metric}: unknown metric{did_you_mean(b.metric, metrics)}"
            )


@dataclass(frozen=True)
class BoundResult:
    bound: Bound
    value: float

    @property
    def passed(self) -> bool:
        return RULES[self.bound.kind].holds(self.value, (self.bound.limit,))

    @property
    def excess(self) -> float:
        """How far past the bound the value is (positive when it fails)."""
        b = self.bound
        return self.value - b.limit if b.kind == "max" else b.limit - self.value


def evaluate_bounds(bounds: tuple[Bound, ...], metrics: dict[str, float]) -> list[BoundResult]:
    check_names(bounds, metrics)
    return [BoundResult(b, metrics[b.metric]) for b in bounds]


@dataclass(frozen=True)
class Increase:
    """``metric`` may be at most ``amount`` times (factor) or ``amount`` above (absolute) the
    baseline's value."""

    metric: str
    kind: str
    amount: float

    @property
    def text(self) -> str:
        return f"×{self.amount:g}" if self.kind == "factor" else f"+{self.amount:g}"

    def limit(self, base: Any) -> Any:
        """The largest allowed value given the baseline's (float or array)."""
        return self.amount * base if self.kind == "factor" else base + self.amount

    def excess_text(self) -> str:
        """The statistic bootstrapped: ``head − 1.5×base`` or ``head − base − 0.001``."""
        if self.kind == "factor":
            return f"head − {self.amount:g}×base"
        return f"head − base − {self.amount:g}"


def parse_increase(spec: str) -> Increase:
    """``"k3_kl=1.5x"`` -> factor 1.5; ``"f_tau_2=+0.001"`` -> absolute 0.001."""
    name, sep, text = (part.strip() for part in spec.partition("="))
    usage = f"--max-increase {spec!r}: expected METRIC=FACTORx or METRIC=+AMOUNT, e.g. k3_kl=1.5x"
    if not sep or not name or not text:
        raise ProbeError(usage)
    if text.endswith(("x", "X")):
        kind, number = "factor", text[:-1]
    elif text.startswith("+"):
        kind, number = "absolute", text[1:]
    else:
        raise ProbeError(usage)
    try:
        amount = float(number)
    except ValueError:
        raise ProbeError(f"--max-increase {spec!r}: {number!r} is not a number") from None
    if not math.isfinite(amount) or amount < 0 or (kind == "factor" and amount == 0):
        what = "a factor must be a finite number > 0" if kind == "factor" else "an amount ≥ 0"
        raise ProbeError(f"--max-increase {spec!r}: {what}")
    return Increase(name, kind, amount)
