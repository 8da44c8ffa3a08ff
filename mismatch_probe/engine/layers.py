"""Engine-side layer capture (``probe scan --layers``): the residual stream after every decoder
layer of vLLM's own model, read by forward hooks during a prefill of given token ids.

vLLM's decoder layers return ``(hidden_states, residual)`` and leave the add to the next layer's
fused add-RMSNorm, which works *in place*: a layer's stream is ``hidden_states + residual`` of
its outputs, and a hook must copy it at once (the next layer overwrites both tensors). The last
decoder layer's stream is compared after the model's final norm (the last entry of transformers'
``hidden_states`` is taken after it), so the final norm's output is captured too. Hooks fire
only in eager mode (``enforce_eager``; a compiled graph calls no hook).

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


def _layer_hook(state: dict[str, Any], index: int, module: Any, args: Any, output: Any) -> None:
    if index == 0:
        state["positions"] = np.asarray(args[0].detach().cpu().numpy(), dtype=np.int64).copy()
        state["step"] = {}
    state["step"][index] = _stream(output)


def _norm_hook(state: dict[str, Any], module: Any, args: Any, output: Any) -> None:
    step = state.pop("step", None)
    if step is None:
        return
    count = len(state["layers"])
    rows = [step[i] for i in range(count)]
    rows[-1] = _normed(output)  # the last layer: after the final norm (as transformers)
    state["steps"].append((state.pop("positions"), np.stack(rows, axis=1)))


def install(model: Any) -> int:
    """Hook every decoder layer and the final norm of ``model`` (``apply_model``); returns the
    number of decoder layers."""
    remove(model)
    layers, norm = decoder_parts(model)
    state: dict[str, Any] = {"layers": list(layers), "steps": [], "handles": []}
    for i, layer in enumerate(layers):
        state["handles"].append(layer.register_forward_hook(partial(_layer_hook, state, i)))
    state["handles"].append(norm.register_forward_hook(partial(_norm_hook, state)))
    setattr(model, _ATTR, state)
    return len(state["layers"])


def take(model: Any) -> list[dict[str, Any]]:
    """What the hooks captured since the last ``take`` (``apply_model``): per forward step,
    ``[T]`` int64 positions and ``[T, L, H]`` float32 values as raw bytes with their shape
    (plain types: the multiprocess engine's reply goes through msgpack, which would return an
    array as its parts); the buffer is emptied."""
    state = getattr(model, _ATTR, None)
    if state is None:
        return []
    steps, state["steps"] = state["steps"], []
    return [
        {"positions": p.tobytes(), "values": v.tobytes(), "shape": [int(x) for x in v.shape]}
        for p, v in steps
    ]


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


def capture(llm: Any, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """The engine's ``[T, L, H]`` float32 streams of each token-id sequence (T its length, L
    the decoder layers: the last one after the final norm), one prefill per sequence.

    The hooks must be installed (``install`` through ``run_on_model``).

    Raises:
        ProbeError: a position of a sequence was not seen (a prefix-cache hit, a missing hook).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # prompt_logprobs alone already skips reading the prefix cache (vLLM's SamplingParams):
    # said explicitly, every position is computed
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=0,
        detokenize=False,
        skip_reading_prefix_cache=True,
    )
    out: list[np.ndarray] = []
    for ids in sequences:
        run_on_model(llm, take)  # nothing left from an earlier step
        llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        out.append(_assemble(run_on_model(llm, take), len(ids)))
    return out


def _assemble(replies: Sequence[dict[str, Any]], length: int) -> np.ndarray:
    """One sequence's rows, each placed at its position (the prefill's steps; the decode step of
    the one generated token lies beyond ``length`` and is dropped)."""
    if not replies:
        raise ProbeError("--layers: the engine's hooks saw no forward step (is it eager?)")
    steps = [
        (
            np.frombuffer(r["positions"], np.int64),
            np.frombuffer(r["values"], np.float32).reshape(r["shape"]),
        )
        for r in replies
    ]
    width = steps[0][1].shape[1:]
    rows = np.zeros((length, *width), np.float32)
    seen = np.zeros(length, bool)
    for positions, values in steps:
        keep = positions < length
        rows[positions[keep]] = values[keep]
        seen[positions[keep]] = True
    if not seen.all():
        missing = int((~seen).sum())
        raise ProbeError(f"--layers: {missing} of {length} positions were not computed")
    return rows
