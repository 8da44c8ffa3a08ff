"""What a model's routing looks like: which decoder layers route tokens to experts, and how many.

Read from a transformers config (no weights, no engine). A dense model has no ``RoutingShape``.
Routes everywhere in ``mismatch_probe.routing`` are ``[T, L, K]`` integer arrays: ``T`` forward
columns of one sequence, ``L = len(moe_layers)`` MoE layers (in layer order), ``K = top_k``
expert ids per (column, layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mismatch_probe.errors import ProbeError

# Config fields that hold the number of routed experts, by model family.
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class RoutingShape:
    """The routing of one MoE model."""

    moe_layers: tuple[int, ...]  # decoder-layer indices that have a router, ascending
    top_k: int  # experts per token and layer
    num_experts: int  # routed experts per layer
    num_hidden_layers: int = 0  # all decoder layers, dense ones included (0: unknown)

    @property
    def num_layers(self) -> int:
        """Number of MoE layers (``L`` of a ``[T, L, K]`` route array)."""
        return len(self.moe_layers)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "top_k": self.top_k,
            "num_experts": self.num_experts,
            "moe_layers": list(self.moe_layers),
            "num_hidden_layers": self.num_hidden_layers,
        }


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _num_experts(config: Any) -> int:
    for name in _EXPERT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def routing_shape(config: Any) -> RoutingShape | None:
    """The routing of the model described by a transformers ``config``; ``None`` if dense.

    MoE layers follow the config's own rules: Qwen-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``, DeepSeek's ``first_k_dense_replace``; otherwise every layer.
    """
    cfg = _text_config(config)
    experts = _num_experts(cfg)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if experts == 0 or not isinstance(top_k, int) or top_k <= 0:
        return None
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    first = getattr(cfg, "first_k_dense_replace", None) or 0
    layers = tuple(
        i
        for i in range(cfg.num_hidden_layers)
        if i not in dense and (i + 1) % step == 0 and i >= first
    )
    return RoutingShape(layers, top_k, experts, cfg.num_hidden_layers)


def is_moe(config: Any) -> bool:
    """True for a mixture-of-experts model (its config names routed experts and a top-k)."""
    return routing_shape(config) is not None


def require_moe(config: Any, what: str) -> RoutingShape:
    """The routing shape, or a one-line error naming the option that needs an MoE model."""
    shape = routing_shape(config)
    if shape is None:
        name = getattr(config, "model_type", None) or type(config).__name__
        raise ProbeError(f"{what} needs a mixture-of-experts model; {name} is dense")
    return shape


class TokenSequence(Protocol):
    """Anything with the token ids of one sequence (``ScoreRequest``, ``Rollout``)."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def response_ids(self) -> Sequence[int]: ...


def route_columns(seq: TokenSequence) -> int:
    """``T = P + R - 1``: the number of route columns of a sequence (0 if it is empty)."""
    return max(len(seq.prompt_ids) + len(seq.response_ids) - 1, 0)
