"""Rollout-side routing: the experts the vLLM engine routed each token to.

Two capture paths, named in the run metadata (``capture_path``):

* ``native_decode``: vLLM returns the routes it used while generating
  (``enable_return_routed_experts=True`` -> ``CompletionOutput.routed_experts``). vLLM 0.32
  wires this only into its V2 model runner (GPU with Triton); ``normalize_native`` accepts the
  array shapes vLLM versions return.
* ``prefill_replay``: elsewhere (the CPU backend), each finished sequence is fed back to the same
  engine as one prompt (``prompt + response[:-1]``, one generated token, discarded) while a
  callback on every MoE layer's router (the hook vLLM's own capturer uses,
  ``router.set_capture_fn``) records the expert ids the engine selects. The engine runs in this
  process (``engine_setup``), so the callback can read the model runner's batch layout (request
  ids, ``query_start_loc``, token positions) and put every row of a batched, possibly chunked,
  step at its (request, position). These are the engine's routes in a prefill; decode kernels
  can round differently, so a near-tie can route differently than during sampling.

Both return, per sequence, ``[T, L, K]`` int16 routes over the columns ``0 .. P + R - 2``
(see ``training.routing``), expert ids ascending. This module knows nothing about transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mismatch_probe.engine import rollout
from mismatch_probe.errors import ProbeError
from mismatch_probe.routing.shape import RoutingShape, TokenSequence, route_columns

NATIVE = "native_decode"
PREFILL_REPLAY = "prefill_replay"
CAPTURE_PATHS = (NATIVE, PREFILL_REPLAY)

# What each capture path needs from the engine: vLLM arguments, and environment variables
# that must be set when ``vllm.LLM`` is created (vLLM reads them then, not at import).
_ENGINE: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    NATIVE: ({"enable_return_routed_experts": True}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
    PREFILL_REPLAY: (
        # In-process worker (so the callbacks can be ours), no prefix caching (every position of
        # a replayed sequence is computed, none served from cache), eager (no graph capture).
        {"distributed_executor_backend": "uni", "enable_prefix_caching": False,
         "enforce_eager": True},
        {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    ),
}  # fmt: skip


@dataclass(frozen=True)
class EngineSetup:
    """How to start the rollout engine so that its routes can be captured."""

    capture_path: str
    kwargs: dict[str, Any] = field(default_factory=dict)  # merged into ``vllm.LLM(**kwargs)``
    env: dict[str, str] = field(default_factory=dict)  # set while the engine is created


def native_available() -> bool:
    """True where vLLM can return routed experts itself (its V2 runner: a GPU with Triton)."""
    import importlib.util

    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    return (
        "enable_return_routed_experts" in EngineArgs.__dataclass_fields__
        and current_platform.is_cuda_alike()
        and importlib.util.find_spec("triton") is not None
    )


def engine_setup(capture_path: str = "auto") -> EngineSetup:
    """Engine arguments and environment for a run that captures routes.

    Args:
        capture_path: ``native_decode``, ``prefill_replay``, or ``auto`` (native where
            ``native_available()``, else prefill replay).
    """
    if capture_path == "auto":
        capture_path = NATIVE if native_available() else PREFILL_REPLAY
    if capture_path not in _ENGINE:
        raise ProbeError(f"unknown capture path {capture_path!r}; choose from {CAPTURE_PATHS}")
    kwargs, env = _ENGINE[capture_path]
    return EngineSetup(capture_path, dict(kwargs), dict(env))


def capture_routes(
    llm: Any,
    sequences: Sequence[TokenSequence],
    shape: RoutingShape,
    capture_path: str,
    progress: Callable[..., Any] | bool = False,
) -> list[np.ndarray]:
    """The engine's ``[T, L, K]`` routes of every sequence, in order.

    Args:
        llm: the ``vllm.LLM`` that generated the sequences, started with ``engine_setup``.
        sequences: finished sequences (``rollout.Rollout``); for ``native_decode`` each must
            carry the engine's ``routed_experts`` array.
        shape: the model's routing shape.
        capture_path: the ``EngineSetup.capture_path`` the engine was started with.
        progress: passed to ``llm.generate(use_tqdm=...)`` (prefill replay only).
    """
    if capture_path == NATIVE:
        return [_native_of(seq, shape) for seq in sequences]
    if capture_path == PREFILL_REPLAY:
        return replay_prefill(llm, sequences, shape, progress)
    raise ProbeError(f"unknown capture path {capture_path!r}; choose from {CAPTURE_PATHS}")


def _native_of(seq: TokenSequence, shape: RoutingShape) -> np.ndarray:
    routed = getattr(seq, "routed_experts", None)
    if routed is None:
        raise ProbeError(
            "the engine returned no routed_experts; start it with "
            "engine_setup('native_decode') and keep CompletionOutput.routed_experts"
        )
    return normalize_native(routed, route_columns(seq), shape)


def normalize_native(routed: Any, columns: int, shape: RoutingShape) -> np.ndarray:
    """vLLM's ``routed_experts`` of one sequence -> ``[T, L, K]`` int16, ids ascending.

    Accepted layouts: ``[rows, layers, K]`` or flattened ``[rows, layers * K]``, where
    ``layers`` counts all decoder layers (dense ones hold no route) or only the MoE layers, and
    ``rows`` is ``T`` (vLLM 0.32: every token fed to the model, with the default
    ``routed_experts_prompt_start=0``) or ``T + 1`` (a row for the final token, dropped).
    """
    k = shape.top_k
    array = np.asarray(routed)
    if array.ndim == 2 and array.shape[1] % k == 0:
        array = array.reshape(array.shape[0], -1, k)
    if array.ndim != 3 or array.shape[2] != k:
        raise ProbeError(f"routed_experts of shape {array.shape}: expected [tokens, layers, {k}]")
    if array.shape[1] == shape.num_hidden_layers != shape.num_layers:
        array = array[:, list(shape.moe_layers)]
    if array.shape[1] != shape.num_layers or array.shape[0] not in (columns, columns + 1):
        raise ProbeError(
            f"routed_experts of shape {array.shape}: expected {columns} tokens (prompt + "
            f"response - 1) and {shape.num_layers} MoE layers"
        )
    return np.sort(array[:columns].astype(np.int16), axis=-1)


def replay_prefill(
    llm: Any,
    sequences: Sequence[TokenSequence],
    shape: RoutingShape,
    progress: Callable[..., Any] | bool = False,
) -> list[np.ndarray]:
    """Feed every sequence back as one prompt (all in one batched call) and record its routes.

    Returns:
        Per sequence, ``[T, L, K]`` int16 routes (``T = P + R - 1``), ids ascending.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    columns = [route_columns(s) for s in sequences]
    todo = [i for i, t in enumerate(columns) if t > 0]  # vLLM rejects empty prompts
    inputs = [
        TokensPrompt(prompt_token_ids=[*sequences[i].prompt_ids, *sequences[i].response_ids][:-1])
        for i in todo
    ]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    runner = _in_process_runner(llm)
    recorder = StepRecorder(runner, shape)
    with _bound(runner.get_model(), recorder), rollout.running("route capture"):
        outputs = llm.generate(inputs, params, use_tqdm=progress)
    slots = {out.request_id: columns[i] for i, out in zip(todo, outputs, strict=True)}
    routes = recorder.assemble(slots)
    empty = np.zeros((0, shape.num_layers, shape.top_k), np.int16)
    by_index = {i: routes[out.request_id] for i, out in zip(todo, outputs, strict=True)}
    return [by_index.get(i, empty) for i in range(len(sequences))]


def _in_process_runner(llm: Any) -> Any:
    executor = getattr(llm.llm_engine, "model_executor", None)
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None or not hasattr(runner, "input_batch"):
        raise ProbeError(
            "prefill-replay routing capture needs the engine's worker in this process: start "
            "the engine with setup.kwargs and setup.env "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0, distributed_executor_backend='uni')"
        )
    return runner


@contextmanager
def _bound(model: Any, recorder: StepRecorder) -> Iterator[None]:
    """Point every MoE router's capture callback at ``recorder`` (vLLM's own capture hook)."""
    routers = [
        (m.layer_id, m.router)
        for m in model.modules()
        if hasattr(getattr(m, "router", None), "set_capture_fn") and hasattr(m, "layer_id")
    ]
    if sorted(layer for layer, _ in routers) != list(recorder.shape.moe_layers):
        raise ProbeError(
            f"the engine's MoE routers sit in layers {sorted(lr for lr, _ in routers)}, "
            f"expected {list(recorder.shape.moe_layers)}"
        )
    for layer, router in routers:
        router.set_capture_fn(recorder.callback(layer))
    try:
        yield
    finally:
        for _, router in routers:
            router.set_capture_fn(None)


class StepRecorder:
    """Collects the router's ``topk_ids`` of every forward step, with the step's batch layout.

    A step's rows are the scheduled tokens of its requests, concatenated in the runner's
    request order: request ``j`` owns rows ``query_start_loc[j] .. query_start_loc[j+1]``, whose
    absolute positions are ``positions[rows]`` (a chunked prefill continues at its offset).
    """

    def __init__(self, runner: Any, shape: RoutingShape) -> None:
        self.runner = runner
        self.shape = shape
        self.column = {layer: c for c, layer in enumerate(shape.moe_layers)}
        # (layer column, request ids [J], starts [J + 1], positions [n], ids [n, K])
        self.steps: list[tuple[int, list[str], np.ndarray, np.ndarray, np.ndarray]] = []

    def callback(self, layer: int) -> Callable[[Any], None]:
        column = self.column[layer]
        return lambda topk_ids: self.record(column, topk_ids)

    def record(self, column: int, topk_ids: Any) -> None:
        req_ids, starts, positions = step_layout(self.runner, topk_ids.shape[0])
        ids = topk_ids[: starts[-1]].cpu().numpy().astype(np.int16)
        self.steps.append((column, req_ids, starts, positions, ids))

    def assemble(self, columns: dict[str, int]) -> dict[str, np.ndarray]:
        """Per external request id, ``[T, L, K]`` routes; every (position, layer) must be seen.

        Args:
            columns: external request id -> ``T``, the positions to keep (``0 .. T - 1``).
        """
        k, layers = self.shape.top_k, self.shape.num_layers
        out = {rid: np.full((t, layers, k), -1, np.int16) for rid, t in columns.items()}
        for column, req_ids, starts, positions, ids in self.steps:
            for j, internal in enumerate(req_ids):
                routes = out.get(_external_id(internal, columns))
                if routes is None:
                    continue  # a request of some other caller
                pos, rows = positions[starts[j] : starts[j + 1]], ids[starts[j] : starts[j + 1]]
                keep = pos < len(routes)
                routes[pos[keep], column] = rows[keep]
        for rid, routes in out.items():
            missing = int((routes[..., 0] < 0).sum())
            if missing:
                raise ProbeError(
                    f"routing capture missed {missing} (position, layer) pairs of request "
                    f"{rid}; is prefix caching on? (engine_setup turns it off)"
                )
        return {rid: np.sort(routes, axis=-1) for rid, routes in out.items()}


def _external_id(internal: str, known: dict[str, Any]) -> str:
    """vLLM >= 0.11 suffixes the caller's request id with ``-<8 random chars>`` internally."""
    return internal if internal in known else internal.rsplit("-", 1)[0]


def step_layout(runner: Any, num_rows: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The current step's ``(request ids [J], query_start_loc [J + 1], positions [n])``.

    Read from the V1 model runner's persistent input buffers, which hold the step being run.
    """
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    starts = np.array(runner.query_start_loc.np[: num_reqs + 1], dtype=np.int64)
    if starts[-1] > num_rows:
        raise ProbeError(
            f"a router saw {num_rows} rows for {starts[-1]} scheduled tokens "
            "(sharded MoE?): prefill-replay capture needs one worker"
        )
    positions = runner.positions
    positions = positions.np if hasattr(positions, "np") else positions.cpu().numpy()
    return list(batch.req_ids[:num_reqs]), starts, np.array(positions[: starts[-1]])
