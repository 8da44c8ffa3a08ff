"""Engine-side layer capture (``probe scan --layers``): the residual stream after every decoder
layer of vLLM's own model, read by forward hooks during a prefill of given token ids.

vLLM's decoder layers return ``(hidden_states, residual)`` and leave the add to the next layer's
fused add-RMSNorm, which works *in place*: a layer's stream is ``hidden_states + residual`` of
its outputs, and a hook must copy it at once (the next layer overwrites both tensors). The last
decoder layer's stream is compared after the model's final norm (the last entry of transformers'
``hidden_states`` is taken after it), so the final norm's output is captured too. Hooks fire
only in eager mode (``enforce_eager``; a compiled graph calls no hook). Beside the stream, each
layer's attention and MLP outputs (``PARTS``, before the residual add) are captured where every
layer has them, and the logit of each position's next token is read from the engine's own
logits: a hook on the logits processor, which the prompt-logprob pass calls on rows of the
final norm's output (each row placed by its bytes).

The hooks are installed, read and removed through ``LLM.apply_model``, with module-level
functions only: in the multiprocess engine they run in the worker process (pickled, hence
``VLLM_ALLOW_INSECURE_SERIALIZATION`` in the engine's environment, ``ENGINE_ENV``) and what they
captured comes back as float32 numpy arrays. A hook sees the flattened tokens of every request in
a step; each sequence is prefilled as a request of its own (``prompt_logprobs``: the prefix cache
is skipped, so every position is computed) and its rows are placed by their token positions, so a
chunked prefill reassembles too. This module knows nothing of transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.layers import PARTS, part_modules

_ATTR = "_probe_layer_capture"  # the capture state, kept on the worker's model object
# What the engine needs for --layers: eager mode (hooks fire), no prefix cache for the capture
# prefill, and pickled hook functions in the multiprocess engine.
ENGINE_KWARGS: dict[str, Any] = {"enforce_eager": True}
ENGINE_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def check_eager(engine_args: dict[str, Any]) -> None:
    """Refuse an engine that is not in eager mode: a compiled or graph-captured model calls no
    forward hook, so nothing would be captured.

    Raises:
        ProbeError: ``enforce_eager`` is off.
    """
    if not engine_args.get("enforce_eager"):
        raise ProbeError(
            "--layers needs the engine in eager mode (forward hooks do not fire in a compiled "
            "graph); drop --vllm-arg enforce_eager=false"
        )


def decoder_parts(model: Any) -> tuple[Sequence[Any], Any]:
    """The decoder layers and the final norm of a vLLM causal LM (``model.model.layers``,
    ``model.model.norm``).

    Raises:
        ProbeError: the model has no such modules.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    norm = getattr(inner, "norm", None)
    if layers is None or norm is None:
        raise ProbeError(f"--layers: {type(model).__name__} has no model.layers / model.norm")
    return layers, norm


def _stream(output: Any) -> np.ndarray:
    """A decoder layer's stream ``hidden_states + residual`` (float32, copied now)."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1]
        total = hidden.float() if residual is None else hidden.float() + residual.float()
    else:
        total = output.float()
    return np.asarray(total.detach().cpu().numpy(), dtype=np.float32).copy()


def _normed(output: Any) -> np.ndarray:
    """The final norm's output (its first element when fused with the residual add)."""
    out = output[0] if isinstance(output, tuple) else output
    return np.asarray(out.detach().float().cpu().numpy(), dtype=np.float32).copy()


def _first(output: Any) -> np.ndarray:
    """A module's output tensor (its first element when a tuple), float32, copied now."""
    out = output[0] if isinstance(output, tuple) else output
    return np.asarray(out.detach().float().cpu().numpy(), dtype=np.float32).copy()


def _layer_hook(state: dict[str, Any], index: int, module: Any, args: Any, output: Any) -> None:
    if index == 0:
        state["positions"] = np.asarray(args[0].detach().cpu().numpy(), dtype=np.int64).copy()
        state["step"] = {}
    state["step"][index] = _stream(output)


def _part_hook(
    state: dict[str, Any], part: str, index: int, module: Any, args: Any, output: Any
) -> None:
    # a part returns before its layer: the step's parts are gathered from one norm to the next
    state["step_parts"][part][index] = _first(output)


def _norm_hook(state: dict[str, Any], module: Any, args: Any, output: Any) -> None:
    step = state.pop("step", None)
    if step is None:
        return
    count = len(state["layers"])
    rows = [step[i] for i in range(count)]
    rows[-1] = _normed(output)  # the last layer: after the final norm (as transformers)
    positions = state.pop("positions")
    values = {"stream": np.stack(rows, axis=1)}
    parts, state["step_parts"] = state["step_parts"], {part: {} for part in state["parts"]}
    for part, found in parts.items():
        if len(found) == count:  # every layer has the part
            values[part] = np.stack([found[i] for i in range(count)], axis=1)
    state["steps"].append((positions, values))
    # the logits processor reads rows of this output: each row's position, by its bytes
    state["normed"] = {row.tobytes(): int(p) for row, p in zip(rows[-1], positions, strict=True)}


def _logits_hook(state: dict[str, Any], module: Any, args: Any, output: Any) -> None:
    """The logit of each position's next token (``targets``, set by ``set_targets``), read
    from the engine's own logits: the rows the logits processor is given are rows of the final
    norm's output, placed by their bytes (the sampled row and the prompt-logprob rows)."""
    normed, targets = state.get("normed"), state.get("targets")
    if normed is None or targets is None or output is None or len(args) < 2:
        return
    import torch

    hidden = np.asarray(args[1].detach().float().cpu().numpy(), dtype=np.float32)
    pos = np.array([normed.get(row.tobytes(), -1) for row in hidden], dtype=np.int64)
    keep = (pos >= 0) & (pos + 1 < len(targets))
    if not keep.any():
        return
    rows = torch.as_tensor(np.flatnonzero(keep), device=output.device)
    ids = torch.as_tensor(targets[pos[keep] + 1], device=output.device)
    values = output[rows, ids].detach().float().cpu().numpy()
    state["logits"].append((pos[keep].copy(), np.asarray(values, dtype=np.float32).copy()))


def install(model: Any) -> int:
    """Hook every decoder layer (its stream and its ``PARTS``), the final norm and the logits
    processor of ``model`` (``apply_model``); returns the number of decoder layers."""
    remove(model)
    layers, norm = decoder_parts(model)
    parts = [part_modules(layer) for layer in layers]
    shared = [p for p in PARTS if all(p in found for found in parts)]
    state: dict[str, Any] = {
        "layers": list(layers),
        "parts": shared,
        "step_parts": {part: {} for part in shared},
        "steps": [],
        "logits": [],
        "handles": [],
    }
    for i, layer in enumerate(layers):
        state["handles"].append(layer.register_forward_hook(partial(_layer_hook, state, i)))
        for part in shared:
            hook = partial(_part_hook, state, part, i)
            state["handles"].append(parts[i][part].register_forward_hook(hook))
    state["handles"].append(norm.register_forward_hook(partial(_norm_hook, state)))
    processor = getattr(model, "logits_processor", None)
    if processor is not None and hasattr(processor, "register_forward_hook"):
        state["handles"].append(processor.register_forward_hook(partial(_logits_hook, state)))
    setattr(model, _ATTR, state)
    return len(state["layers"])


def set_targets(ids: Sequence[int], model: Any) -> None:
    """The token ids of the next prefill (``apply_model``): the logits hook reads the logit
    of each position's next token."""
    state = getattr(model, _ATTR, None)
    if state is not None:
        state["targets"] = np.asarray(list(ids), dtype=np.int64)


def _packed(array: np.ndarray) -> dict[str, Any]:
    return {"bytes": array.tobytes(), "dtype": array.dtype.str, "shape": list(array.shape)}


def _unpacked(item: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(item["bytes"], np.dtype(item["dtype"])).reshape(item["shape"])


def take(model: Any) -> dict[str, Any]:
    """What the hooks captured since the last ``take`` (``apply_model``): per forward step,
    ``[T]`` int64 positions and per captured part (``stream``, the ``PARTS``) ``[T, L, H]``
    float32 values; the next-token logits with their positions. Raw bytes with dtype and shape
    (plain types: the multiprocess engine's reply goes through msgpack, which would return an
    array as its parts); the buffers are emptied."""
    state = getattr(model, _ATTR, None)
    if state is None:
        return {"steps": [], "logits": []}
    steps, state["steps"] = state["steps"], []
    logits, state["logits"] = state["logits"], []
    return {
        "steps": [
            {"positions": _packed(p), "values": {k: _packed(v) for k, v in values.items()}}
            for p, values in steps
        ],
        "logits": [{"positions": _packed(p), "values": _packed(v)} for p, v in logits],
    }


def remove(model: Any) -> None:
    """Remove the hooks of ``install`` (``apply_model``)."""
    state = getattr(model, _ATTR, None)
    if state is None:
        return
    for handle in state["handles"]:
        handle.remove()
    delattr(model, _ATTR)


def run_on_model(llm: Any, fn: Any) -> Any:
    """``fn`` on the engine's model (``apply_model``): the first worker's result (with tensor
    parallelism every worker holds the same stream after its all-reduce)."""
    return llm.apply_model(fn)[0]


def capture(llm: Any, sequences: Sequence[Sequence[int]]) -> list[dict[str, np.ndarray]]:
    """The engine's float32 captures of each token-id sequence, one prefill per sequence:
    ``stream`` ``[T, L, H]`` (T its length, L the decoder layers: the last one after the final
    norm), each part of ``PARTS`` the layers have (``[T, L, H]``, before the residual add) and
    ``logit`` ``[T - 1]``: the engine's logit of token ``t + 1`` at position ``t`` (absent
    when the model has no logits processor to hook).

    The hooks must be installed (``install`` through ``run_on_model``).

    Raises:
        ProbeError: a position of a sequence was not seen (a prefix-cache hit, a missing hook).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # prompt_logprobs alone already skips reading the prefix cache (vLLM's SamplingParams):
    # said explicitly, every position is computed; its logits give the next-token logits
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=0,
        detokenize=False,
        skip_reading_prefix_cache=True,
    )
    out: list[dict[str, np.ndarray]] = []
    for ids in sequences:
        run_on_model(llm, take)  # nothing left from an earlier step
        run_on_model(llm, partial(set_targets, list(ids)))
        llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        out.append(_assemble(run_on_model(llm, take), len(ids)))
    return out


def _placed(steps: Sequence[tuple[np.ndarray, np.ndarray]], length: int, what: str) -> np.ndarray:
    """Rows of every step placed at their positions (a prefill's steps; rows at or beyond
    ``length``, the decode step's, dropped).

    Raises:
        ProbeError: a position below ``length`` was not seen.
    """
    rows = np.zeros((length, *steps[0][1].shape[1:]), np.float32)
    seen = np.zeros(length, bool)
    for positions, values in steps:
        keep = positions < length
        rows[positions[keep]] = values[keep]
        seen[positions[keep]] = True
    if not seen.all():
        missing = int((~seen).sum())
        raise ProbeError(f"--layers: {missing} of {length} positions of the {what} not computed")
    return rows


def _assemble(reply: dict[str, Any], length: int) -> dict[str, np.ndarray]:
    """One sequence's captures, each row placed at its position."""
    if not reply["steps"]:
        raise ProbeError("--layers: the engine's hooks saw no forward step (is it eager?)")
    steps = [
        (_unpacked(r["positions"]), {k: _unpacked(v) for k, v in r["values"].items()})
        for r in reply["steps"]
    ]
    names = [k for k in steps[0][1] if all(k in values for _, values in steps)]
    out = {
        name: _placed([(p, values[name]) for p, values in steps], length, name) for name in names
    }
    logits = [(_unpacked(r["positions"]), _unpacked(r["values"])) for r in reply["logits"]]
    if logits and length > 1:
        out["logit"] = _placed(logits, length - 1, "next-token logits")
    return out
