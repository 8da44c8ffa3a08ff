"""Training-side layer streams (``probe scan --layers``): transformers' hidden states.

``hidden_states[i + 1]`` of a transformers causal LM is the residual stream after decoder layer
``i``, except the last entry, which is taken after the final norm: the engine side captures its
final norm's output to match (``engine.layers``). One forward per sequence (no padding), float32
copies of ``[T, L, H]``. ``layer_parts`` adds each layer's attention and MLP outputs (forward hooks
on the modules the engine side hooks, ``PARTS``) and the logit of each position's next token
from the LM head. This module knows nothing of vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mismatch_probe.metrics.layers import PARTS, part_modules


def hidden_streams(model: Any, ids: Sequence[int]) -> np.ndarray:
    """``[T, L, H]`` float32: the stream after each decoder layer of one sequence (the last
    layer after the final norm)."""
    import torch

    from mismatch_probe.training.devices import input_device

    tokens = torch.tensor([list(ids)], dtype=torch.long, device=input_device(model))
    with torch.inference_mode():
        out = model.base_model(input_ids=tokens, output_hidden_states=True, use_cache=False)
    states = out.hidden_states[1:]
    return np.stack([h[0].float().cpu().numpy() for h in states], axis=1)


def layer_parts(model: Any, ids: Sequence[int]) -> dict[str, np.ndarray]:
    """One sequence's float32 captures, as the engine side's (``engine.layers.capture``):
    ``stream`` ``[T, L, H]`` (``hidden_streams``), each part every layer has ``[T, L, H]``,
    and ``logit`` ``[T - 1]``: the LM head's logit of token ``t + 1`` at position ``t``."""
    import torch

    from mismatch_probe.training.devices import input_device

    layers = list(model.base_model.layers)
    modules = [part_modules(layer) for layer in layers]
    shared = [p for p in PARTS if all(p in found for found in modules)]
    seen: dict[str, dict[int, np.ndarray]] = {p: {} for p in shared}

    def hook(part: str, index: int, module: Any, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        seen[part][index] = out[0].detach().float().cpu().numpy().copy()

    handles = [
        modules[i][part].register_forward_hook(
            lambda m, a, o, part=part, i=i: hook(part, i, m, a, o)
        )
        for i in range(len(layers))
        for part in shared
    ]
    tokens = torch.tensor([list(ids)], dtype=torch.long, device=input_device(model))
    try:
        with torch.inference_mode():
            out = model(input_ids=tokens, output_hidden_states=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    found = {
        "stream": np.stack([h[0].float().cpu().numpy() for h in out.hidden_states[1:]], axis=1)
    }
    for part in shared:
        found[part] = np.stack([seen[part][i] for i in range(len(layers))], axis=1)
    if len(ids) > 1:
        nxt = torch.tensor(list(ids)[1:], dtype=torch.long, device=out.logits.device)
        picked = out.logits[0, :-1].gather(-1, nxt[:, None])[:, 0]
        found["logit"] = picked.float().cpu().numpy().astype(np.float32)
    return found
