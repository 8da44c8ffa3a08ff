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

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe.export import points, trackers
from mismatch_probe.export.spec import (
    EXTRAS,
    NEMO_NAMES,
    STEP_AXIS,
    TARGETS,
    VERL_OFF_POLICY,
    VERL_PREFIXES,
    ExportSpec,
    StepPoint,
    findings_text,
    is_verl_name,
    scalars,
)  # fmt: skip

__all__ = [
    "EXTRAS", "NEMO_NAMES", "STEP_AXIS", "TARGETS", "VERL_OFF_POLICY", "VERL_PREFIXES",
    "ExportResult", "ExportSpec", "StepPoint", "export_run", "findings_text", "is_verl_name",
    "open_exporter", "scalars",
]  # fmt: skip


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
    return trackers.open_tracker(spec, spec.where(run_dir), run_dir)


def export_run(run_dir: Path, spec: ExportSpec) -> ExportResult:
    """Every step of ``run_dir`` to ``spec``'s tracker, steps ascending."""
    steps: Iterable[StepPoint] = points.run_points(Path(run_dir))
    exporter = open_exporter(spec, Path(run_dir))
    n = 0
    try:
        for point in steps:
            exporter.step(point)
            n += 1
    finally:
        exporter.close()
    return ExportResult(spec.target, str(exporter.where), n)
