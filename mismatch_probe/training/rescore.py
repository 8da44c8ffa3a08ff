"""The training-side rescorer: a transformers forward pass over prompt + response.

It knows nothing about vLLM: it takes token ids (prompt, response) and returns, per response
token, the log-probability the training-precision model gives that exact token after the same
prefix, processed like the engine's (``logits.token_scores``), the support-flip flag, and the
entropy of the distribution it was scored under (from the same chunked logits).

Batching: sequences are sorted by length and packed into right-padded batches of at most
``batch_tokens`` padded tokens. Right padding keeps every real token at its true position
(``position_ids = arange``) and, with a causal mask, real tokens never attend to padding. Only
the logits of the columns that predict response tokens are computed, and at most
``min(batch_tokens, ROW_CHUNK)`` positions' ``[rows, vocab]`` logits exist at a time: a sequence
longer than ``batch_tokens`` gets a forward of its own (attention is never split), and its
logits and their processing run over chunks of positions, so memory stays bounded for any length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training.logits import token_scores

if TYPE_CHECKING:
    import numpy as np
    import torch

ROW_CHUNK = 512  # most positions whose [rows, V] logits (and temporaries) exist at once


@dataclass(frozen=True)
class ScoreRequest:
    """One sequence to rescore: the ids exactly as the engine saw and sampled them.

    ``scored``: the indices into ``response_ids`` of the tokens to score (None: every one). A
    multi-turn trajectory is one request (``response_ids`` everything after its first prompt,
    given context included) whose ``scored`` are its generated tokens.
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    scored: Sequence[int] | None = None

    def scored_indices(self) -> Sequence[int]:
        """``[R]`` indices into ``response_ids`` of the scored tokens."""
        return range(len(self.response_ids)) if self.scored is None else self.scored


@dataclass
class Scored:
    """Per-response-token results, aligned with ``ScoreRequest.response_ids``."""

    logprobs: np.ndarray  # [R] float32
    support_flip: np.ndarray  # [R] bool
    entropy: np.ndarray | None = None  # [R] float32 nats of the distribution scored under


def load_model(path: Path, dtype: str, device_map: str | None = None, **placement: Any) -> Any:
    """Load a causal LM in ``dtype`` (always explicit: transformers 5 defaults to "auto").

    ``device_map`` is one of ``devices.DEVICE_MAPS`` (None: ``devices.default_device_map`` of
    this machine: one GPU when the model fits it, split across GPUs otherwise, CPU without a
    GPU); ``placement`` (``max_memory``, ``offload_folder``) goes to ``devices.load_kwargs``.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mismatch_probe.training.devices import describe, load_kwargs, resolve

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
        batch_tokens: padded-token budget of one forward pass (a longer sequence gets one of
            its own), and a bound on the positions whose logits exist at once.
        on_batch: called with the number of response tokens after each batch (progress).
        batch_context: called with the request indices of each batch, in row order; the
            forward pass of that batch runs inside the returned context manager (used to
            record or force MoE routes, ``mismatch_probe.training.routing``). Rows are
            right-padded to the longest ``prompt + response`` of the batch.

    Returns:
        One ``Scored`` per request, in request order, aligned with its ``scored_indices()``.
    """
    import numpy as np

    results: list[Scored | None] = [None] * len(requests)
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in requests]
    chunk = max(1, min(batch_tokens, ROW_CHUNK))
    for batch in plan_batches(lengths, batch_tokens):
        with batch_context(batch) if batch_context is not None else nullcontext():
            scored = _score_batch(model, [requests[i] for i in batch], spec, flip_eps, chunk)
        for i, s in zip(batch, scored, strict=True):
            results[i] = s
        if on_batch is not None:
            on_batch(sum(len(requests[i].scored_indices()) for i in batch))
    empty = Scored(np.zeros(0, np.float32), np.zeros(0, bool), np.zeros(0, np.float32))
    return [r if r is not None else empty for r in results]


def _score_batch(
    model: Any, batch: Sequence[ScoreRequest], spec: SamplingSpec, flip_eps: float, chunk: int
) -> list[Scored]:
    """One forward over the batch, then logits and processing ``chunk`` positions at a time."""
    import torch

    from mismatch_probe.training.devices import input_device

    ids, mask, rows, cols = _right_padded(batch, input_device(model))
    with torch.inference_mode():
        decoder = model.get_decoder()
        hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        head = _lm_head(model)  # [n, H] -> [n, V]
        targets = ids[rows, cols + 1]
        at = hidden.device  # the last layer's device when the model is split across devices
        rows, cols = rows.to(at), cols.to(at)
        chunks = []  # [chunk, V] logits at a time: the column before each response token
        for i in range(0, len(rows), chunk):
            logits = head(hidden[rows[i : i + chunk], cols[i : i + chunk]])
            wanted = targets[i : i + chunk].to(logits.device)  # a split model's head may sit apart
            chunks.append(token_scores(logits, wanted, spec, flip_eps))
            del logits  # before the next chunk's: one [chunk, V] at a time
        logprobs = torch.cat([c[0] for c in chunks]) if chunks else torch.zeros(0)
        flips = torch.cat([c[1] for c in chunks]) if chunks else torch.zeros(0, dtype=torch.bool)
        entropy = torch.cat([c[2] for c in chunks]) if chunks else torch.zeros(0)
    sizes = [len(r.scored_indices()) for r in batch]
    parts = zip(*(t.cpu().split(sizes) for t in (logprobs, flips, entropy)), strict=True)
    return [
        Scored(lp.numpy().astype("float32"), fl.numpy(), h.numpy().astype("float32"))
        for lp, fl, h in parts
    ]


# Config fields of heads that do more than a linear map (they go through the model's own forward).
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def _lm_head(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The map from ``[n, H]`` final hidden states to ``[n, V]`` logits, as the model computes it.

    A plain linear head is called directly. Other heads (soft-capping, scaling) run the model's
    own forward on the given hidden states (``_own_head``), so their extra ops stay the model's.
    """
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    if any(getattr(config, name, None) not in (None, 1.0) for name in _HEAD_EXTRAS):
        return partial(_own_head, model)
    head: Callable[[torch.Tensor], torch.Tensor] = model.get_output_embeddings()
    return head


def _own_head(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` logits of ``[n, H]`` final hidden states through the model's own forward.

    The decoder's forward is replaced, for this one call, by one returning ``hidden`` (the
    decoder already ran once over the whole batch); the model's forward then applies its head
    and extras to exactly those rows (``logits_to_keep=0``: every row).
    """
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPast

    decoder = model.get_decoder()
    called: list[bool] = []

    def forward(*args: Any, **kwargs: Any) -> BaseModelOutputWithPast:
        called.append(True)
        return BaseModelOutputWithPast(last_hidden_state=hidden[None])  # type: ignore[arg-type]

    saved = decoder.__dict__.get("forward")  # an instance-level forward (e.g. an accelerate hook)
    decoder.forward = forward
    try:
        stub = torch.zeros((1, hidden.shape[0]), dtype=torch.long, device=hidden.device)
        logits = model(input_ids=stub, use_cache=False).logits[0]
    finally:
        if saved is None:
            del decoder.forward
        else:
            decoder.forward = saved
    if not called:
        raise ProbeError(f"{type(model).__name__}: its forward does not call get_decoder()")
    return logits  # type: ignore[no-any-return]


def _right_padded(
    batch: Sequence[ScoreRequest], device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Build ``[B, L]`` ids and mask, and the (row, column) of each predicting position.

    Returns:
        ``(ids [B, L], mask [B, L], rows [N], cols [N])`` where ``cols`` are the columns whose
        logits predict the scored response tokens (``prompt_len - 1 + i`` for each scored
        index ``i``: ``prompt_len - 1 .. total - 2`` when every token is scored).
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
        scored = r.scored_indices()
        rows += [b] * len(scored)
        cols += (start + i for i in scored)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return ids.to(device), mask.to(device), as_tensor(rows), as_tensor(cols)
