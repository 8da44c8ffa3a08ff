"""``probe check HEAD --baseline BASE``: how much a metric may grow over a baseline run.

``--max-increase k3_kl=1.5x`` fails when HEAD's ``k3_kl`` is above 1.5 times BASE's;
``--max-increase f_tau_2=+0.001`` when it is more than 0.001 above BASE's. The limit is
``F * base`` or ``base + A`` (so a factor fails any growth from a baseline of 0). ``--max`` /
``--min`` (``bounds``) are evaluated beside them. ``report.gate`` renders the ``Gate``.

The runs must measure the same thing (the run kind: a scan, or an ingested run of one format;
then ``COMPARABLE``: model config hash, prompts, sampling); otherwise the gate refuses
(``ProbeError``, exit 2) and says what differs, unless ``allow_different``.

Before any bound, the gate takes the run's data integrity (``rundir.integrity``, recomputed from
the store; one step's with ``--step``): an error finding fails it unless ``--accept`` names its
check.

``--exact`` (``ParityResult``): each gated setting's ``parity/mismatch_count`` (metrics spec
section 9) must be 0; a failing one names its first differing token, read from the store.

Noise: for the metrics of ``bootstrap.TERMS`` (``k3_kl``, ``chi2_token``, ``kl``, ``f_tau_2``,
...), when both runs have at least ``bootstrap.MIN_SEQUENCES`` sequences, the gate bootstraps
the excess ``head - F * base`` (or ``head - base - A``) over sequences and fails only when its
whole interval at the chosen confidence (``--significance``, 0.95 by default) lies above 0,
i.e. when the growth past the
limit is larger than the sampling noise of the two runs. Other metrics, and small runs, are
compared point to point.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path, PurePath
from typing import Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.gate import bootstrap
from mismatch_probe.gate.bounds import BoundResult, Increase, did_you_mean, evaluate_bounds
from mismatch_probe.gate.compare import IDENTITY, _lookup, _short
from mismatch_probe.gate.config import CheckConfig
from mismatch_probe.metrics.integrity import Finding, Integrity, errors
from mismatch_probe.rundir.context import RunContext, load_run
from mismatch_probe.rundir.data import read_run

# What two runs must share to be gated against each other: what ``probe compare`` checks, but
# the model's directory name (two checkouts may name it differently: its config hash decides).
# A field one of the runs does not record (a run of an older version) is not compared; the
# prompts file is compared by name, and only when the runs do not both record the prompts' hash.
COMPARABLE: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (what, path) for what, path in IDENTITY if what != "model"
)
KINDS = {"x": "factor", "+": "absolute"}


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


def check_comparable(
    head: RunContext | dict[str, Any], base: RunContext | dict[str, Any], allow_different: bool
) -> tuple[str, ...]:
    """What differs between the runs (contexts or their ``run.json``, ``differences``); a
    ``ProbeError`` when something does and ``allow_different`` is off."""
    runs = [r.run if isinstance(r, RunContext) else r for r in (head, base)]
    found = tuple(differences(*runs))
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


def _intervals(
    head_dir: Path, base_dir: Path, bound: Increase, level: float, pair: tuple[Any, Any]
) -> dict[str, Any]:
    """The bootstrap intervals of one bound ({} when the metric or the runs do not allow);
    ``pair`` is the (head, baseline) setting compared (None: the whole store)."""
    if bound.metric not in bootstrap.TERMS:
        return {}
    runs = [bootstrap.sequence_stats(d, s) for d, s in zip((head_dir, base_dir), pair, strict=True)]
    if not all(r.usable(bound.metric) for r in runs):
        return {}
    head_reps, base_reps = bootstrap.replicates(runs, bound.metric)
    return {
        "head_ci": bootstrap.interval(head_reps, level),
        "base_ci": bootstrap.interval(base_reps, level),
        "excess_ci": bootstrap.interval(head_reps - bound.limit(base_reps), level),
    }


def _check_metric(bound: Increase, head: dict[str, float], base: dict[str, float]) -> None:
    for metrics, which in ((head, "the run"), (base, "the baseline")):
        if bound.metric not in metrics:
            hint = did_you_mean(bound.metric, metrics)
            raise ProbeError(f"--max-increase {bound.metric}: {which} has no such metric{hint}")


@dataclass(frozen=True)
class SettingGate:
    """The bounds of one setting of the run (``setting`` None: a run of one setting).

    ``note`` says why the growth bounds were not evaluated (a setting the baseline lacks)."""

    setting: str | None
    bounds: tuple[BoundResult, ...]
    increases: tuple[IncreaseResult, ...] = ()
    note: str = ""

    @property
    def failing(self) -> list[str]:
        """The metrics of the bounds that fail, in bound order, each once."""
        results: list[BoundResult | IncreaseResult] = [*self.bounds, *self.increases]
        return list(dict.fromkeys(r.bound.metric for r in results if not r.passed))

    @property
    def passed(self) -> bool:
        return not self.failing


@dataclass(frozen=True)
class ParityResult:
    """``--exact`` on one setting: the parity block's counts and the first differing token
    (``parity.first_mismatch``'s record; None when the two sides are bitwise equal)."""

    setting: str | None
    token_count: int
    mismatch_count: int
    first: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return self.mismatch_count == 0


@dataclass(frozen=True)
class Gate:
    """Everything ``probe check`` evaluated: one ``SettingGate`` per setting gated."""

    settings: tuple[SettingGate, ...]
    differences: tuple[str, ...] = ()
    baseline: Path | None = None
    integrity: Integrity | None = None  # the run's data-integrity findings
    step: int | None = None  # the training step checked (--step), None for the whole run
    accepted: tuple[str, ...] = ()  # integrity checks accepted with --accept
    parity: tuple[ParityResult, ...] = ()  # --exact, one per setting gated

    @property
    def integrity_errors(self) -> list[Finding]:
        """The error findings (of ``step``) not accepted."""
        if self.integrity is None:
            return []
        return errors(self.integrity.of_step(self.step), self.accepted)

    @property
    def bounds(self) -> tuple[BoundResult, ...]:
        return tuple(r for s in self.settings for r in s.bounds)

    @property
    def increases(self) -> tuple[IncreaseResult, ...]:
        return tuple(r for s in self.settings for r in s.increases)

    @property
    def passed(self) -> bool:
        exact = all(p.passed for p in self.parity)
        return all(s.passed for s in self.settings) and not self.integrity_errors and exact


def _step_metrics(run_dir: Path, step: str) -> dict[str, float]:
    """One training step's metrics of an ingested run (``"last"`` or a step number)."""
    from mismatch_probe.rundir.trend import step_metrics

    return step_metrics(Path(run_dir), step)


def _metrics(run_dir: Path, setting: str | None) -> dict[str, float]:
    """The flat metrics of one setting (None: the run's stored metrics, whole store), with
    its ``first_divergent_layer`` when the run has ``layers.json`` (``rundir.layers.gated``)."""
    from mismatch_probe.rundir.layers import gated

    if setting is None:
        return {**load_run(run_dir).metrics, **gated(run_dir, None)}
    from mismatch_probe.metrics import compute_metrics

    return {**compute_metrics(run_dir, setting=setting).flat(), **gated(run_dir, setting)}


def _baseline_pairs(
    head: list[str | None], head_dir: Path, base_dir: Path
) -> tuple[dict[str | None, str | None], dict[str | None, str]]:
    """Which baseline setting each head setting is gated against, by name (two runs of one
    setting each are paired whatever their names), and a note for each head setting the
    baseline lacks.

    Raises:
        ProbeError: no head setting has a counterpart in the baseline.
    """
    from mismatch_probe.rundir.loader import select_settings, setting_names

    base = select_settings(base_dir)
    if base == [None] and head == [None]:
        return {None: None}, {}
    names = setting_names(base_dir)
    own: dict[str | None, str | None] = {h: h for h in head}
    if head == [None]:  # a run of one setting against a matrix: its setting by name
        own = {None: next(iter(setting_names(head_dir)), None)}
    pairs: dict[str | None, str | None] = {
        h: (None if base == [None] else name) for h, name in own.items() if name in names
    }
    notes = {h: "not in the baseline: its growth is not gated" for h in head if h not in pairs}
    if not pairs:
        raise ProbeError(
            f"the baseline {base_dir.name} has none of the run's settings "
            f"(run: {'; '.join(str(h) for h in head)}; baseline: {'; '.join(names) or 'none'})"
        )
    return pairs, notes


def gate(cfg: CheckConfig) -> Gate:
    """Evaluate every bound of ``cfg`` on every setting it covers (see the module docstring).

    Raises:
        ProbeError: a bound naming an unknown metric, an unknown ``--setting``, runs that are
            not comparable or share no setting, an unreadable run.
    """
    from mismatch_probe.gate.trend import trend_bounds
    from mismatch_probe.rundir.loader import select_settings
    from mismatch_probe.rundir.trend_run import is_trend_run

    run_dir = cfg.run_dir
    if not run_dir.is_dir():
        raise ProbeError(f"{run_dir} is not a run directory")
    if is_trend_run(run_dir):  # verl-log: the logged metrics of one step, no token store
        if cfg.baseline is not None:
            raise ProbeError(f"{run_dir} is a trend run: it has no tokens for --baseline")
        if cfg.exact:
            raise ProbeError(f"{run_dir} is a trend run: it has no tokens for --exact")
        number, results, note = trend_bounds(run_dir, cfg.bounds, cfg.step)
        return Gate((SettingGate(None, results, (), note),), step=number)
    checked = _integrity_gate(run_dir, cfg.step, cfg.accept)
    # Usage errors stay errors (exit 2) whatever the integrity: an unknown --setting, a missing
    # or incomparable baseline.
    head_settings = select_settings(run_dir, cfg.settings)
    differences: tuple[str, ...] = ()
    if cfg.baseline is not None:
        if not cfg.baseline.is_dir():
            raise ProbeError(f"{cfg.baseline} is not a run directory")
        head_run, base_run = (read_run(d) for d in (run_dir, cfg.baseline))
        differences = check_comparable(head_run, base_run, cfg.allow_different)
    try:
        bounds = _gate_bounds(cfg, head_settings, differences)
    except ProbeError:
        # e.g. NaN log-probs: no metrics, but the finding says why; a bound naming no metric
        # probe has is a usage error still (exit 2)
        from mismatch_probe.metrics.names import lookup

        named = [b.metric for b in cfg.bounds] + [b.metric for b in cfg.increases]
        if checked.integrity_errors and all(lookup(m) is not None for m in named):
            return checked
        raise
    result = replace(bounds, integrity=checked.integrity, step=checked.step, accepted=cfg.accept)
    if cfg.exact:
        result = replace(result, parity=_exact(cfg, head_settings, checked.step))
    return result


def _exact(
    cfg: CheckConfig, settings: list[str | None], step: int | None
) -> tuple[ParityResult, ...]:
    """``--exact``: the parity block of each setting (of ``step``), and where a count is not 0
    the first differing token of that setting's (and step's) rows."""
    out = []
    for setting in settings:
        metrics = (
            _step_metrics(cfg.run_dir, cfg.step) if cfg.step else _metrics(cfg.run_dir, setting)
        )
        if "parity/mismatch_count" not in metrics:
            raise ProbeError(
                f"{cfg.run_dir.name}: its metrics have no parity block (an older probe wrote "
                f"them): run probe report {cfg.run_dir.name} first"
            )
        count = int(metrics["parity/mismatch_count"])
        first = _first_mismatch(cfg.run_dir, setting, step) if count else None
        out.append(ParityResult(setting, int(metrics["parity/token_count"]), count, first))
    return tuple(out)


def _first_mismatch(run_dir: Path, setting: str | None, step: int | None) -> dict[str, Any] | None:
    """The first differing token of the rows of ``setting`` and ``step`` (None: all)."""
    from mismatch_probe.metrics.parity import first_mismatch

    tokens = store.resolve_tokens_path(run_dir)
    names = store.open_parquet(tokens).schema_arrow.names
    keep = {"setting": setting, store.STEP_COLUMN: step}
    keep = {c: v for c, v in keep.items() if v is not None and c in names}
    columns = [*store.METRIC_COLUMNS, *keep]

    def tables() -> Any:
        import pyarrow.compute as pc

        for table in store.iter_sequence_batches(tokens, columns):
            for name, value in keep.items():
                table = table.filter(pc.equal(table.column(name), value))
            yield table

    return first_mismatch(tables())


def _gate_bounds(
    cfg: CheckConfig, head_settings: list[str | None], differences: tuple[str, ...]
) -> Gate:
    """The bounds (and growth over the baseline: ``differences`` already checked) of every
    setting gated."""
    run_dir = cfg.run_dir
    if cfg.baseline is None:
        checked = []
        for setting in head_settings:
            metrics = _step_metrics(run_dir, cfg.step) if cfg.step else _metrics(run_dir, setting)
            checked.append(SettingGate(setting, tuple(evaluate_bounds(cfg.bounds, metrics))))
        return Gate(tuple(checked))
    pairs, notes = _baseline_pairs(head_settings, run_dir, cfg.baseline)
    return Gate(
        tuple(_gate_one(cfg, s, pairs.get(s, None), notes.get(s, "")) for s in head_settings),
        differences,
        cfg.baseline,
    )


def _gate_one(cfg: CheckConfig, setting: str | None, base: str | None, note: str) -> SettingGate:
    """One setting's bounds and, when the baseline has it (``note`` empty), its growth."""
    assert cfg.baseline is not None
    head = _metrics(cfg.run_dir, setting)
    results = tuple(evaluate_bounds(cfg.bounds, head))
    if note:
        return SettingGate(setting, results, (), note)
    base_metrics = _metrics(cfg.baseline, base)
    checked = []
    for bound in cfg.increases:
        _check_metric(bound, head, base_metrics)
        extra = _intervals(cfg.run_dir, cfg.baseline, bound, cfg.level, (setting, base))
        value, base_value = head[bound.metric], base_metrics[bound.metric]
        checked.append(IncreaseResult(bound, value, base_value, cfg.level, **extra))
    return SettingGate(setting, results, tuple(checked))


def _integrity_gate(run_dir: Path, step: str | None, accept: tuple[str, ...]) -> Gate:
    """A gate with no bound yet: the run's integrity findings, recomputed from its store."""
    from mismatch_probe.metrics.steps import resolve_step
    from mismatch_probe.rundir.integrity import run_integrity

    tokens = store.resolve_tokens_path(run_dir)
    number = None if step is None else resolve_step(tokens, step)
    return Gate((), integrity=run_integrity(run_dir), step=number, accepted=accept)
