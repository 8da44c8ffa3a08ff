"""The training side's copy of the engine's logit processing (vLLM ``v1/sample/sampler.py``).

``token_logprobs`` turns training-side logits into the log-probability of given token ids under
the distribution the engine reports for a ``SamplingSpec`` (raw, or processed: temperature,
top-k, top-p), and flags support flips at the top-k / top-p boundary; ``token_scores`` adds the
entropy of that distribution (``train_entropy`` in the token store).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mismatch_probe.sampling import SamplingSpec

if TYPE_CHECKING:
    import torch


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, spec: SamplingSpec, flip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``targets`` under the distribution the engine reports.

    Args:
        logits: ``[N, V]`` training-side logits (any dtype; processed in float32).
        targets: ``[N]`` token ids whose log-probabilities we want.
        spec: the sampling settings of the rollout.
        flip_eps: margin under which a top-k / top-p boundary counts as a support flip: in
            cumulative probability for top-p, in logit units (relative to the k-th logit's
            magnitude, at least 1) for top-k.

    Returns:
        ``(logprobs [N] float32, support_flip [N] bool)``. A target outside the kept set gets
        ``-inf`` (and is always flagged, since the engine sampled it).
    """
    import torch

    logits, flip = _processed(logits, spec, flip_eps)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets.long()[:, None])[:, 0]
    return logprobs, flip | torch.isneginf(logprobs)


def token_scores(
    logits: torch.Tensor, targets: torch.Tensor, spec: SamplingSpec, flip_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_logprobs`` plus the entropy of the distribution each target was scored under.

    Args: as ``token_logprobs``.

    Returns:
        ``(logprobs [N] float32, support_flip [N] bool, entropy [N] float32)``: ``entropy``
        is ``-sum_v p_v log p_v`` in nats over the processed distribution (tokens a top-k /
        top-p mask removed have ``p = 0`` and add nothing). It is read from the one ``[N, V]``
        log-softmax the log-probabilities come from, ``ENTROPY_ROWS`` rows at a time, so no
        second ``[N, V]`` tensor exists.
    """
    import torch

    logits, flip = _processed(logits, spec, flip_eps)
    logp = torch.log_softmax(logits, dim=-1)
    del logits  # the processed copy (when one was made) is no longer needed
    logprobs = logp.gather(1, targets.long()[:, None])[:, 0]
    return logprobs, flip | torch.isneginf(logprobs), entropy_from_logp(logp)


ENTROPY_ROWS = 64  # rows of the [rows, V] temporaries of entropy_from_logp


def entropy_from_logp(logp: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` log-probabilities (``-inf`` allowed) -> ``[N]`` entropies in nats."""
    import torch

    out = torch.empty(logp.shape[0], dtype=logp.dtype, device=logp.device)
    for i in range(0, logp.shape[0], ENTROPY_ROWS):
        block = logp[i : i + ENTROPY_ROWS]
        finite = block.nan_to_num(neginf=0.0)  # p = 0 there: 0 * log 0 counts as 0
        out[i : i + ENTROPY_ROWS] = -(block.exp() * finite).sum(dim=-1)
    return out.clamp_(min=0.0)


def _processed(
    logits: torch.Tensor, spec: SamplingSpec, flip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, V]`` float32 logits as the engine samples from them (temperature, top-k, top-p
    under ``processes_logits``; untouched for raw scoring) and the ``[N]`` support flips."""
    import torch

    logits = logits.float()
    flip = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    if spec.processes_logits:
        logits = logits / spec.temperature
        if spec.uses_top_k or spec.uses_top_p:
            logits, flip = _top_k_top_p(logits, spec, flip_eps)
    return logits, flip


def _top_k_top_p(
    logits: torch.Tensor, spec: SamplingSpec, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's top-k then top-p masks, plus the boundary-margin test.

    Args:
        logits: ``[N, V]`` float32, already divided by the temperature.

    Returns:
        ``(masked logits [N, V], support_flip [N])``.
    """
    import torch

    flip = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    if spec.uses_top_k and spec.top_k < logits.shape[1]:
        logits, flip = _top_k(logits, spec.top_k, eps)
    if spec.uses_top_p:
        logits, flip_p = _top_p(logits, spec.top_p, eps)
        flip = flip | flip_p
    return logits, flip


def _top_k(logits: torch.Tensor, k: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep every logit >= the k-th largest; flag rows where the k-th and (k+1)-th are within
    ``eps`` (relative to the k-th's magnitude, at least 1)."""
    top = logits.topk(k + 1, dim=-1).values  # [N, k+1], descending
    kth, below = top[:, k - 1], top[:, k]
    flip = (kth - below) < eps * kth.abs().clamp(min=1.0)
    return logits.masked_fill(logits < kth[:, None], float("-inf")), flip


TOP_P_WINDOWS = (1024, 8192)  # topk sizes tried before a full sort of the vocabulary


def _top_p(
    logits: torch.Tensor, p: float, eps: float, windows: tuple[int, ...] = TOP_P_WINDOWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's top-p without sorting the whole vocabulary.

    vLLM sorts ascending and drops a token when the ascending cumulative probability up to it is
    ``<= 1 - p``; equivalently (exact arithmetic) it keeps the descending prefix whose
    *exclusive* cumulative probability (mass strictly above the token) is ``< p``. That prefix
    almost always lies in the top ``windows[0]`` tokens, found with ``topk``; rows where it
    does not (flat distributions) try the next window, then the full sort. A row is flagged when
    some exclusive cumulative probability is within ``eps`` of ``p`` (the boundary could flip).
    """
    if not windows or windows[0] >= logits.shape[1]:
        return _top_p_sorted(logits, p, eps)
    probs = logits.softmax(dim=-1)
    top_probs, top_idx = probs.topk(windows[0], dim=-1)  # [N, W], descending
    exclusive = top_probs.cumsum(dim=-1) - top_probs
    kept = exclusive < p
    flip = (((exclusive - p).abs() < eps) & (top_probs > 0)).any(dim=-1)
    last = kept.sum(dim=-1, keepdim=True) - 1  # index of the last kept token, >= 0
    threshold = logits.gather(1, top_idx.gather(1, last))  # [N, 1]
    masked = logits.masked_fill(logits < threshold, float("-inf"))
    open_rows = kept[:, -1].nonzero()[:, 0]  # the nucleus reaches past the window
    if len(open_rows):
        masked[open_rows], flip[open_rows] = _top_p(logits[open_rows], p, eps, windows[1:])
    return masked, flip


def _top_p_sorted(logits: torch.Tensor, p: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``apply_top_k_top_p_pytorch`` top-p, verbatim (full ascending sort)."""
    import torch

    sorted_logits, order = logits.sort(dim=-1)
    cumsum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumsum <= 1 - p
    drop[:, -1] = False
    probs_sorted = torch.diff(cumsum, dim=-1, prepend=torch.zeros_like(cumsum[:, :1]))
    flip = (((cumsum - (1 - p)).abs() < eps) & (probs_sorted > 0)).any(dim=-1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits), flip
