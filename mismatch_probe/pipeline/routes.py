"""The routing stage of ``probe scan``: what the scan calls for a mixture-of-experts model.

For a dense model ``prepare`` returns ``None`` and every other function, given that ``None``,
is a no-op (the scan calls them all the same: no routing branch in the pipeline). For an MoE
model: the engine is started so that routes can be captured
(``engine_kwargs``, ``engine_env``), each engine's routes are captured after sampling
(``capture``), the training forward records (or, with ``--routing-replay rollout``, forces) its
routes while rescoring (``train_routing``), and the routes are stored (``routing.parquet``),
measured (``routing.json``); the report draws the routing section and plots from those numbers
(handed over in memory at the end of a scan, read back from the file by ``probe report``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from mismatch_probe import store
from mismatch_probe.engine import routing as capture_engine
from mismatch_probe.routing import replay
from mismatch_probe.routing.shape import RoutingShape

if TYPE_CHECKING:
    from mismatch_probe.pipeline.timing import Timer
    from mismatch_probe.settings import Setting
    from mismatch_probe.training.routing import TrainRouting


@dataclass(frozen=True)
class Routing:
    """An MoE model's routing shape and how its engine captures routes."""

    shape: RoutingShape
    setup: capture_engine.EngineSetup


def prepare(config: Any, modes: Sequence[str]) -> Routing | None:
    """``None`` for a dense model (a dense model asked to replay routes is a ProbeError)."""
    shape = replay.check_replay(config, modes)
    return None if shape is None else Routing(shape, capture_engine.engine_setup())


def engine_kwargs(routing: Routing | None) -> dict[str, Any]:
    """Engine arguments the capture needs (they win over ``--vllm-arg``)."""
    return dict(routing.setup.kwargs) if routing else {}


def engine_env(routing: Routing | None) -> dict[str, str]:
    """Environment variables the capture needs while the engine lives (vLLM reads them at
    creation)."""
    return dict(routing.setup.env) if routing else {}


def capture(
    llm: Any, rollouts: Sequence[Any], routing: Routing | None, timer: Timer
) -> list[Any] | None:
    """The engine's ``[P + R - 1, L, K]`` routes of each rollout (a multi-turn trajectory's:
    ``R`` everything after its first prompt, ``trajectory.token_view``), timed as
    ``route_capture``; None for a dense model."""
    if routing is None:
        return None
    from mismatch_probe.pipeline.trajectory import token_view

    with timer("route_capture"):
        sequences = [token_view(r) for r in rollouts]
        shape, path = routing.shape, routing.setup.capture_path
        return capture_engine.capture_routes(llm, sequences, shape, path)


def train_routing(
    model: Any,
    requests: Sequence[Any],
    routing: Routing | None,
    mode: str,
    rollout_routes: Sequence[Any] | None,
) -> TrainRouting | None:
    """Hooks that record the training routes (and force the rollout's under R3)."""
    if routing is None:
        return None
    from mismatch_probe.training.routing import TrainRouting

    forced = replay.forced_routes(mode, rollout_routes or [])
    return TrainRouting(model, requests, routing.shape, forced=forced)


def batch_context(routing: TrainRouting | None) -> Callable[[list[int]], Any] | None:
    """What the rescorer enters around each batch's forward (None: nothing to hook)."""
    return routing.batch if routing is not None else None


def recorded(routing: TrainRouting | None) -> list[Any] | None:
    """The training side's own ``[T, L, K]`` routes of each request (None: a dense model)."""
    return routing.recorded if routing is not None else None


def write_routing(
    path: Path, scored: dict[Setting, Any], routing: Routing | None, run: dict[str, Any]
) -> None:
    """``path`` (``routing.parquet``, or a sharded scan's part): both sides' routes of every
    setting, keyed like the token store; records the routing shape and capture path in ``run``
    (``run["routing"]``, also the file's metadata). Nothing for a dense model."""
    from mismatch_probe.routing import store as routing_store

    if routing is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)  # a shard's part directory
    tables = [
        routing_store.routing_table(
            setting.name,
            [r.seq_id + rescored.seq_offset for r in rescored.rollouts],
            [len(r.prompt_ids) for r in rescored.rollouts],
            rescored.rollout_routes,
            rescored.train_routes,
        )
        for setting, rescored in scored.items()
    ]
    capture_path = routing.setup.capture_path
    routing_store.write_routing(path, pa.concat_tables(tables), routing.shape, capture_path, run)
    run["routing"] = routing_store.routing_metadata(routing.shape, capture_path)


def finish(
    out: Path, routing: Routing | None, settings: list[Setting], run: dict[str, Any]
) -> tuple[dict[str, Path], dict[str, Any]]:
    """The finishing step's routing part: the metadata in ``run`` (``run["routing"]``) and
    ``routing.json`` over the stored routes of ``settings``. For a dense model, the routing
    files an earlier MoE run left in ``out`` are removed (they would describe another run).

    Returns:
        ``{"routing": ..., "routing_metrics": ...}`` and what ``routing.json`` holds (both {}
        for a dense model).
    """
    from mismatch_probe.routing import store as routing_store

    if routing is None:
        remove_outputs(out)
        return {}, {}
    run["routing"] = routing_store.routing_metadata(routing.shape, routing.setup.capture_path)
    stored = {"routing": routing_store.resolve_routing_path(out)}
    paths, data = routing_outputs(out, settings)
    return {**stored, **paths}, data


def routing_outputs(out: Path, settings: list[Setting]) -> tuple[dict[str, Path], dict[str, Any]]:
    """``routing.json`` (``store.ROUTING_METRICS_FILE``): per rollout/training pair, the
    disagreement, the mismatch split by it, and what each replay mode removes; returns its
    path and what it holds (the report draws its section and plots from that)."""
    from mismatch_probe.routing.metrics import analyze_run
    from mismatch_probe.routing.store import resolve_routing_path
    from mismatch_probe.settings import Setting

    groups: dict[str, dict[str, str]] = {}
    for s in settings:
        groups.setdefault(Setting(s.rollout, s.train_dtype).name, {})[s.replay] = s.name
    results = {}
    for label, modes in groups.items():
        tokens, routes = store.resolve_tokens_path(out), resolve_routing_path(out)
        metrics, comparison = analyze_run(tokens, routes, modes)
        results[label] = {
            "settings": modes,
            "metrics": metrics.to_json_dict(),
            "replay": comparison.to_json_dict(),
        }
    path = out / store.ROUTING_METRICS_FILE
    store.write_json(path, results)
    return {"routing_metrics": path}, results


def remove_outputs(out: Path) -> None:
    """Delete routing files a previous run left in ``out`` (they would describe another run;
    the report removes the routing plots of a run without ``routing.json``)."""
    for name in (store.ROUTING_FILE, store.ROUTING_METRICS_FILE):
        (out / name).unlink(missing_ok=True)
