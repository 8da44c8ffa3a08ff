"""The attribution stage of ``probe scan --attribute``: score the same tokens at every rung.

For each rollout setting, while its engine is up, the sampled tokens are fed back as prompt +
response and the engine's prompt log-probabilities are read twice: all sequences in one batch
(L1) and one request at a time (L2, one sequence per engine step). vLLM computes prompt
log-probabilities from the raw logits (``log_softmax`` in float32, whatever ``logprobs_mode``;
the actual token's value is in the dict even with ``prompt_logprobs=0``) and skips the prefix
cache for such requests, so both are true prefills. The rescorer then scores the tokens at the
rollout dtype (L3; the training scores themselves when a training dtype equals it, so the
precision link is exactly zero there) and, with ``--stale-model``, with the second checkpoint at
each training dtype (L5). For an MoE replay setting the same tokens rescored with the model's own
routes (the ``replay=none`` setting) are its L4. Everything is raw: ``--attribute`` scans in raw
log-probability mode.

The rungs become nullable columns of ``tokens.parquet`` (``store.RUNG_FIELDS``); the numbers
are computed from the store (``metrics.attribution``) by the finishing step (``finish``, written
as ``attribution.json`` with the run's other data files), so ``probe report`` reads them back and
can reproduce them from the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from mismatch_probe import models
from mismatch_probe.engine import rollout
from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.attribution import NO_REPLAY, PREFILL, PREFILL_SINGLE, STALE
from mismatch_probe.metrics.attribution import TRAIN_ROLLOUT_DTYPE as L3
from mismatch_probe.pipeline import trajectory
from mismatch_probe.pipeline.records import EngineRungs, Prepared, Rescored, RolloutRun
from mismatch_probe.pipeline.rescoring import load_model
from mismatch_probe.settings import RolloutSetting, Setting
from mismatch_probe.training import rescore

if TYPE_CHECKING:
    from mismatch_probe.pipeline.config import ScanConfig
    from mismatch_probe.pipeline.timing import Timer


def check(cfg: ScanConfig) -> None:
    """Refuse, before any engine starts, what attribution cannot measure.

    Raises:
        ProbeError: processed log-probabilities, a stale model without ``--attribute`` or
            that is no causal LM, routing replay without the own-routes setting to compare to.
    """
    if cfg.stale_model is not None and not cfg.attribute:
        raise ProbeError("--stale-model needs --attribute")
    if not cfg.attribute:
        return
    if cfg.sampling.logprobs_mode != "raw":
        raise ProbeError(
            "--attribute needs raw log-probabilities (engine prompt log-probs are raw, so every "
            "rung must be); drop --logprobs-mode processed"
        )
    if "rollout" in cfg.routing_replay and "none" not in cfg.routing_replay:
        raise ProbeError(
            "--attribute with routing replay needs --routing-replay none,rollout (the routing "
            "link compares the replayed rescoring with the model's own routes)"
        )
    if cfg.stale_model is not None:
        models.resolve_model(cfg.stale_model)


def engine_step(
    cfg: ScanConfig, llm: Any, rollouts: Sequence[rollout.Rollout], timer: Timer
) -> EngineRungs | None:
    """The engine's rungs of ``rollouts`` under ``--attribute`` (timed as
    ``attribution_prefill``), while the engine is up; None (nothing done) without it."""
    if not cfg.attribute:
        return None
    with timer("attribution_prefill"):
        return engine_rungs(llm, rollouts)


def check_stale(stale_model: Any, model_dir: Any) -> None:
    """The stale checkpoint must be the scanned model at another step: same architecture and
    vocabulary (a smaller vocabulary cannot score the sampled ids; another architecture would
    take the whole attribution). Checked before any engine starts.

    Raises:
        ProbeError: the architectures or vocabulary sizes differ.
    """
    if stale_model is None:
        return
    stale_dir = models.resolve_model(stale_model)
    scanned, stale = models.check_causal_lm(model_dir), models.check_causal_lm(stale_dir)
    for what, read in (("architecture", _architecture), ("vocabulary size", _vocab_size)):
        mine, theirs = read(scanned), read(stale)
        if mine != theirs:
            raise ProbeError(
                f"--stale-model {stale_model}: {what} {theirs}, the scanned model has {mine}; "
                "a stale checkpoint must be the same model at an earlier training step"
            )


def _architecture(config: dict[str, Any]) -> str:
    names = config.get("architectures") or []
    return f"{config.get('model_type', '?')} ({', '.join(names) or 'none'})"


def _vocab_size(config: dict[str, Any]) -> Any:
    text = config.get("text_config")
    return config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else None)


def engine_rungs(llm: Any, rollouts: Sequence[rollout.Rollout]) -> EngineRungs:
    """L1 (one batched call) and L2 (one call, hence one engine step, per sequence)."""
    batched = rollout.score_forced(llm, rollouts)
    single = [rollout.score_forced(llm, [r])[0] for r in rollouts]
    return EngineRungs(batched, single)


def _score(model: Any, rollouts: Sequence[rollout.Rollout], cfg: ScanConfig) -> list[np.ndarray]:
    requests = [trajectory.score_request(r) for r in rollouts]
    flip_eps = 0.0  # raw scoring: no support to flip
    scored = rescore.rescore(model, requests, cfg.rescoring_spec(), flip_eps, cfg.batch_tokens)
    return [s.logprobs for s in scored]


def _rollout_dtype_scores(
    cfg: ScanConfig, prep: Any, runs: Sequence[Any], scored: dict[Setting, Any]
) -> dict[RolloutSetting, list[np.ndarray]]:
    """L3 per rollout setting: the training scores at the same dtype when the scan has them
    (own routes), else one rescoring per rollout dtype (its model placed as the training
    model, recorded as ``rollout_dtype=<dtype>``)."""
    out: dict[RolloutSetting, list[np.ndarray]] = {}
    for run in runs:
        same = scored.get(Setting(run.setting, run.setting.dtype, "none"))
        if same is not None:
            out[run.setting] = [s.logprobs for s in same.scored]
    for dtype in dict.fromkeys(r.setting.dtype for r in runs if r.setting not in out):
        key = f"rollout_dtype={dtype}"
        model = load_model(cfg, prep.model_dir, dtype, prep.attribution_devices, key)
        for run in (r for r in runs if r.setting.dtype == dtype and r.setting not in out):
            out[run.setting] = _score(model, run.rollouts, cfg)
        del model
    return out


def _stale_scores(
    cfg: ScanConfig, prep: Any, runs: Sequence[Any]
) -> dict[tuple[RolloutSetting, str], list[np.ndarray]]:
    """L5 per (rollout setting, training dtype): the stale checkpoint's scores (its model
    placed as the training model, recorded as ``stale=<dtype>``)."""
    out: dict[tuple[RolloutSetting, str], list[np.ndarray]] = {}
    if cfg.stale_model is None:
        return out
    path = models.resolve_model(cfg.stale_model)
    for dtype in cfg.train_dtypes:
        model = load_model(cfg, path, dtype, prep.attribution_devices, f"stale={dtype}")
        for run in runs:
            out[(run.setting, dtype)] = _score(model, run.rollouts, cfg)
        del model
    return out


def train_step(
    cfg: ScanConfig,
    prep: Prepared,
    runs: Sequence[RolloutRun],
    scored: dict[Setting, Rescored],
    timer: Timer,
) -> None:
    """The training side's rungs under ``--attribute`` (``add_train_rungs``, timed as
    ``attribution_rescoring``); nothing without it."""
    if cfg.attribute:
        with timer("attribution_rescoring"):
            add_train_rungs(cfg, prep, runs, scored)


def add_train_rungs(
    cfg: ScanConfig,
    prep: Prepared,
    runs: Sequence[RolloutRun],
    scored: dict[Setting, Rescored],
) -> None:
    """Fill each ``Rescored.rungs`` with its rung columns (flat ``[N]`` arrays, rollout order).
    The extra models load through ``rescoring.load_model`` (``--train-device-map``); where each
    ran goes to ``prep.attribution_devices``.

    Args:
        runs: the rollout runs (``RolloutRun`` with ``rungs`` set where they produced tokens).
        scored: every setting's ``Rescored`` (updated in place).
    """
    runs = [r for r in runs if r.rollouts]  # the rollout settings that produced tokens
    l3 = _rollout_dtype_scores(cfg, prep, runs, scored)
    stale = _stale_scores(cfg, prep, runs)
    by_rollout = {run.setting: run for run in runs}
    for setting, rescored in scored.items():
        engine = by_rollout[setting.rollout].rungs
        assert engine is not None, "engine_rungs runs for every rollout setting with --attribute"
        cols: dict[str, np.ndarray | None] = {
            PREFILL: _flat(engine.batched),
            PREFILL_SINGLE: _flat(engine.single),
            L3: _flat(l3[setting.rollout]),
        }
        if stale:
            own = setting.replay == "none"  # a replay setting's L5 would mix in routing
            cols[STALE] = _flat(stale[(setting.rollout, setting.train_dtype)]) if own else None
        if setting.replay != "none":
            base = scored[replace(setting, replay="none")]
            cols[NO_REPLAY] = _flat([s.logprobs for s in base.scored])
        rescored.rungs = cols


def _flat(per_seq: Sequence[Any]) -> np.ndarray:
    """Per-sequence values (lists or arrays) -> one flat ``[N]`` float32 array."""
    arrays = [np.asarray(x, dtype=np.float32) for x in per_seq]
    return np.concatenate(arrays) if arrays else np.zeros(0, np.float32)


def finish(tokens: Path) -> dict[str, dict[str, Any]]:
    """The attribution of every setting of the store written (``{}`` for a scan without
    ``--attribute``: no rung columns)."""
    from mismatch_probe.metrics.attribution import compute_attribution

    return compute_attribution(tokens)


def with_rungs(table: pa.Table, rungs: dict[str, np.ndarray | None]) -> pa.Table:
    """``table`` (one setting's token rows) plus its rung columns; None -> a column of nulls."""
    for name, values in rungs.items():
        if values is None:
            column = pa.nulls(table.num_rows, pa.float32())
        else:
            if len(values) != table.num_rows:
                raise AssertionError(f"{name}: {len(values)} values for {table.num_rows} tokens")
            column = pa.array(values, pa.float32())
        table = table.append_column(name, column)
    return table
