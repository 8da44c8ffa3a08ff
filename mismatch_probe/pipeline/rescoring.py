"""The training stage of ``probe scan``: the training side's models rescore the engines' tokens.

One training model per training dtype (loaded by ``load_model``, the one loader of every
training-side model of a scan: rescoring, and the attribution rungs' extra models) rescores every
rollout setting that produced tokens, once per routing replay mode. For an MoE model the
training forward records (or, with ``--routing-replay rollout``, forces) its routes
(``routes.train_routing``: a no-op for a dense model). This stage knows nothing of vLLM.
"""

from __future__ import annotations

import itertools
from functools import partial
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline import layers, routes, trajectory
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.records import Prepared, Rescored, RolloutRun
from mismatch_probe.pipeline.timing import Timer
from mismatch_probe.settings import Setting
from mismatch_probe.training import rescore


def load_model(
    cfg: ScanConfig, path: Path, dtype: str, placements: dict[str, Any], key: str
) -> Any:
    """Load a training-side model of the scan in ``dtype``, placed by ``--train-device-map``
    (``cfg.train_device_map``), and record where it runs under ``placements[key]``
    (``run.json``: ``train_device_map``, ``attribution_device_map``)."""
    model = rescore.load_model(path, dtype, cfg.train_device_map)
    placements[key] = model.probe_device_map
    return model


def rescore_all(
    cfg: ScanConfig,
    prep: Prepared,
    runs: list[RolloutRun],
    timer: Timer,
    progress: Any,
    found_layers: dict[Setting, Any] | None = None,
) -> dict[Setting, Rescored]:
    """Every setting whose rollout setting produced tokens, rescored, in the scan's setting
    order (``seq_offset`` still 0: ``scan.assign_seq_ids`` places them).

    Args:
        found_layers: ``--layers``: each own-routes setting's per-layer sums, filled while its
            training model is loaded (``layers.train_step``).

    Raises:
        ProbeError: no rollout setting produced tokens.
    """
    done = [r for r in runs if r.rollouts]
    if not done:
        reasons = "; ".join(f"{r.setting.name}: {r.skipped}" for r in runs)
        raise ProbeError(f"no setting could run ({reasons})")
    scored: dict[Setting, Rescored] = {}
    found = {} if found_layers is None else found_layers
    for train_dtype in cfg.train_dtypes:
        with timer("model_load"):
            model = load_model(cfg, prep.model_dir, train_dtype, prep.train_devices, train_dtype)
        for run, mode in itertools.product(done, cfg.routing_replay):
            setting = Setting(run.setting, train_dtype, mode)
            with timer("rescoring"):
                scored[setting] = _rescore_one(cfg, prep, model, run, setting, progress)
        layers.train_step(cfg, model, train_dtype, done, found, timer)  # no-op without --layers
        del model
    order = {s: i for i, s in enumerate(cfg.settings())}
    return dict(sorted(scored.items(), key=lambda item: order[item[0]]))


def _rescore_one(
    cfg: ScanConfig, prep: Prepared, model: Any, run: RolloutRun, setting: Setting, progress: Any
) -> Rescored:
    requests = [trajectory.score_request(r) for r in run.rollouts]  # generated tokens only
    total = sum(len(r.scored_indices()) for r in requests)
    task = progress.add_task(f"score {setting.name}", total=total, unit="tokens")
    routing = routes.train_routing(model, requests, prep.routing, setting.replay, run.routes)
    result = rescore.rescore(
        model,
        requests,
        cfg.rescoring_spec(),
        cfg.flip_eps_for(setting),
        cfg.batch_tokens,
        on_batch=partial(_advance, progress, task),
        batch_context=routes.batch_context(routing),
    )
    return Rescored(run.rollouts, result, run.routes, routes.recorded(routing))


def _advance(progress: Any, task: Any, n: int) -> None:
    progress.update(task, advance=n)
