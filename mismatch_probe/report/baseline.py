"""``probe check HEAD --baseline BASE``: how much a metric may grow over a baseline run.

``--max-increase k3_kl=1.5x`` fails when HEAD's ``k3_kl`` is above 1.5 times BASE's;
``--max-increase f_tau_2=+0.001`` when it is more than 0.001 above BASE's. The limit is
``F * base`` or ``base + A`` (so a factor fails any growth from a baseline of 0). ``--max`` /
``--min`` (``check``) are evaluated beside them.

The runs must measure the same thing (the run kind: a scan, or an ingested run of one format;
then ``COMPARABLE``: model config hash, prompts, sampling); otherwise the gate refuses
(``ProbeError``, exit 2) and says what differs, unless ``allow_different``.

Before any bound, the gate takes the run's data integrity (``report.integrity``, recomputed from
the store; one step's with ``--step``): an error finding fails it unless ``--accept`` names its
check.

Noise: for the metrics of ``bootstrap.TERMS`` (``k3_kl``, ``chi2_token``), when both runs have at
least ``bootstrap.MIN_SEQUENCES`` sequences, the gate bootstraps the excess ``head - F * base``
(or ``head - base - A``) over sequences and fails only when its whole interval at the chosen
confidence (``--significance``, 0.95 by default) lies above 0, i.e. when the growth past the
limit is larger than the sampling noise of the two runs. Other metrics, and small runs, are
compared point to point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path, PurePath
from typing import Any

from rich.console import Console
from rich.text import Text

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.integrity import CHECKS, Finding, Integrity, errors
from mismatch_probe.report import bootstrap
from mismatch_probe.report.check import (
    Bound,
    BoundResult,
    did_you_mean,
    evaluate_bounds,
    parse_bounds,
    result_line,
)
from mismatch_probe.report.compare import IDENTITY, _lookup, _short
from mismatch_probe.report.context import RunContext, load_run

# What two runs must share to be gated against each other: what ``probe compare`` checks, but
# the model's directory name (two checkouts may name it differently: its config hash decides).
# A field one of the runs does not record (a run of an older version) is not compared; the
# prompts file is compared by name, and only when the runs do not both record the prompts' hash.
COMPARABLE: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (what, path) for what, path in IDENTITY if what != "model"
)
KINDS = {"x": "factor", "+": "absolute"}


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


def run_kind(run: dict[str, Any]) -> str:
    """``scan``, or ``ingest of <format>`` (a run without ``kind`` was written by a scan)."""
    kind = str(run.get("kind") or "scan")
    source = _lookup(run, ("source", "format"))
    return kind if source is None else f"{kind} of {source}"


def differences(head: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """One line per ``COMPARABLE`` field recorded by both runs with different values, after
    the run kind (a scan against an ingested run, one ingested format against another), which
    is always compared."""
    hashed = all(_lookup(run, ("prompts", "sha256")) is not None for run in (head, base))
    kinds = [run_kind(run) for run in (head, base)]
    lines = (
        []
        if kinds[0] == kinds[1]
        else [f"run kind differs (head: {kinds[0]}; baseline: {kinds[1]})"]
    )
    for what, path in COMPARABLE:
        values = [_lookup(run, path) for run in (head, base)]
        if what == "prompts file":
            if hashed:
                continue
            values = [None if v is None else PurePath(str(v)).name for v in values]
        if None not in values and values[0] != values[1]:
            lines.append(
                f"{what} differs (head: {_short(values[0])}; baseline: {_short(values[1])})"
            )
    return lines


def check_comparable(head: RunContext, base: RunContext, allow_different: bool) -> tuple[str, ...]:
    """What differs between the runs (``differences``); a ``ProbeError`` when something does
    and ``allow_different`` is off."""
    found = tuple(differences(head.run, base.run))
    if found and not allow_different:
        raise ProbeError(
            "the runs are not comparable: "
            + "; ".join(found)
            + " (--allow-different to gate them anyway)"
        )
    return found


@dataclass(frozen=True)
class IncreaseResult:
    """One ``Increase`` applied: point values, and the bootstrap intervals when there are.

    ``excess_ci`` is the interval of ``head - limit(base)``; with it the bound fails only when
    the whole interval is above 0, without it when the point is.
    """

    bound: Increase
    value: float
    base: float
    level: float
    head_ci: tuple[float, float] | None = None
    base_ci: tuple[float, float] | None = None
    excess_ci: tuple[float, float] | None = None

    @property
    def limit(self) -> float:
        return float(self.bound.limit(self.base))

    @property
    def point_passed(self) -> bool:
        return self.value <= self.limit

    @property
    def passed(self) -> bool:
        if self.excess_ci is None:
            return self.point_passed
        return self.excess_ci[0] <= 0.0

    def change(self) -> str:
        """The growth in the bound's own terms: ``×1.25`` or ``+0.0003``."""
        if self.bound.kind == "absolute":
            return f"{self.value - self.base:+.4g}"
        return f"×{self.value / self.base:.3g}" if self.base else "from 0"


def _intervals(head_dir: Path, base_dir: Path, bound: Increase, level: float) -> dict[str, Any]:
    """The bootstrap intervals of one bound ({} when the metric or the runs do not allow)."""
    if bound.metric not in bootstrap.TERMS:
        return {}
    runs = [bootstrap.sequence_stats(d, _reference_setting(d)) for d in (head_dir, base_dir)]
    if not all(r.usable(bound.metric) for r in runs):
        return {}
    head_reps, base_reps = bootstrap.replicates(runs, bound.metric)
    return {
        "head_ci": bootstrap.interval(head_reps, level),
        "base_ci": bootstrap.interval(base_reps, level),
        "excess_ci": bootstrap.interval(head_reps - bound.limit(base_reps), level),
    }


def _reference_setting(run_dir: Path) -> str | None:
    """The setting ``metrics.json`` describes when the store holds several."""
    from mismatch_probe.report.settings import setting_names

    names = setting_names(run_dir)
    return names[0] if len(names) > 1 else None


def _check_metric(bound: Increase, head: dict[str, float], base: dict[str, float]) -> None:
    for metrics, which in ((head, "the run"), (base, "the baseline")):
        if bound.metric not in metrics:
            hint = did_you_mean(bound.metric, metrics)
            raise ProbeError(f"--max-increase {bound.metric}: {which} has no such metric{hint}")


@dataclass(frozen=True)
class Gate:
    """Everything ``probe check`` evaluated."""

    bounds: tuple[BoundResult, ...]
    increases: tuple[IncreaseResult, ...]
    differences: tuple[str, ...] = ()
    baseline: Path | None = None
    integrity: Integrity | None = None  # the run's data-integrity findings
    step: int | None = None  # the training step checked (--step), None for the whole run
    accepted: tuple[str, ...] = ()  # integrity checks accepted with --accept

    @property
    def integrity_errors(self) -> list[Finding]:
        """The error findings (of ``step``) not accepted."""
        if self.integrity is None:
            return []
        return errors(self.integrity.of_step(self.step), self.accepted)

    @property
    def passed(self) -> bool:
        results: list[BoundResult | IncreaseResult] = [*self.bounds, *self.increases]
        return all(r.passed for r in results) and not self.integrity_errors


def _step_metrics(run_dir: Path, step: str) -> dict[str, float]:
    """One training step's metrics of an ingested run (``"last"`` or a step number)."""
    from mismatch_probe.report.trend import step_metrics

    return step_metrics(Path(run_dir), step)


def run_gate(
    run_dir: Path,
    maxima: list[str],
    minima: list[str],
    baseline: Path | None = None,
    increases: list[str] | None = None,
    level: float = 0.95,
    allow_different: bool = False,
    step: str | None = None,
    accept: tuple[str, ...] = (),
) -> Gate:
    """Parse and evaluate every bound of ``probe check`` (see the module docstring), after the
    run's data integrity (of one step with ``step``): an error finding fails the gate unless
    its check is in ``accept``. A run whose metrics cannot be computed (a NaN log-prob) still
    gets its integrity verdict.

    Raises:
        ProbeError: bad usage (no bound, a bound unparsable or naming an unknown metric,
            ``--max-increase`` without ``--baseline`` or the reverse, a level outside (0, 1),
            ``--accept`` of an unknown check), runs that are not comparable, an unreadable run.
    """
    for name in accept:
        if name not in CHECKS:
            raise ProbeError(f"--accept {name}: not an integrity check ({', '.join(CHECKS)})")
    parsed = [parse_increase(s) for s in increases or []]
    if parsed and baseline is None:
        raise ProbeError("--max-increase needs --baseline BASE_RUN_DIR")
    if baseline is not None and not parsed:
        raise ProbeError("--baseline needs at least one --max-increase METRIC=1.5x or =+0.001")
    if not 0.0 < level < 1.0:
        raise ProbeError(f"--significance {level:g}: a confidence level in (0, 1), e.g. 0.95")
    bounds: tuple[Bound, ...] = ()
    if maxima or minima or not parsed:
        bounds = parse_bounds(maxima, minima)
    if step is not None and baseline is not None:
        raise ProbeError("--step checks one training step's bounds; it does not take --baseline")
    gate = _integrity_gate(Path(run_dir), step, accept)
    try:
        head = load_run(run_dir)
    except ProbeError:
        if gate.integrity_errors:  # e.g. NaN log-probs: no metrics, but the finding says why
            return gate
        raise
    metrics = _step_metrics(run_dir, step) if step else head.metrics
    results = evaluate_bounds(bounds, metrics)
    if baseline is None:
        return replace(gate, bounds=tuple(results))
    base = load_run(baseline)
    differences = check_comparable(head, base, allow_different)
    checked = []
    for bound in parsed:
        _check_metric(bound, head.metrics, base.metrics)
        value, base_value = head.metrics[bound.metric], base.metrics[bound.metric]
        extra = _intervals(Path(run_dir), Path(baseline), bound, level)
        checked.append(IncreaseResult(bound, value, base_value, level, **extra))
    return replace(
        gate,
        bounds=tuple(results),
        increases=tuple(checked),
        differences=differences,
        baseline=Path(baseline),
    )


def _integrity_gate(run_dir: Path, step: str | None, accept: tuple[str, ...]) -> Gate:
    """A gate with no bound yet: the run's integrity findings, recomputed from its store."""
    from mismatch_probe.metrics.steps import resolve_step
    from mismatch_probe.report.integrity import run_integrity

    if not run_dir.is_dir():
        raise ProbeError(f"{run_dir} is not a run directory")
    tokens = store.resolve_tokens_path(run_dir)
    number = None if step is None else resolve_step(tokens, step)
    return Gate((), (), integrity=run_integrity(run_dir), step=number, accepted=accept)


# --- rendering ---------------------------------------------------------------------------------


def _ci(pair: tuple[float, float]) -> str:
    return f"[{pair[0]:.4g}, {pair[1]:.4g}]"


def increase_line(res: IncreaseResult) -> Text:
    """``✔ PASS  k3_kl = 0.005 vs baseline 0.004: ×1.25 ≤ ×1.5 (max increase)``, then the
    intervals when there are, and why a point above the limit still passes (noise)."""
    b = res.bound
    head = Text("✔ PASS  ", style="green") if res.passed else Text("✘ FAIL  ", style="bold red")
    over = "≤" if res.point_passed else ">"
    head.append(
        f"{b.metric} = {res.value:.6g} vs baseline {res.base:.6g}: "
        f"{res.change()} {over} {b.text} (max increase)"
    )
    if not res.point_passed:
        head.append(f" by {res.value - res.limit:.4g}")
    if res.excess_ci is not None and res.head_ci and res.base_ci:
        pct = f"{res.level:.0%}"
        head.append(f"\n        {pct} CI: head {_ci(res.head_ci)}, baseline {_ci(res.base_ci)}; ")
        head.append(f"{b.excess_text()} in {_ci(res.excess_ci)}")
        if not res.point_passed:
            head.append(" (above 0: significant)" if not res.passed else " (includes 0: noise)")
    return head


def render_gate(gate: Gate, console: Console) -> None:
    """The data integrity first, the baseline and what differs (if anything), one line per
    bound, a summary line naming the integrity errors that fail the gate."""
    from mismatch_probe.report.integrity import integrity_text

    if gate.integrity is not None:
        console.print(integrity_text(gate.integrity, gate.step, gate.accepted), highlight=False)
    if gate.baseline is not None:
        console.print(f"baseline {gate.baseline}", highlight=False, soft_wrap=True)
    for line in gate.differences:
        console.print(Text(f"⚠ {line}", style="yellow"), highlight=False)
    for res in gate.bounds:
        console.print(result_line(res), highlight=False)
    for inc in gate.increases:
        console.print(increase_line(inc), highlight=False)
    results: list[BoundResult | IncreaseResult] = [*gate.bounds, *gate.increases]
    failed = sum(not r.passed for r in results)
    summary = f"{failed} of {len(results)} bounds failed" if failed else "all bounds hold"
    if not results:
        summary = "no bound evaluated (the metrics cannot be computed)"
    if gate.integrity_errors:
        names = ", ".join(dict.fromkeys(f.check for f in gate.integrity_errors))
        summary += f"; integrity error: {names} (--accept CHECK if it is known and harmless)"
    console.print(summary, highlight=False)
