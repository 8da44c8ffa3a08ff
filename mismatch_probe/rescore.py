"""The training-side rescorer: a transformers forward pass over prompt + response.

It knows nothing about vLLM: it takes token ids (prompt, response) and returns, per response
token, the log-probability the training-precision model gives that exact token after the same
prefix, processed like the engine's (``sampling.token_logprobs``), plus the support-flip flag.

Batching: sequences are sorted by length and packed into right-padded batches of at most
``batch_tokens`` padded tokens. Right padding keeps every real token at its true position
(``position_ids = arange``) and, with a causal mask, real tokens never attend to padding. Only
the logits of the columns that predict response tokens are computed (``logits_to_keep``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.sampling import SamplingSpec, token_logprobs

if TYPE_CHECKING:
    import numpy as np
    import torch

ROW_CHUNK = 512  # response tokens processed together after the forward (bounds [N, V] temporaries)


@dataclass(frozen=True)
class ScoreRequest:
    """One sequence to rescore: the ids exactly as the engine saw and sampled them."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]


@dataclass
class Scored:
    """Per-response-token results, aligned with ``ScoreRequest.response_ids``."""

    logprobs: np.ndarray  # [R] float32
    support_flip: np.ndarray  # [R] bool


def load_model(path: Path, dtype: str, device_map: str | None = None, **placement: Any) -> Any:
    """Load a causal LM in ``dtype`` (always explicit: transformers 5 defaults to "auto").

    ``device_map`` is one of ``devices.DEVICE_MAPS`` (None: ``devices.default_device_map`` of
    this machine: one GPU when the model fits it, split across GPUs otherwise, CPU without a
    GPU); ``placement`` (``max_memory``, ``offload_folder``) goes to ``devices.load_kwargs``.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mismatch_probe.devices import describe, load_kwargs, resolve

    hf_logging.disable_progress_bar()
    used = resolve(device_map, Path(path), dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=getattr(torch, dtype),
            local_files_only=True,
            **load_kwargs(used, **placement),
        )
    except (OSError, ValueError, RuntimeError) as exc:
        reason = " ".join(str(exc).split())
        raise ProbeError(f"transformers could not load {path}: {reason}") from None
    model.probe_device_map = describe(model, device_map, used)  # type: ignore[assignment]
    return model.eval()


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sequence indices, longest first, so that ``len(batch) * max_len <= batch_tokens``.

    A sequence longer than ``batch_tokens`` gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def rescore(
    model: Any,
    requests: Sequence[ScoreRequest],
    spec: SamplingSpec,
    flip_eps: float,
    batch_tokens: int = 2048,
    on_batch: Callable[[int], None] | None = None,
    batch_context: Callable[[list[int]], AbstractContextManager[Any]] | None = None,
) -> list[Scored]:
    """Score every response token of ``requests`` with ``model``.

    Args:
        model: a transformers causal LM (in eval mode, on its device).
        requests: sequences to score; a request with no response tokens gets empty arrays.
        spec: sampling settings of the rollout (decides raw vs processed scoring).
        flip_eps: support-flip margin (see ``sampling.token_logprobs``).
        batch_tokens: padded-token budget of one forward pass.
        on_batch: called with the number of response tokens after each batch (progress).
        batch_context: called with the request indices of each batch, in row order; the
            forward pass of that batch runs inside the returned context manager (used to
            record or force MoE routes, ``mismatch_probe.routing.capture_train``). Rows are
            right-padded to the longest ``prompt + response`` of the batch.

    Returns:
        One ``Scored`` per request, in request order.
    """
    import numpy as np

    results: list[Scored | None] = [None] * len(requests)
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in requests]
    for batch in plan_batches(lengths, batch_tokens):
        with batch_context(batch) if batch_context is not None else nullcontext():
            scored = _score_batch(model, [requests[i] for i in batch], spec, flip_eps)
        for i, s in zip(batch, scored, strict=True):
            results[i] = s
        if on_batch is not None:
            on_batch(sum(len(requests[i].response_ids) for i in batch))
    empty = Scored(np.zeros(0, np.float32), np.zeros(0, bool))
    return [r if r is not None else empty for r in results]


def _score_batch(
    model: Any, batch: Sequence[ScoreRequest], spec: SamplingSpec, flip_eps: float
) -> list[Scored]:
    import torch

    from mismatch_probe.devices import input_device

    ids, mask, rows, cols, first = _right_padded(batch, input_device(model))
    with torch.inference_mode():
        logits = _predicting_logits(model, ids, mask, rows, cols, first)  # [N, V]
        targets = ids[rows, cols + 1].to(logits.device)  # a split model's head may sit elsewhere
        chunks = [
            token_logprobs(
                logits[i : i + ROW_CHUNK],
                targets[i : i + ROW_CHUNK],
                spec,
                flip_eps,
            )
            for i in range(0, len(rows), ROW_CHUNK)
        ]  # [chunk, V] at a time: the column before each response token
        logprobs = torch.cat([c[0] for c in chunks]) if chunks else torch.zeros(0)
        flips = torch.cat([c[1] for c in chunks]) if chunks else torch.zeros(0, dtype=torch.bool)
    sizes = [len(r.response_ids) for r in batch]
    return [
        Scored(lp.numpy().astype("float32"), fl.numpy())
        for lp, fl in zip(logprobs.cpu().split(sizes), flips.cpu().split(sizes), strict=True)
    ]


# Config fields of heads that do more than a linear map (they go through the model's own forward).
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def _predicting_logits(
    model: Any, ids: Any, mask: Any, rows: Any, cols: Any, first: int
) -> torch.Tensor:
    """``[N, V]`` logits of the columns that predict response tokens, and only those.

    For a plain linear LM head, the decoder's hidden states are gathered at those columns
    before the head, so no logits are computed for prompt or padding positions. Other heads
    (soft-capping, scaling) run the model's own forward with ``logits_to_keep``.
    """
    import torch

    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    plain = hasattr(model, "get_decoder") and not any(
        getattr(config, name, None) not in (None, 1.0) for name in _HEAD_EXTRAS
    )
    if plain:
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        at = hidden.device  # the last layer's device when the model is split
        return model.get_output_embeddings()(hidden[rows.to(at), cols.to(at)])
    keep = torch.arange(first, ids.shape[1] - 1, device=ids.device)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
    at = logits.device
    return logits[rows.to(at), (cols - first).to(at)]


def _right_padded(
    batch: Sequence[ScoreRequest], device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Build ``[B, L]`` ids and mask, and the (row, column) of each predicting position.

    Returns:
        ``(ids [B, L], mask [B, L], rows [N], cols [N], first)`` where ``cols`` are the columns
        whose logits predict the response tokens (``prompt_len - 1 .. total - 2``) and
        ``first`` is the smallest of them.
    """
    import torch

    width = max(len(r.prompt_ids) + len(r.response_ids) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    for b, r in enumerate(batch):
        seq = [*r.prompt_ids, *r.response_ids]
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
        start = len(r.prompt_ids) - 1
        rows += [b] * len(r.response_ids)
        cols += range(start, start + len(r.response_ids))
    first = min(len(r.prompt_ids) - 1 for r in batch)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return ids.to(device), mask.to(device), as_tensor(rows), as_tensor(cols), first
