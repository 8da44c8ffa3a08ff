"""The four writers of ``probe export``: each takes ``StepPoint`` s (``step``), then ``close``.

* ``jsonl``: verl's ``file`` logger (``verl/utils/tracking.py`` ``FileLogger``): one line
  ``{"step": N, "data": {name: value}}`` per step; scalars only, as verl writes;
* ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` (verl's own TensorBoard adapter):
  scalars, the log-rho histogram (``add_histogram_raw``: the bins over [-3, 3], a bucket below
  for the underflow and one above for the overflow), the findings as text;
* ``wandb``: ``wandb.init`` (``resume="must"`` with ``--wandb-run``), ``define_metric`` of every
  series against ``probe/step``, ``wandb.Histogram`` of the bins (under- and overflow as the
  scalars ``probe/log_ratio_underflow`` / ``_overflow``); ``WANDB_MODE=offline`` keeps it local;
* ``trackio``: ``trackio.init`` / ``log`` / ``finish`` into its local store (``TRACKIO_DIR``:
  ``--out`` sets it), the histogram as ``trackio.Histogram``.

A missing package is one line naming the extra that installs it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.export.spec import (
    EXTRAS,
    STEP_AXIS,
    ExportSpec,
    StepPoint,
    findings_text,
    scalars,
)

HIST_TAG = "probe/log_ratio"


def _missing(target: str) -> ProbeError:
    extra = EXTRAS[target]
    return ProbeError(
        f"--to {target} needs the {extra} package: pip install 'mismatch-probe[{extra}]'"
    )


def edges(hist: dict[str, Any]) -> np.ndarray:
    """The bin edges of a ``log_ratio_hist`` curve."""
    return np.linspace(float(hist["lo"]), float(hist["hi"]), len(hist["counts"]) + 1)


class JsonlTracker:
    def __init__(self, where: Path) -> None:
        self.where = where
        where.parent.mkdir(parents=True, exist_ok=True)
        self.fh = where.open("w", encoding="utf-8")

    def step(self, point: StepPoint) -> None:
        data = {"step": point.step, "data": scalars(point)}
        self.fh.write(json.dumps(data, allow_nan=False) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


class TensorboardTracker:
    def __init__(self, where: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard") from None
        self.where = where
        self.writer = SummaryWriter(str(where))

    def step(self, point: StepPoint) -> None:
        for name, value in scalars(point).items():
            self.writer.add_scalar(name, value, point.step)
        if point.hist is not None:
            self._histogram(point)
        text = findings_text(point)
        if text:
            self.writer.add_text("probe/integrity", text, point.step)

    def _histogram(self, point: StepPoint) -> None:
        hist = point.hist
        assert hist is not None
        e = edges(dict(hist))
        counts = [int(hist["underflow"]), *map(int, hist["counts"]), int(hist["overflow"])]
        limits = [float(e[0]), *map(float, e[1:]), float(sys.float_info.max)]
        centers = np.r_[e[0], (e[:-1] + e[1:]) / 2, e[-1]]
        num = sum(counts)
        if num == 0:
            return
        weights = np.asarray(counts, np.float64)
        filled = np.flatnonzero(weights)  # buckets 0 and -1: under- and overflow
        self.writer.add_histogram_raw(
            HIST_TAG,
            min=float(e[max(filled[0] - 1, 0)]),
            max=float(e[min(filled[-1], len(e) - 1)]),
            num=num,
            sum=float((weights * centers).sum()),
            sum_squares=float((weights * centers**2).sum()),
            bucket_limits=limits,
            bucket_counts=counts,
            global_step=point.step,
        )

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, where: Path | None, spec: ExportSpec, run_dir: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("wandb") from None
        self.wandb = wandb
        self.resumed = spec.wandb_run is not None
        if where is not None:
            where.mkdir(parents=True, exist_ok=True)

        kwargs: dict[str, Any] = {"project": spec.project}
        if where is not None:
            kwargs["dir"] = str(where)
        if spec.wandb_run is not None:
            kwargs.update(id=spec.wandb_run, resume="must")
        else:
            kwargs.update(name=f"probe {run_dir.name}", job_type="mismatch_probe")
        self.run = wandb.init(**kwargs)
        self.where = self.run.dir if where is None else where
        self.run.define_metric(STEP_AXIS)
        for prefix in ("probe/*", "rollout_corr/*", "train/*"):
            if prefix == "probe/*" or not self.resumed:
                self.run.define_metric(prefix, step_metric=STEP_AXIS)

    def step(self, point: StepPoint) -> None:
        data: dict[str, Any] = {STEP_AXIS: point.step, **scalars(point, self.resumed)}
        if point.hist is not None:
            counts = np.asarray(point.hist["counts"], np.int64)
            data[HIST_TAG] = self.wandb.Histogram(np_histogram=(counts, edges(dict(point.hist))))
            data["probe/log_ratio_underflow"] = float(point.hist["underflow"])
            data["probe/log_ratio_overflow"] = float(point.hist["overflow"])
        self.run.log(data)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # the service writes the run file to its end before it stops


class TrackioTracker:
    def __init__(self, where: Path | None, spec: ExportSpec, run_dir: Path) -> None:
        if where is not None:
            loaded = sys.modules.get("trackio.utils")
            if loaded is not None and Path(loaded.TRACKIO_DIR) != where:
                raise ProbeError(
                    f"trackio already writes to {loaded.TRACKIO_DIR} in this process: "
                    "set TRACKIO_DIR before starting instead of --out"
                )
            os.environ["TRACKIO_DIR"] = str(where)
        try:
            import trackio
        except ImportError:
            raise _missing("trackio") from None
        self.trackio = trackio
        self.where = Path(sys.modules["trackio.utils"].TRACKIO_DIR)
        self.run = trackio.init(project=spec.project, name=f"probe {run_dir.name}", embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)  # fmt: skip

    def step(self, point: StepPoint) -> None:
        data: dict[str, Any] = dict(scalars(point))
        if point.hist is not None:
            counts = np.asarray(point.hist["counts"], np.int64)
            data[HIST_TAG] = self.trackio.Histogram(np_histogram=(counts, edges(dict(point.hist))))
        self.trackio.log(data, step=point.step)

    def close(self) -> None:
        self.trackio.finish()


def open_tracker(spec: ExportSpec, where: Path, run_dir: Path) -> Any:
    """The writer of ``spec.target`` (``where``: its output; wandb and trackio keep their own
    default location unless ``--out`` was given)."""
    if spec.target == "jsonl":
        return JsonlTracker(where)
    if spec.target == "tensorboard":
        return TensorboardTracker(where)
    own = spec.path  # None: the tracker's own default directory
    if spec.target == "wandb":
        return WandbTracker(own, spec, run_dir)
    return TrackioTracker(own, spec, run_dir)
