"""MoE routing: both sides' expert choices, their disagreement, and routing replay (R3).

* ``shape``: which layers route and how many experts (``is_moe``, ``routing_shape``).
* ``engine.routing`` (engine side): the rollout engine's routes (vLLM; native
  ``routed_experts`` or a prefill replay with hooks inside an in-process engine).
* ``training.routing`` (training side): the training forward's routes (transformers router
  hooks), recorded or forced (R3: replay the rollout's routes) during ``rescore.rescore``.
* ``pipeline.routes``: the scan's routing stage.
* ``store``: ``routing.parquet``; ``metrics``: disagreement and the mismatch it explains;
  ``plots``: figures.

Routes are ``[T, L, K]`` int16 arrays per sequence (see ``shape.route_columns``).
Only ``shape`` is imported here, so importing the package costs nothing.
"""

from mismatch_probe.routing.shape import RoutingShape, is_moe, require_moe, routing_shape

__all__ = ["RoutingShape", "is_moe", "require_moe", "routing_shape"]
