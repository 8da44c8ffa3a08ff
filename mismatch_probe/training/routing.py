"""Training-side routing: record, or force, the experts of a transformers MoE model.

In transformers 5 every MoE layer's router (``model.layers.N.mlp.gate``, e.g.
``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``) returns ``(router_logits [N, E], top_k_weights
[N, K], top_k_indices [N, K])`` for the ``N = batch * width`` flattened token rows, and the
experts module uses exactly those weights and indices. A forward hook on each router

* records the router's own indices, and
* when routes are forced (R3 replay), replaces the indices row by row and recomputes the weights
  of the forced experts from the *training* router's logits, the way that router computes them
  (softmax in fp32, gather, renormalise as the model does, cast as the model does) -- as in the
  Megatron and verl routing-replay implementations. Rows without a forced route (padding, the
  last column) keep the router's own choice.

This module knows nothing about vLLM. It plugs into ``rescore.rescore`` through
``batch_context``: ``TrainRouting.batch(indices)`` is entered around the forward of each
right-padded batch (row ``b`` = request ``indices[b]``, columns ``0 .. width-1``).

Column convention (shared with the engine side): a request of prompt length ``P`` and
response length ``R`` has ``T = P + R - 1`` route columns, ``0 .. P + R - 2``: every position
whose output is used (the last response token is never fed to the engine).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.routing.shape import RoutingShape, TokenSequence, route_columns

if TYPE_CHECKING:
    import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _softmax_gather(
    logits: torch.Tensor, indices: torch.Tensor, renormalise: bool, cast: bool
) -> torch.Tensor:
    import torch

    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype) if cast else weights


# router class -> the weights it gives ``indices`` [N, K] from ``logits`` [N, E]; each mirrors
# that class's own forward (transformers 5) so that forcing its own choice changes nothing.
ROUTER_WEIGHTS: dict[str, Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Qwen3MoeTopKRouter": lambda r, lg, ix: _softmax_gather(lg, ix, r.norm_topk_prob, True),
    "Qwen2MoeTopKRouter": lambda r, lg, ix: _softmax_gather(lg, ix, r.norm_topk_prob, True),
    "OlmoeTopKRouter": lambda r, lg, ix: _softmax_gather(lg, ix, r.norm_topk_prob, True),
    "MixtralTopKRouter": lambda r, lg, ix: _softmax_gather(lg, ix, True, False),
}


def router_modules(model: Any, shape: RoutingShape) -> list[Any]:
    """The router module of every MoE layer of ``model``, in ``shape.moe_layers`` order."""
    found: dict[int, Any] = {}
    for name, module in model.named_modules():
        match = _LAYER.search(name)
        if match and name.endswith(".gate") and type(module).__name__.endswith("Router"):
            found[int(match.group(1))] = module
    if tuple(sorted(found)) != shape.moe_layers:
        raise ProbeError(
            f"expected routers in layers {list(shape.moe_layers)} of {type(model).__name__}, "
            f"found them in {sorted(found)}"
        )
    return [found[i] for i in shape.moe_layers]


class TrainRouting:
    """Record (and optionally force) the routes of a batch of requests during rescoring.

    Args:
        model: a transformers MoE causal LM.
        requests: the sequences ``rescore.rescore`` scores, in the same order.
        shape: the model's routing shape.
        forced: per request, ``[T, L, K]`` expert ids to force (R3: the rollout's routes), or
            ``None`` to only record. Every column of a request is forced (prompt and response).

    After rescoring, ``recorded[i]`` is request ``i``'s ``[T, L, K]`` int16 routes as the
    training router chose them (before any forcing), expert ids ascending.
    """

    def __init__(
        self,
        model: Any,
        requests: Sequence[TokenSequence],
        shape: RoutingShape,
        forced: Sequence[np.ndarray] | None = None,
    ) -> None:
        self.routers = router_modules(model, shape)
        self.shape = shape
        self.columns = [route_columns(r) for r in requests]
        self.forced = forced
        if forced is not None:
            _check_forced(forced, self.columns, shape)
            self._weights = [_weights_fn(r) for r in self.routers]
        self.recorded: list[np.ndarray] = [
            np.zeros((t, shape.num_layers, shape.top_k), np.int16) for t in self.columns
        ]

    @contextmanager
    def batch(self, indices: list[int]) -> Iterator[None]:
        """Hooks for one right-padded batch whose row ``b`` is request ``indices[b]``."""
        width = max(self.columns[i] for i in indices) + 1
        own = np.zeros((len(indices), width, self.shape.num_layers, self.shape.top_k), np.int16)
        with ExitStack() as stack:
            for layer, router in enumerate(self.routers):
                forced = self._forced_rows(indices, width, layer)
                hook = self._hook(own, layer, forced)
                stack.callback(router.register_forward_hook(hook).remove)
            yield
        for b, i in enumerate(indices):
            self.recorded[i] = np.sort(own[b, : self.columns[i]], axis=-1)

    def _forced_rows(self, indices: list[int], width: int, layer: int) -> torch.Tensor | None:
        """``[B * width, K]`` forced expert ids of one layer; -1 where the router chooses."""
        import torch

        if self.forced is None:
            return None
        rows = torch.full((len(indices) * width, self.shape.top_k), -1, dtype=torch.long)
        for b, i in enumerate(indices):
            t = self.columns[i]
            rows[b * width : b * width + t] = torch.from_numpy(
                self.forced[i][:, layer].astype(np.int64)
            )
        return rows

    def _hook(self, own: np.ndarray, layer: int, forced: torch.Tensor | None) -> Callable:
        batch, width = own.shape[:2]

        def hook(module: Any, args: Any, output: Any) -> Any:
            indices = output[2]
            if indices.shape[0] != batch * width:
                raise ProbeError(
                    f"router saw {indices.shape[0]} rows, expected {batch} x {width} "
                    "(right-padded batch); routing capture needs unpacked batches"
                )
            own[:, :, layer] = indices.reshape(batch, width, -1).cpu().numpy()
            if forced is None:
                return None
            return self._force(module, layer, output, forced.to(indices.device))

        return hook

    def _force(self, module: Any, layer: int, output: Any, forced: torch.Tensor) -> Any:
        import torch

        logits, weights, indices = output
        use = (forced[:, :1] >= 0).expand_as(forced)
        new_indices = torch.where(use, forced, indices)
        new_weights = self._weights[layer](module, logits, new_indices)
        return logits, torch.where(use, new_weights, weights), new_indices


def _weights_fn(router: Any) -> Callable[..., Any]:
    name = type(router).__name__
    if name not in ROUTER_WEIGHTS:
        raise ProbeError(
            f"routing replay does not know how {name} weights its experts; "
            f"supported routers: {', '.join(ROUTER_WEIGHTS)}"
        )
    return ROUTER_WEIGHTS[name]


def _check_forced(forced: Sequence[np.ndarray], columns: list[int], shape: RoutingShape) -> None:
    if len(forced) != len(columns):
        raise ProbeError(f"{len(forced)} forced routes for {len(columns)} requests")
    for i, (routes, t) in enumerate(zip(forced, columns, strict=True)):
        want = (t, shape.num_layers, shape.top_k)
        if routes.shape != want:
            raise ProbeError(f"forced routes of request {i} have shape {routes.shape}, not {want}")
        if t and (routes.min() < 0 or routes.max() >= shape.num_experts):
            raise ProbeError(f"forced routes of request {i} name experts outside 0..E-1")
