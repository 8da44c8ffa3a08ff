"""Training-side layer streams (``probe scan --layers``): transformers' hidden states.

``hidden_states[i + 1]`` of a transformers causal LM is the residual stream after decoder layer
``i``, except the last entry, which is taken after the final norm: the engine side captures its
final norm's output to match (``engine.layers``). One forward per sequence (no padding), float32
copies of ``[T, L, H]``; the base model only (no LM head:
no logits are computed). This module knows nothing of vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


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
