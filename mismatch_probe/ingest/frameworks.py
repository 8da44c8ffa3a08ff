"""What the hooks need to know about TRL and verl, without importing either.

* TRL 1.16.0 ``GRPOTrainer`` computes ``old_per_token_logps`` in
  ``_generate_and_score_completions``, right after generation, with the weights that sampled
  (vLLM's weights are synced to the model before each generation), so the two log-probs the
  hook compares are never a policy version apart: bound 0.
* verl 0.9.1: the trainer class (first match along its MRO, ``VERL_TRAINERS``) and its config
  say how far rollouts may lag the weights that recompute ``old_log_probs``. The V1 trainer
  (``trainer.use_v1=true``, the default) picks its mode with ``trainer.v1.trainer_mode``;
  ``sync`` updates the rollout weights every step, the two async modes let trajectories span
  policy versions (``trainer.v1.sampler.max_off_policy_threshold`` drops those spanning more,
  which bounds the span, not the lag behind the trainer). The fully-async trainer
  (``verl.experimental.fully_async_policy``) trains on samples of older weights by design.
* ``algorithm.rollout_correction.bypass_mode=true``: the legacy trainer never calls
  ``_compute_old_log_prob``; the V1 trainer calls it but copies ``rollout_log_probs`` into
  ``old_log_probs``. Either way there is no recomputed side to compare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError

TRL_BOUND: dict[str, Any] = {
    "max_off_policy_steps": 0,
    "off_policy_source": "TRL GRPOTrainer: old_per_token_logps recomputed with the weights "
    "that sampled, before any update",
}

VERL_NO_ROLLOUT_LOGPROBS = (
    "verl keeps no rollout log-probs: set actor_rollout_ref.rollout.calculate_log_probs=True"
)
VERL_BYPASS = (
    "verl runs with algorithm.rollout_correction.bypass_mode=true: old_log_probs are the rollout "
    "log-probs themselves (the legacy trainer never calls _compute_old_log_prob), so there is no "
    "training side to compare; set algorithm.rollout_correction.bypass_mode=false to measure"
)


def setting(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b.c`` of an OmegaConf ``DictConfig`` (or nested mappings), else ``default``."""
    node = config
    for key in dotted.split("."):
        node = node.get(key) if hasattr(node, "get") else None
        if node is None:
            return default
    return node


def check_verl_config(config: Any) -> None:
    """Refuse a verl config under which the hook would write nothing or the wrong thing.

    Raises:
        ProbeError: rollout log-probs off, or bypass mode on.
    """
    if not setting(config, "actor_rollout_ref.rollout.calculate_log_probs", False):
        raise ProbeError(VERL_NO_ROLLOUT_LOGPROBS)
    if setting(config, "algorithm.rollout_correction.bypass_mode", False):
        raise ProbeError(VERL_BYPASS)


def _fixed(bound: int, source: str) -> Callable[[Any], dict[str, Any]]:
    return lambda config: {"max_off_policy_steps": bound, "off_policy_source": source}


def _fully_async(config: Any) -> dict[str, Any]:
    threshold = setting(config, "async_training.staleness_threshold")
    sync = setting(config, "async_training.trigger_parameter_sync_step")
    return {
        "staleness": True,
        "off_policy_source": "verl fully-async trainer: samples come from older weights, bound "
        f"not fixed (async_training.staleness_threshold={threshold}, "
        f"trigger_parameter_sync_step={sync})",
    }


def _v1(config: Any) -> dict[str, Any]:
    mode = setting(config, "trainer.v1.trainer_mode", "sync")
    sync = setting(config, f"trainer.v1.{mode}.parameter_sync_step", 1)
    if mode == "sync" and isinstance(sync, int) and sync > 1:
        # one weight sync per ``sync`` local updates: mini-batch i of a step ran on weights i
        # updates behind the trainer (verl's PPOTrainer.step)
        return {
            "max_off_policy_steps": sync - 1,
            "staleness": True,
            "off_policy_source": f"verl V1 trainer, trainer_mode=sync, parameter_sync_step={sync}: "
            f"rollout weights synced every {sync} local updates, so a step's later mini-batches "
            f"lag by up to {sync - 1}",
        }
    if mode == "sync":
        return {
            "max_off_policy_steps": 0,
            "off_policy_source": "verl V1 trainer, trainer_mode=sync: rollout weights updated "
            "every step",
        }
    threshold = setting(config, "trainer.v1.sampler.max_off_policy_threshold")
    return {
        "staleness": True,
        "off_policy_source": f"verl V1 trainer, trainer_mode={mode}: trajectories may span and "
        f"lag policy versions (sampler.max_off_policy_threshold={threshold})",
    }


def _unknown(name: str) -> Callable[[Any], dict[str, Any]]:
    return lambda config: {"off_policy_source": f"{name}: off-policy bound not known to probe"}


# (qualified class name, bound rule); the first class of the trainer's MRO found here decides.
VERL_TRAINERS: tuple[tuple[str, Callable[[Any], dict[str, Any]]], ...] = (
    ("verl.experimental.fully_async_policy.fully_async_trainer.FullyAsyncTrainer", _fully_async),
    (
        "verl.experimental.one_step_off_policy.ray_trainer.OneStepOffRayTrainer",
        _fixed(1, "verl one-step-off-policy trainer: rollouts one policy version behind"),
    ),
    (
        "verl.experimental.separation.ray_trainer.SeparateRayPPOTrainer",
        _unknown("verl SeparateRayPPOTrainer subclass"),
    ),
    ("verl.trainer.ppo.v1.trainer_base.PPOTrainer", _v1),
    (
        "verl.trainer.ppo.ray_trainer.RayPPOTrainer",
        _fixed(0, "verl RayPPOTrainer: old_log_probs recomputed with the rollout's weights"),
    ),
)


def verl_off_policy(trainer: Any) -> dict[str, Any]:
    """``ProbeWriter`` keyword arguments (bound, staleness, source) for a verl trainer."""
    names = [f"{c.__module__}.{c.__qualname__}" for c in type(trainer).__mro__]
    rules = dict(VERL_TRAINERS)
    for name in names:
        if name in rules:
            return rules[name](trainer.config)
    return _unknown(f"{type(trainer).__name__} (not a verl trainer probe knows)")(trainer.config)


def _rows(value: Any) -> list[Any]:
    """The per-sample rows of a jagged (nested) or dense ``[B, ...]`` field."""
    return list(value.unbind()) if getattr(value, "is_nested", False) else list(value)


def verl_v1_rows(
    data: Any, tags: list[dict[str, Any]]
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], list[str] | None]:
    """``(responses, response_mask, rollout_log_probs, old_log_probs)`` as right-padded
    ``[B', T]`` arrays and the ``[B']`` uids of a V1 batch: the ``TensorDict`` TransferQueue
    returns (jagged ``[B, R_i]`` fields) and the batch's ``[B]`` tags, whose ``is_padding``
    samples (added by verl to divide the batch evenly) are left out.

    Raises:
        ProbeError: a field is missing, the tags do not match the samples, or a sample's
            fields differ in length.
    """
    keys = list(data.keys())
    missing = [k for k in ("responses", "response_mask", "old_log_probs") if k not in keys]
    if "rollout_log_probs" not in keys:
        raise ProbeError(VERL_NO_ROLLOUT_LOGPROBS)
    if missing:
        raise ProbeError(f"verl V1 batch lacks {', '.join(missing)} (fields: {', '.join(keys)})")
    names = ("responses", "response_mask", "rollout_log_probs", "old_log_probs")
    rows = {k: _rows(data[k]) for k in names}
    if len(tags) != len(rows["responses"]):
        raise ProbeError(f"verl V1 batch: {len(tags)} tags for {len(rows['responses'])} samples")
    keep = [i for i, tag in enumerate(tags) if not (tag or {}).get("is_padding")]
    width = max((len(r) for r in rows["responses"]), default=0)
    out = []
    for k, dtype in zip(names, (np.int64, np.float64, np.float64, np.float64), strict=True):
        padded = np.zeros((len(keep), width), dtype)
        for j, i in enumerate(keep):
            row = np.asarray(rows[k][i].detach().cpu().double().numpy(), dtype)
            if len(row) != len(rows["responses"][i]):
                raise ProbeError(
                    f"verl V1 sample {i}: {k} has {len(row)} values for "
                    f"{len(rows['responses'][i])} response tokens"
                )
            padded[j, : len(row)] = row
        out.append(padded)
    uids = data["uid"] if "uid" in keys else None
    if uids is not None:
        uids = list(uids.tolist() if hasattr(uids, "tolist") else uids)
    arrays = (out[0], out[1], out[2], out[3])
    return arrays, None if uids is None else [str(uids[i]) for i in keep]
