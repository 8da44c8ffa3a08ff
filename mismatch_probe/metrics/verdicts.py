"""Health checks: a table of (metric, rule, bounds, label), evaluated on flat metrics.

verl's rollout-correction docs give the first five thresholds (``|kl| > 0.1``,
``chi2_token > 1``, IS mean outside ``[0.5, 2]``, ESS ``< 0.3``, IS std ``> 1``); the last two
are ours: the share of tokens whose ratio leaves ``[0.5, 2]`` (``f_tau_2``) and the largest
probability jump ``max |dp|``; NeMo-RL's docs give ``token_mult_prob_error <= 1.05`` ("Adding New
Models", section "Expected Error Threshold", stated for equal precision on both sides).
``SOURCES`` says where each threshold comes from. A check whose metric was not computed (IS off)
is ``n/a``.

``RULES`` is shared with ``probe check`` (``max`` / ``min`` bounds). Renderers live elsewhere;
this module knows numbers and words, not colours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class Rule(NamedTuple):
    """``holds(value, bounds)`` and the bound written for people (``{0}``, ``{1}``: bounds)."""

    holds: Callable[[float, tuple[float, ...]], bool]
    text: str


RULES: dict[str, Rule] = {
    "max": Rule(lambda v, b: v <= b[0], "≤ {0:g}"),
    "min": Rule(lambda v, b: v >= b[0], "≥ {0:g}"),
    "abs_max": Rule(lambda v, b: abs(v) <= b[0], "|x| ≤ {0:g}"),
    "within": Rule(lambda v, b: b[0] <= v <= b[1], "in [{0:g}, {1:g}]"),
}


@dataclass(frozen=True)
class HealthCheck:
    """One row of ``HEALTH_CHECKS``: ``metric`` passes when ``RULES[rule]`` holds."""

    metric: str
    rule: str
    bounds: tuple[float, ...]
    label: str
    source: str  # a key of SOURCES

    @property
    def threshold(self) -> str:
        return RULES[self.rule].text.format(*self.bounds)


HEALTH_CHECKS: tuple[HealthCheck, ...] = (
    HealthCheck("kl", "abs_max", (0.1,), "KL(rollout‖train), k1", "verl"),
    HealthCheck("chi2_token", "max", (1.0,), "token χ² = E[ρ²] − 1", "verl"),
    HealthCheck("rollout_is_mean", "within", (0.5, 2.0), "IS weight mean", "verl"),
    HealthCheck("rollout_is_eff_sample_size", "min", (0.3,), "IS effective sample size", "verl"),
    HealthCheck("rollout_is_std", "max", (1.0,), "IS weight std", "verl"),
    HealthCheck("f_tau_2", "max", (0.01,), "tokens with ρ outside [0.5, 2]", "ours"),
    HealthCheck("prob_abs_diff_max", "max", (0.5,), "max |p_train − p_rollout|", "ours"),
    HealthCheck("token_mult_prob_error", "max", (1.05,), "mean exp|log ρ|", "NeMo-RL"),
)

# Where each threshold comes from (shown under the verdicts of report.md).
SOURCES: dict[str, str] = {
    "verl": "verl docs/algo/rollout_corr.md (rollout-correction metrics, recommended ranges)",
    "NeMo-RL": "NeMo-RL docs/adding-new-models.md, section 3 'Expected Error Threshold' "
    "(1.05 for equal precision on both sides; 1.0 is a perfect match)",
    "ours": "mismatch_probe's own defaults",
}

PASS, FAIL, NA = "PASS", "FAIL", "n/a"


@dataclass(frozen=True)
class Verdict:
    """A health check applied to one run: ``status`` is ``PASS``, ``FAIL`` or ``n/a``."""

    check: HealthCheck
    value: float | None

    @property
    def status(self) -> str:
        if self.value is None:
            return NA
        return PASS if RULES[self.check.rule].holds(self.value, self.check.bounds) else FAIL


def evaluate(
    metrics: dict[str, float], checks: tuple[HealthCheck, ...] = HEALTH_CHECKS
) -> list[Verdict]:
    """One ``Verdict`` per check, in table order."""
    return [Verdict(check, metrics.get(check.metric)) for check in checks]
