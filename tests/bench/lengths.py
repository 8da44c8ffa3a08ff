"""Rescoring throughput by sequence length, next to the bare decoder forward of the same batches.

For each length (256, 2k and 16k tokens per sequence: a short chat turn to a long reasoning
rollout) the rescorer scores random-id sequences (a 64-token prompt, the rest response) with the
embedded default model in float32 at its default ``batch_tokens``, processed like a sampled
rollout (temperature 0.7, top-p 0.9). The bare decoder forward runs the very same right-padded
batches (``rescore.plan_batches``) through the decoder alone: no LM head, no processing, no
gathering. Its tokens are all forward tokens (prompt and padding included); the ratio of the two
times is what the rescorer adds to what the hardware must do anyway. The decoder is timed before
and after the rescorer and their mean taken, against a machine whose load drifts. A 16k-token
sequence gets a forward of its own and its logits a chunk of positions at a time (memory bounded
by ``batch_tokens``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mismatch_probe import models
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training import rescore

# tokens per sequence -> number of sequences (2k to 16k tokens each)
LENGTHS = {256: 8, 2048: 2, 16384: 1}
PROMPT = 64
BATCH_TOKENS = 2048  # the CLI's default --batch-tokens
SPEC = SamplingSpec(temperature=0.7, top_p=0.9)


def _requests(length: int, count: int, vocab: int) -> list[rescore.ScoreRequest]:
    rng = np.random.default_rng(length)
    return [
        rescore.ScoreRequest(
            rng.integers(0, vocab, PROMPT).tolist(),
            rng.integers(0, vocab, length - PROMPT).tolist(),
        )
        for _ in range(count)
    ]


def _bare_decoder(model: Any, requests: list[rescore.ScoreRequest]) -> int:
    """The decoder alone over the rescorer's padded batches; returns the forward tokens."""
    import torch

    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in requests]
    forward_tokens = 0
    with torch.inference_mode():
        for batch in rescore.plan_batches(lengths, BATCH_TOKENS):
            ids, mask, _, _ = rescore._right_padded([requests[i] for i in batch], model.device)
            model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)
            forward_tokens += ids.numel()
    return forward_tokens


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _one_length(model: Any, length: int, count: int) -> dict[str, Any]:
    requests = _requests(length, count, model.config.vocab_size)
    response = sum(len(r.response_ids) for r in requests)
    forward_tokens = 0

    def bare() -> None:
        nonlocal forward_tokens
        forward_tokens = _bare_decoder(model, requests)

    # The decoder before and after the rescorer: their mean cancels a load that drifts linearly.
    before = _seconds(bare)
    ours = _seconds(lambda: rescore.rescore(model, requests, SPEC, 1e-4, BATCH_TOKENS))
    after = _seconds(bare)
    decoder = (before + after) / 2
    return {
        "sequences": count,
        "response_tokens": response,
        "forward_tokens": forward_tokens,
        "rescorer": {
            "seconds": ours,
            "response_tokens_per_s": response / ours,
            "forward_tokens_per_s": forward_tokens / ours,
        },
        "bare_decoder": {
            "seconds": decoder,
            "seconds_before_after": [before, after],
            "forward_tokens_per_s": forward_tokens / decoder,
        },
        "rescorer_vs_bare_decoder": decoder / ours,  # <= 1: the share of the hardware's pace
    }


def bench_lengths(lengths: dict[int, int] = LENGTHS) -> dict[str, Any]:
    import torch

    path = models.prepare_default_model()
    model = rescore.load_model(path, "float32")
    results: dict[str, Any] = {
        "model": path.name,
        "dtype": "float32",
        "batch_tokens": BATCH_TOKENS,
        "torch_threads": torch.get_num_threads(),
        "sampling": "temperature 0.7, top-p 0.9",
    }
    warm = _requests(256, 2, model.config.vocab_size)
    rescore.rescore(model, warm, SPEC, 1e-4, BATCH_TOKENS)  # warm-up: first-call costs
    _bare_decoder(model, warm)
    for length, count in lengths.items():
        results[f"{length}_tokens"] = _one_length(model, length, count)
        print(f"{length} tokens per sequence: {results[f'{length}_tokens']}", file=sys.stderr)
    return results
