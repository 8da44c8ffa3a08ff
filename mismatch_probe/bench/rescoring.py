"""Rescoring throughput: our batched rescorer vs a bare batched forward vs the naive loop.

All three score the same synthetic sequences (random token ids, realistic prompt and response
lengths) with the embedded default model in float32, processed mode (T=0.7, top-p 0.9 for ours:
the extra work of the engine's processing is part of what we measure).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mismatch_probe import models, rescore
from mismatch_probe.sampling import SamplingSpec

NUM_SEQUENCES = 32
SPEC = SamplingSpec(temperature=0.7, top_p=0.9)


def _requests(vocab: int, seed: int = 0) -> list[rescore.ScoreRequest]:
    rng = np.random.default_rng(seed)
    return [
        rescore.ScoreRequest(
            rng.integers(0, vocab, rng.integers(20, 80)).tolist(),
            rng.integers(0, vocab, rng.integers(30, 160)).tolist(),
        )
        for _ in range(NUM_SEQUENCES)
    ]


def _naive(model: Any, requests: list[rescore.ScoreRequest]) -> None:
    """One forward per sequence, full logits, log_softmax, gather."""
    import torch

    with torch.inference_mode():
        for r in requests:
            ids = torch.tensor([[*r.prompt_ids, *r.response_ids]])
            logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1].float()
            torch.log_softmax(logits, -1).gather(1, ids[0, len(r.prompt_ids) :, None])


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


def bench_rescoring() -> dict[str, Any]:
    import torch

    model = rescore.load_model(models.prepare_default_model(), "float32")
    requests = _requests(model.config.vocab_size)
    tokens = sum(len(r.response_ids) for r in requests)
    runs = {
        "ours": lambda: rescore.rescore(model, requests, SPEC, 1e-4),
        "bare_batched_forward": lambda: _bare_batched(model, requests),
        "naive_loop": lambda: _naive(model, requests),
    }
    results: dict[str, Any] = {"sequences": len(requests), "response_tokens": tokens}
    results["torch_threads"] = torch.get_num_threads()
    for name, fn in runs.items():
        fn()  # warm-up
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        results[name] = {"seconds": seconds, "tokens_per_s": tokens / seconds}
    results["ours_vs_naive"] = (
        results["ours"]["tokens_per_s"] / results["naive_loop"]["tokens_per_s"]
    )
    return results
