"""Routing-replay modes: which routes the training forward is forced to use.

* ``none``: the training router routes every token itself (what a trainer does by default);
* ``rollout`` (R3, rollout routing replay): every route column is forced to the engine's routes,
  prompt and response alike (as verl and Megatron replay vLLM's ``routed_experts``); the
  weights of the forced experts still come from the training router's logits.

``--routing-replay none,rollout`` rescores the same tokens once per mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.routing.shape import RoutingShape, routing_shape

# mode -> the routes to force, given the engine's routes of every sequence (None: force none)
REPLAY_MODES: dict[str, Callable[[Sequence[np.ndarray]], Sequence[np.ndarray] | None]] = {
    "none": lambda rollout_routes: None,
    "rollout": lambda rollout_routes: rollout_routes,
}


def parse_replay_modes(text: str) -> tuple[str, ...]:
    """``"none,rollout"`` -> ``("none", "rollout")``; unknown or repeated names are errors."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in REPLAY_MODES]
    if not modes or unknown:
        bad = ", ".join(unknown) or "nothing"
        raise ProbeError(f"--routing-replay: {bad} is not one of {', '.join(REPLAY_MODES)}")
    if len(set(modes)) != len(modes):
        raise ProbeError(f"--routing-replay names a mode twice: {text}")
    return modes


def check_replay(config: Any, modes: Sequence[str]) -> RoutingShape | None:
    """The model's routing shape; a one-line error if a dense model is asked to replay routes.

    Returns:
        ``None`` for a dense model with ``modes == ("none",)`` (nothing to measure).
    """
    shape = routing_shape(config)
    forcing = [m for m in modes if m != "none"]
    if shape is None and forcing:
        name = getattr(config, "model_type", None) or "this model"
        raise ProbeError(
            f"--routing-replay {forcing[0]} needs a mixture-of-experts model; {name} is dense"
        )
    return shape


def forced_routes(mode: str, rollout_routes: Sequence[np.ndarray]) -> Sequence[np.ndarray] | None:
    """The routes ``training.routing.TrainRouting`` must force under ``mode``."""
    return REPLAY_MODES[mode](rollout_routes)
