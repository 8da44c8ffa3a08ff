"""The trend of an ingested run: key metrics against training step.

``steps_of`` gives the per-step metrics (``Steps``: ``steps.json``, written by ``probe ingest``,
recomputed from ``tokens.parquet`` when missing or computed with another metrics config);
``build_trend`` makes the ``Trend`` a report shows of them. The trend holds
``TREND_METRICS`` (those the metric engine computed) and every preset's token masked fraction
that is not zero throughout. Steps where a metric fails its verdict threshold are marked, and
the steps where it *crosses* (fails after passing, or fails at the first step) are listed. A note
says whether the ratio can include policy staleness (``run.json`` ``off_policy``), since
asynchronous frameworks train on rollouts of older weights.

Plain functions over data; the section's table and plot are ``report.trend_table`` and
``report.trend_plot``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.metrics.verdicts import HEALTH_CHECKS, RULES, HealthCheck

# (metric, what it is); a metric the engine did not compute is left out.
TREND_METRICS: tuple[tuple[str, str], ...] = (
    ("k3_kl", "k3 KL(rollout‖train)"),
    ("token_mult_prob_error", "NeMo-RL token mult. prob. error"),
    ("chi2_token", "token χ²"),
    ("f_tau_2", "tokens with ρ outside [0.5, 2]"),
)
# Thresholds beyond the verdict table: NeMo-RL's docs flag a mult. prob. error above 1.05.
EXTRA_CHECKS: tuple[HealthCheck, ...] = (
    HealthCheck("token_mult_prob_error", "max", (1.05,), "token mult. prob. error", "NeMo-RL"),
)
PRESET_MASKED = "presets/{}/token_masked_fraction"


def threshold_of(metric: str) -> HealthCheck | None:
    return next((c for c in (*HEALTH_CHECKS, *EXTRA_CHECKS) if c.metric == metric), None)


@dataclass(frozen=True)
class Trend:
    """Per-step values of the shown metrics.

    Attributes:
        steps: the steps, ascending.
        series: ``{metric: [value per step]}`` (trend metrics, then preset masked fractions).
        failing: ``{metric: set of steps where it fails its threshold}``.
        crossings: ``{metric: [steps where it starts failing]}``.
        note: the staleness sentence for this run.
        rewritten: the sentence naming the steps written again (a restarted trainer; ``""``
            when none).
    """

    steps: list[int]
    series: dict[str, list[float]]
    failing: dict[str, set[int]]
    crossings: dict[str, list[int]]
    note: str
    rewritten: str = ""


@dataclass(frozen=True)
class Steps:
    """Per-step flat metrics of an ingested run and the config they were computed with.

    Attributes:
        config: the ``MetricsConfig.describe()`` of the metrics.
        per_step: ``{step: {metric: value}}``, steps ascending.
        stored: True when they are what ``steps.json`` holds (nothing to write again).
    """

    config: dict[str, Any]
    per_step: dict[int, dict[str, float]]
    stored: bool = False


def read_steps(run_dir: Path) -> Steps | None:
    """``steps.json`` as ``write_steps`` wrote it (through the NaN-refusing reader), or None
    when it is missing or of another shape."""
    try:
        data = store.read_json(Path(run_dir) / store.STEPS_FILE)
        per_step = {int(s): dict(m) for s, m in data["steps"].items()}
        config = data["config"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    numbers = all(
        isinstance(v, int | float) and not isinstance(v, bool)
        for m in per_step.values()
        for v in m.values()
    )
    return Steps(config, dict(sorted(per_step.items())), stored=True) if numbers else None


def steps_of(tokens: Path, stored: Steps | None, config: dict[str, Any]) -> Steps | None:
    """The per-step metrics of the store ``tokens`` computed with ``config``
    (``MetricsConfig.describe()``): ``stored`` when it was computed with it, else computed
    again; None for a store without a ``step`` column."""
    from mismatch_probe.metrics.steps import compute_step_metrics, list_steps

    if not list_steps(tokens):
        return None
    if stored is not None and stored.config == config:
        return stored
    cfg = _config_from(config)
    return Steps(cfg.describe(), compute_step_metrics(tokens, cfg))


def write_steps(out_dir: Path, steps: Steps) -> Path:
    """``steps.json``: ``{"config": ..., "steps": {"<step>": {metric: value}}}``."""
    data = {"config": steps.config, "steps": {str(s): m for s, m in steps.per_step.items()}}
    path = Path(out_dir) / store.STEPS_FILE
    store.write_json(path, data)
    return path


def _config_from(described: dict[str, Any]) -> Any:
    from mismatch_probe.metrics import MetricsConfig

    return MetricsConfig(
        rollout_is=described.get("rollout_is"),
        rollout_is_threshold=described.get("rollout_is_threshold") or "2.0",
        rollout_rs=described.get("rollout_rs"),
        rollout_rs_threshold=described.get("rollout_rs_threshold"),
        batch_normalize=bool(described.get("batch_normalize")),
        presets=tuple(described.get("presets") or ()),
    )


def build_trend(per_step: dict[int, dict[str, float]], run: dict[str, Any]) -> Trend | None:
    """The trend of ``per_step`` metrics (None when there are no steps)."""
    if not per_step:
        return None
    steps = sorted(per_step)
    present = [m for m, _ in TREND_METRICS if all(m in per_step[s] for s in steps)]
    presets = sorted({k for s in steps for k in per_step[s] if k.startswith("presets/")})
    masked = [k for k in presets if k.endswith("/token_masked_fraction")]
    series = {m: [per_step[s].get(m, 0.0) for s in steps] for m in present}
    for key in masked:  # a TIS variant masks exactly what its rejection base masks: shown once
        values = [per_step[s].get(key, 0.0) for s in steps]
        if any(v > 0 for v in values) and values not in series.values():
            series[key] = values
    failing: dict[str, set[int]] = {}
    crossings: dict[str, list[int]] = {}
    for metric, values in series.items():
        check = threshold_of(metric)
        if check is None:
            continue
        holds = RULES[check.rule].holds
        fails = [not holds(v, check.bounds) for v in values]
        failing[metric] = {s for s, f in zip(steps, fails, strict=True) if f}
        crossings[metric] = [
            s for i, s in enumerate(steps) if fails[i] and (i == 0 or not fails[i - 1])
        ]
    return Trend(steps, series, failing, crossings, staleness_note(run), rewrite_note(run))


def staleness_note(run: dict[str, Any]) -> str:
    """Whether the measured ratio is engine mismatch alone or mismatch plus staleness."""
    info = run.get("off_policy") or {}
    bound, stale, source = (info.get(k) for k in ("max_off_policy_steps", "staleness", "source"))
    if stale is False or bound == 0:
        return "On-policy training: the ratio measures engine mismatch."
    if stale and bound is None:
        return (
            f"Asynchronous training with an unknown off-policy bound ({source}): the measured "
            "ratio is engine mismatch plus policy staleness."
        )
    if bound is not None:
        return (
            f"Rollouts may be up to {bound} policy versions older than the trainer's weights "
            f"(max_off_policy_steps = {bound}, from {source}): the measured ratio is engine "
            "mismatch plus policy staleness."
        )
    where = f" ({source})" if source else ""
    return (
        f"The logs do not say whether rollouts were on-policy{where}: the measured ratio is "
        "engine mismatch, plus policy staleness if the run was asynchronous."
    )


def rewrite_note(run: dict[str, Any]) -> str:
    """``Steps 4, 5 were written again ...`` from ``run.json``'s ``rewritten_steps`` (``""``)."""
    found = run.get("rewritten_steps")
    steps = [r.get("step") for r in found if isinstance(r, dict)] if isinstance(found, list) else []
    steps = [s for s in steps if isinstance(s, int)]
    if not steps:
        return ""
    word = "Step" if len(steps) == 1 else "Steps"
    verb = "was" if len(steps) == 1 else "were"
    return (
        f"{word} {', '.join(map(str, steps))} {verb} written again (a restarted trainer): "
        "the later attempt replaces the earlier, whose data is not counted."
    )


def step_metrics(run_dir: Path, step: str) -> dict[str, float]:
    """One step's flat metrics (``"last"`` or a number): from ``steps.json``, else computed."""
    from mismatch_probe.metrics import compute_metrics
    from mismatch_probe.metrics.steps import resolve_step

    if not run_dir.is_dir():
        from mismatch_probe.errors import ProbeError

        raise ProbeError(f"{run_dir} is not a run directory")
    number = resolve_step(store.resolve_tokens_path(run_dir), step)
    stored = read_steps(run_dir)
    if stored is not None and number in stored.per_step:
        return {k: float(v) for k, v in stored.per_step[number].items()}
    return compute_metrics(store.resolve_tokens_path(run_dir), step=number).flat()
