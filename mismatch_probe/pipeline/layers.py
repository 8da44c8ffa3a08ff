"""The layer stage of ``probe scan --layers``: where in the network the two sides part.

While each rollout setting's engine is up (``engine_step``), forward hooks on vLLM's decoder
layers (``engine.layers``) capture the residual stream of the first ``--layers-sequences``
sequences (all without it) during a prefill of their token ids (prompt + response): the stream,
each layer's attention and MLP outputs and the sampled tokens' logits, a chunk of ``CHUNK``
sequences at a time, each sequence spilled to a temporary ``.npz`` file (the engine and the
training model never share memory). While each training model is loaded (``train_step``, called
by the rescoring stage), each chunk is read back, the training side's hidden states computed for
the same ids (``training.layers``), both compared and reduced to per-layer sums
(``metrics.layers.LayerSums``) before the next chunk: ``[tokens, layers, hidden]`` never exists
for more than a chunk. ``finish`` turns the sums into ``layers.json`` (``rundir.layers``): the
floor is the identity setting's curve (float32 rollout against float32 training) when the scan
has one, else ``NOMINAL_FLOOR``, and is named as such; the identity setting's own curve is judged
against ``NOMINAL_FLOOR`` (``OWN_FLOOR``).

Only the own-routes settings (``--routing-replay none``) are compared: the training side's hidden
states are computed with the model's own routes.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mismatch_probe.engine import layers as engine_layers
from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.layers import (
    LayerComparison,
    LayerSums,
    curve,
    floor_of,
    logit_floor,
    logit_point,
    mark_routing,
    routing_flips,
)
from mismatch_probe.settings import RolloutSetting, Setting

if TYPE_CHECKING:
    from mismatch_probe.engine.rollout import Rollout
    from mismatch_probe.pipeline.config import ScanConfig
    from mismatch_probe.pipeline.records import RolloutRun
    from mismatch_probe.pipeline.timing import Timer

CHUNK = 4  # sequences captured, compared and reduced at a time
IDENTITY = Setting(RolloutSetting("float32"), "float32")  # the floor's comparison
OWN_FLOOR = "nominal float32 rounding (this setting is the others' floor)"


@dataclass
class EngineLayers:
    """One rollout setting's captures: chunk files (``.npz``: the ``stream``, each part and the
    next-token ``logit`` arrays of ``engine.layers.capture``), one per sequence, and the
    rollout index of each sequence."""

    folder: Path
    chunks: list[list[tuple[int, Path]]] = field(default_factory=list)

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def check(cfg: ScanConfig) -> None:
    """Refuse, before any engine starts, what ``--layers`` cannot measure.

    Raises:
        ProbeError: ``--layers-sequences`` without ``--layers`` or below 1, an engine out of
            eager mode, a sharded scan.
    """
    if cfg.layers_sequences is not None and not cfg.layers:
        raise ProbeError("--layers-sequences needs --layers")
    if not cfg.layers:
        return
    if cfg.layers_sequences is not None and cfg.layers_sequences < 1:
        raise ProbeError(f"--layers-sequences must be >= 1, got {cfg.layers_sequences}")
    if cfg.sharded:
        raise ProbeError("--layers runs on a whole scan; drop --shards/--ray")
    engine_layers.check_eager({**engine_kwargs(cfg), **cfg.vllm_args})


def engine_kwargs(cfg: ScanConfig) -> dict[str, Any]:
    """Engine arguments ``--layers`` needs (eager mode; nothing without it)."""
    return dict(engine_layers.ENGINE_KWARGS) if cfg.layers else {}


def engine_env(cfg: ScanConfig) -> dict[str, str]:
    """Environment ``--layers`` needs while the engine lives (the multiprocess engine pickles
    the hook functions)."""
    return dict(engine_layers.ENGINE_ENV) if cfg.layers else {}


def token_ids(r: Rollout) -> list[int]:
    """The ids of one sequence as both sides see them: prompt + everything after it."""
    return [*r.prompt_ids, *r.continuation()]


def picked(cfg: ScanConfig, rollouts: Sequence[Rollout]) -> list[int]:
    """The rollout indices compared: the first ``--layers-sequences`` (all without it)."""
    count = len(rollouts) if cfg.layers_sequences is None else cfg.layers_sequences
    return list(range(min(count, len(rollouts))))


def engine_step(cfg: ScanConfig, llm: Any, run: RolloutRun, timer: Timer) -> None:
    """Capture the engine's streams of ``run`` (``run.layers``, timed as ``layers_capture``)
    while its engine is up; nothing without ``--layers``."""
    if not cfg.layers or not run.rollouts:
        return
    with timer("layers_capture"):
        engine_layers.check_eager(run.engine_args)
        run.layers = capture_run(llm, run.rollouts, picked(cfg, run.rollouts))


def capture_run(llm: Any, rollouts: Sequence[Rollout], indices: Sequence[int]) -> EngineLayers:
    """Every chunk of ``indices`` captured and spilled (the hooks installed for the capture
    only)."""
    found = EngineLayers(Path(tempfile.mkdtemp(prefix="probe-layers-")))
    engine_layers.run_on_model(llm, engine_layers.install)
    try:
        for start in range(0, len(indices), CHUNK):
            chunk = indices[start : start + CHUNK]
            streams = engine_layers.capture(llm, [token_ids(rollouts[i]) for i in chunk])
            files = []
            for i, arrays in zip(chunk, streams, strict=True):
                files.append((i, _spill(found.folder, i, arrays)))
            found.chunks.append(files)
    except BaseException:
        found.discard()
        raise
    finally:
        engine_layers.run_on_model(llm, engine_layers.remove)
    return found


def _spill(folder: Path, index: int, arrays: dict[str, np.ndarray]) -> Path:
    path = folder / f"{index}.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def _read(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def sampled_from(r: Rollout) -> int:
    """The first position whose next token was sampled (the response's first token follows
    the prompt's last position)."""
    return max(len(r.prompt_ids) - 1, 0)


def compare_run(model: Any, rollouts: Sequence[Rollout], found: EngineLayers) -> LayerComparison:
    """The engine's captures of ``found`` against ``model``'s of the same ids, chunk by chunk,
    reduced to per-layer sums: the stream, each part both sides have, the sampled tokens'
    logits (``metrics.layers.LayerComparison``)."""
    from mismatch_probe.training.layers import layer_parts

    sums: LayerComparison | None = None
    for chunk in found.chunks:
        for i, path in chunk:
            engine = _read(path)
            train = layer_parts(model, token_ids(rollouts[i]))
            if engine["stream"].shape != train["stream"].shape:
                raise ProbeError(
                    f"--layers: engine streams {engine['stream'].shape}, training "
                    f"{train['stream'].shape} (the two sides' decoder layers differ)"
                )
            if sums is None:
                sums = LayerComparison.of(engine, train)
            sums.add(engine, train, i, sampled_from(rollouts[i]))
    return sums if sums is not None else LayerComparison(LayerSums(0))


def train_step(
    cfg: ScanConfig,
    model: Any,
    train_dtype: str,
    runs: Sequence[RolloutRun],
    found: dict[Setting, LayerComparison],
    timer: Timer,
) -> None:
    """While the training model of ``train_dtype`` is loaded: every own-routes setting of it
    compared (``found``, updated in place; timed as ``layers_compare``)."""
    if not cfg.layers or "none" not in cfg.routing_replay:
        return
    with timer("layers_compare"):
        for run in runs:
            if run.layers is not None:
                setting = Setting(run.setting, train_dtype)
                found[setting] = compare_run(model, run.rollouts, run.layers)


def precision_views(
    cfg: ScanConfig,
    prep: Any,
    runs: Sequence[RolloutRun],
    timer: Timer,
    load_model: Callable[..., Any],
) -> dict[str, LayerComparison]:
    """The training side alone at each lower precision of the scan (its rollout and training
    dtypes other than float32) against float32, on the first rollout setting's sequences: the
    precision's own curve, no engine (timed as ``layers_views``; {} without ``--layers`` or
    without a lower precision). One model at a time: the lower precision's streams are spilled,
    then compared with the float32 model's, chunk by chunk.

    Args:
        load_model: the scan's loader of training-side models (``rescoring.load_model``).

    Returns:
        ``"transformers <dtype> vs float32"`` -> its per-layer sums.
    """
    done = [r for r in runs if r.rollouts and r.layers is not None]
    lower = [d for d in dict.fromkeys([*cfg.rollout_dtypes, *cfg.train_dtypes]) if d != "float32"]
    if not cfg.layers or not done or not lower:
        return {}
    rollouts = done[0].rollouts
    indices = picked(cfg, rollouts)
    views: dict[str, LayerComparison] = {}
    with timer("layers_views"):
        spilled: dict[str, EngineLayers] = {}
        try:
            for dtype in lower:
                model = load_model(
                    cfg, prep.model_dir, dtype, prep.attribution_devices, f"layers={dtype}"
                )
                spilled[dtype] = capture_train(model, rollouts, indices)
                del model
            model = load_model(
                cfg, prep.model_dir, "float32", prep.attribution_devices, "layers=float32"
            )
            for dtype, found in spilled.items():
                views[f"transformers {dtype} vs float32"] = compare_run(model, rollouts, found)
            del model
        finally:
            for found in spilled.values():
                found.discard()
    return views


def capture_train(model: Any, rollouts: Sequence[Rollout], indices: Sequence[int]) -> EngineLayers:
    """A training model's captures of ``indices``, spilled chunk by chunk like the engine's."""
    from mismatch_probe.training.layers import layer_parts

    found = EngineLayers(Path(tempfile.mkdtemp(prefix="probe-layers-")))
    try:
        for start in range(0, len(indices), CHUNK):
            files = []
            for i in indices[start : start + CHUNK]:
                arrays = layer_parts(model, token_ids(rollouts[i]))
                files.append((i, _spill(found.folder, i, arrays)))
            found.chunks.append(files)
    except BaseException:
        found.discard()
        raise
    return found


def compared_routes(
    cfg: ScanConfig, scored: dict[Setting, Any], found: dict[Setting, LayerComparison]
) -> dict[Setting, tuple[list[Any], list[Any]]]:
    """MoE: each compared setting's engine and training routes of its compared sequences
    ({} for a dense model)."""
    out = {}
    for setting in found:
        r = scored.get(setting)
        if r is None or r.rollout_routes is None or r.train_routes is None:
            continue
        keep = picked(cfg, r.rollouts)
        out[setting] = ([r.rollout_routes[i] for i in keep], [r.train_routes[i] for i in keep])
    return out


def discard(runs: Sequence[RolloutRun]) -> None:
    """Remove the spilled chunk files (after the last training model)."""
    for run in runs:
        if run.layers is not None:
            run.layers.discard()


def _entry(
    sums: LayerComparison,
    identity: LayerComparison | None,
    label: str,
    offset: int,
) -> dict[str, Any]:
    """One comparison's ``layers.json`` entry: the stream's curve against the identity's floor,
    each part's curve against the identity's same part (``parts``), the sampled tokens' logits
    as the last point (``logits``); worst tokens by ``seq_id`` (``offset`` + the index)."""
    floor, _ = floor_of(None if identity is None else identity.stream)
    entry = curve(sums.stream, floor, label)
    parts = {}
    for part, part_sums in sums.parts.items():
        ref = None if identity is None else identity.parts.get(part)
        parts[part] = curve(part_sums, floor_of(ref)[0], label, final_norm=False)
    if parts:
        entry["parts"] = parts
    if sums.logits is not None and sums.logits.tokens:
        ref_logits = None if identity is None else identity.logits
        entry["logits"] = logit_point(sums.logits, logit_floor(ref_logits)[0])
    for rows in (entry["layers"], *(p["layers"] for p in parts.values())):
        for row in rows:
            for worst in row["worst_tokens"]:
                worst["seq_id"] = offset + worst.pop("sequence")
    for worst in entry.get("logits", {}).get("worst_tokens", []):
        worst["seq_id"] = offset + worst.pop("sequence")
    return entry


def finish(
    found: dict[Setting, LayerComparison],
    offsets: dict[Setting, int],
    views: dict[str, LayerComparison] | None = None,
    view_offset: int = 0,
    routes: dict[Setting, tuple[list[Any], list[Any]]] | None = None,
) -> dict[str, Any]:
    """``layers.json``'s content ({} without ``--layers``): per setting its curve against the
    floor (the identity setting's, when it ran), its attention and MLP curves (``parts``) and
    the sampled tokens' logits (``logits``, the curve's last point); the training-side
    precision views (``views``, their sequences numbered from ``view_offset``) against the same
    floor. For an MoE model (``routes``: each setting's engine and training routes of the
    compared sequences) the layers where the two sides routed a token differently are marked
    (``mark_routing``)."""
    if not found:
        return {}
    identity = found.get(IDENTITY)
    _, source = floor_of(None if identity is None else identity.stream)
    label = f"measured: {IDENTITY.name}" if source == "measured" else "nominal float32 rounding"
    settings = {}
    for setting, sums in found.items():
        # the identity setting is the others' floor: its own curve is judged against float32
        # rounding (against itself nothing could ever diverge, a broken float32 kernel included)
        own = setting == IDENTITY
        entry = _entry(
            sums, None if own else identity, OWN_FLOOR if own else label, offsets.get(setting, 0)
        )
        if routes and setting in routes:
            mark_routing(entry, routing_flips(*routes[setting], sums.stream.layers))
        settings[setting.name] = entry
    out: dict[str, Any] = {"floor_source": label, "settings": settings}
    if views:
        out["views"] = {name: _entry(s, identity, label, view_offset) for name, s in views.items()}
    return out
