"""Rescoring throughput: our batched rescorer vs a bare batched forward vs the naive loop.

All of them score the same synthetic sequences (random token ids, realistic prompt and response
lengths: random ids give high-entropy distributions, the worst case for top-p) with the
embedded default model in float32, for two sampling configurations: raw (no processing) and
processed (temperature 0.7, top-p 0.9). The naive loop runs one forward per sequence and applies
the same processing (``sampling.token_logprobs``) to its logits, so the comparison isolates
batching; the bare batched forward is one padded forward with ``log_softmax`` and no processing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from mismatch_probe import models
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training import rescore
from mismatch_probe.training.logits import token_logprobs

NUM_SEQUENCES = 32
SPECS = {
    "raw": SamplingSpec(logprobs_mode="raw"),
    "processed_t0.7_top_p0.9": SamplingSpec(temperature=0.7, top_p=0.9),
}


def _requests(vocab: int, seed: int = 0) -> list[rescore.ScoreRequest]:
    rng = np.random.default_rng(seed)
    return [
        rescore.ScoreRequest(
            rng.integers(0, vocab, rng.integers(20, 80)).tolist(),
            rng.integers(0, vocab, rng.integers(30, 160)).tolist(),
        )
        for _ in range(NUM_SEQUENCES)
    ]


def _naive(model: Any, requests: list[rescore.ScoreRequest], spec: SamplingSpec) -> None:
    """One forward per sequence, full logits, the same processing, gather."""
    import torch

    with torch.inference_mode():
        for r in requests:
            ids = torch.tensor([[*r.prompt_ids, *r.response_ids]])
            logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1]
            token_logprobs(logits, ids[0, len(r.prompt_ids) :], spec, 1e-4)


def _bare_batched(model: Any, requests: list[rescore.ScoreRequest]) -> None:
    """One right-padded forward for all sequences, full logits, log_softmax, gather."""
    import torch

    width = max(len(r.prompt_ids) + len(r.response_ids) for r in requests)
    ids = torch.zeros((len(requests), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(requests):
        seq = [*r.prompt_ids, *r.response_ids]
        ids[b, : len(seq)], mask[b, : len(seq)] = torch.tensor(seq), 1
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])


def _timed(fn: Callable[[], Any], tokens: int) -> dict[str, float]:
    fn()  # warm-up
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens_per_s": tokens / seconds}


def bench_rescoring() -> dict[str, Any]:
    import torch

    model = rescore.load_model(models.prepare_default_model(), "float32")
    requests = _requests(model.config.vocab_size)
    tokens = sum(len(r.response_ids) for r in requests)
    results: dict[str, Any] = {"sequences": len(requests), "response_tokens": tokens}
    results["torch_threads"] = torch.get_num_threads()
    results["bare_batched_forward"] = _timed(lambda: _bare_batched(model, requests), tokens)
    for name, spec in SPECS.items():
        ours = _timed(partial(rescore.rescore, model, requests, spec, 1e-4), tokens)
        naive = _timed(partial(_naive, model, requests, spec), tokens)
        ratio = ours["tokens_per_s"] / naive["tokens_per_s"]
        results[name] = {"ours": ours, "naive_loop": naive, "ours_vs_naive": ratio}
    return results
