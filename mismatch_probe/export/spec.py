"""What ``probe export`` writes, as data: the tracker spec (``ExportSpec``), one step's
numbers (``StepPoint``) and their tracker names (``scalars``, the naming rules of the package
docstring). The readers (``points``) and the writers (``trackers``) both build on it.
"""

from __future__ import annotations

from collections.abc import Mapping
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
