"""``probe export RUN --to wandb|tensorboard|trackio|jsonl``: a run's numbers per training step,
where users already chart theirs (also ``probe watch --export``, step by step).

Names (``scalars``): every metric under ``probe/`` (ours, the spec's names); the metrics verl
logs again under its own ``rollout_corr/`` names (spec sections 1-3: verl's
``rollout_corr_helper`` prefixes exactly these); NeMo-RL's three under its ``train/`` names
(``token_mult_prob_error``; ``gen_kl_error`` is our ``k3_kl``, ``policy_kl_error`` our
``k3_kl_reverse``). The integrity findings as counts (``probe/integrity/errors``,
``.../warnings``, ``.../<check>_tokens``) and the verdicts as 1 (pass) / 0 (fail)
(``probe/verdict/<metric>``, ``probe/verdict/failed``), the off-policy lag when the logs have it
(``probe/off_policy_lag_max``, ``_mean``), and a histogram of log rho per step
(``probe/log_ratio``, the metric engine's bins over [-3, 3]). When ``--wandb-run`` resumes the
training run's own W&B run, the framework-named metrics go under ``probe/`` as well
(``probe/rollout_corr/kl``) so that the trainer's own series of those names are never written
over; every series we log is charted against ``probe/step`` (``define_metric``), never the
trainer's step counter.

The trackers are optional extras (``pip install mismatch-probe[wandb]``, ``[tensorboard]``,
``[trackio]``); a missing one is one line. ``jsonl`` is verl's ``file`` logger format
(``{"step": N, "data": {name: value}}`` per line), which ``probe ingest verl-log`` reads back.
Reading the run is ``points`` (``steps.jsonl`` of a watched run, else ``steps.json`` and one
metrics pass per step for the histograms); the writers are ``trackers``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.integrity import ERROR, Finding

TARGETS = ("wandb", "tensorboard", "trackio", "jsonl")
EXTRAS = {"wandb": "wandb", "tensorboard": "tensorboard", "trackio": "trackio"}
# verl's rollout_corr_helper: compute_offpolicy_metrics' names; the IS and RS metrics start so
VERL_OFF_POLICY = (
    "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "kl", "k3_kl",
    "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio",
    "chi2_token", "chi2_seq",
)  # fmt: skip
VERL_PREFIXES = ("rollout_is_", "rollout_is", "rollout_rs_")
NEMO_NAMES = {
    "token_mult_prob_error": "train/token_mult_prob_error",
    "k3_kl": "train/gen_kl_error",
    "k3_kl_reverse": "train/policy_kl_error",
}
STEP_AXIS = "probe/step"


@dataclass(frozen=True)
class ExportSpec:
    """Where to export: the tracker, its output path (None: ``RUN/export/<tracker>``), the W&B
    run to resume and the W&B / trackio project."""

    target: str
    path: Path | None = None
    wandb_run: str | None = None
    project: str = "mismatch-probe"

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ProbeError(f"--to {self.target}: choose from {', '.join(TARGETS)}")
        if self.wandb_run is not None and self.target != "wandb":
            raise ProbeError("--wandb-run resumes a W&B run: it needs --to wandb")

    @classmethod
    def from_options(
        cls, target: str, path: Path | None, wandb_run: str | None, project: str
    ) -> ExportSpec:
        return cls(target, None if path is None else Path(path), wandb_run, project)

    def where(self, run_dir: Path) -> Path:
        default = run_dir / "export" / (f"{self.target}.jsonl" if self.target == "jsonl" else
                                        self.target)  # fmt: skip
        return self.path if self.path is not None else default


@dataclass(frozen=True)
class StepPoint:
    """One step to export: its flat metrics, log-rho histogram (the ``log_ratio_hist`` curve,
    None when unknown), integrity findings and off-policy lag."""

    step: int
    metrics: Mapping[str, float]
    hist: Mapping[str, Any] | None = None
    findings: tuple[Finding, ...] = ()
    lag: Mapping[str, float] | None = None


def is_verl_name(name: str) -> bool:
    return name in VERL_OFF_POLICY or name.startswith(VERL_PREFIXES)


def scalars(point: StepPoint, resumed: bool = False) -> dict[str, float]:
    """Every scalar of a step under its tracker names (see the module docstring)."""
    from mismatch_probe.metrics.verdicts import HEALTH_CHECKS, RULES

    theirs = "probe/" if resumed else ""
    metrics = point.metrics
    out = {f"probe/{k}": float(v) for k, v in metrics.items()}
    out.update({f"{theirs}rollout_corr/{k}": float(v) for k, v in metrics.items()
                if is_verl_name(k)})  # fmt: skip
    out.update({f"{theirs}{n}": float(metrics[k]) for k, n in NEMO_NAMES.items() if k in metrics})
    errors = sum(f.severity == ERROR for f in point.findings)
    out["probe/integrity/errors"] = float(errors)
    out["probe/integrity/warnings"] = float(len(point.findings) - errors)
    for f in point.findings:
        out[f"probe/integrity/{f.check}_tokens"] = float(f.tokens)
    checks = [c for c in HEALTH_CHECKS if c.metric in metrics]
    passed = {c.metric: RULES[c.rule].holds(metrics[c.metric], c.bounds) for c in checks}
    out.update({f"probe/verdict/{m}": float(ok) for m, ok in passed.items()})
    if metrics:
        out["probe/verdict/failed"] = float(sum(not ok for ok in passed.values()))
    if point.lag is not None:
        out["probe/off_policy_lag_max"] = float(point.lag["max"])
        out["probe/off_policy_lag_mean"] = float(point.lag["mean"])
    return out


def findings_text(point: StepPoint) -> str:
    """The step's findings in words, one per line (``""`` when clean)."""
    return "\n".join(f"{f.severity} {f.check}: {f.message}" for f in point.findings)


@dataclass(frozen=True)
class ExportResult:
    target: str
    where: str
    steps: int

    def summary(self) -> str:
        return f"exported {self.steps} steps to {self.target}: {self.where}"


def open_exporter(spec: ExportSpec, run_dir: Path) -> Any:
    """A writer with ``step(StepPoint)``, ``close()`` and ``where``, for ``spec``'s tracker.

    Raises:
        ProbeError: the tracker's package is not installed (the extra to install is named).
    """
    from mismatch_probe.export import trackers

    return trackers.open_tracker(spec, spec.where(run_dir), run_dir)


def export_run(run_dir: Path, spec: ExportSpec) -> ExportResult:
    """Every step of ``run_dir`` to ``spec``'s tracker, steps ascending."""
    from mismatch_probe.export.points import run_points

    points: Iterable[StepPoint] = run_points(Path(run_dir))
    exporter = open_exporter(spec, Path(run_dir))
    n = 0
    try:
        for point in points:
            exporter.step(point)
            n += 1
    finally:
        exporter.close()
    return ExportResult(spec.target, str(exporter.where), n)
