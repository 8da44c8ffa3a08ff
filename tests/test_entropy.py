"""``train_entropy``: the rescorer's entropy against a direct softmax computation.

Tolerances (as in ``tests/tolerances.py``, from float32 spacing): the float32 entropy
``H = -sum_v p_v log p_v`` read from a float32 log-softmax differs from the float64 value of the
same logits by (a) the log-softmax rounding, a few ulps of the largest ``|logit|`` /
``logsumexp`` per term, weighted by ``p_v`` (sum <= 1): ``ulp_bound(logits)``; (b) ``exp``'s
relative rounding and the float32 sum over V terms (pairwise: ``log2(V)`` roundings),
relative to ``H``: ``(1 + log2 V) * eps * H``. When the logits themselves come from two
reorderings of the same fp32 forward (a batched, chunked rescoring vs one direct forward),
each logit differs by ``ulp_bound(logits)``, and ``|dH| <= max|dz| * sum_v p_v |log p_v + H|
<= 2 H max|dz|`` adds ``2 H ulp_bound(logits)``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training import rescore
from mismatch_probe.training.logits import _processed, token_logprobs, token_scores
from tests.tolerances import EPS, ulp_bound

SPECS = {
    "raw": SamplingSpec(logprobs_mode="raw"),
    "processed": SamplingSpec(temperature=0.7, top_k=40, top_p=0.9),
}


def direct_entropy(logits: torch.Tensor) -> np.ndarray:
    """``[N, V]`` logits (``-inf`` = masked) -> ``[N]`` float64 ``-sum p log p``."""
    z = logits.double()
    p, logp = torch.softmax(z, -1), torch.log_softmax(z, -1)
    return (-(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(-1)).numpy()


def tolerance(logits: torch.Tensor, h: np.ndarray, reordered: bool = False) -> np.ndarray:
    finite = logits[torch.isfinite(logits)].double().numpy()
    lse = torch.logsumexp(logits.double(), -1).numpy()
    base = ulp_bound(finite, lse)
    rounding = (1 + math.log2(logits.shape[-1])) * EPS["float32"] * h
    return base + rounding + (2 * h * base if reordered else 0.0)


@pytest.mark.parametrize("mode", SPECS)
def test_token_scores_entropy_equals_softmax(mode: str) -> None:
    spec = SPECS[mode]
    logits = torch.randn(300, 5000, generator=torch.Generator().manual_seed(1)) * 4
    logits[0] = 0.0  # uniform: H = log V exactly
    logits[1, 7] = 60.0  # one certain token: H about 0
    targets = torch.arange(300) % 5000
    lp, flip, h = token_scores(logits, targets, spec, 1e-4)
    lp_ref, flip_ref = token_logprobs(logits, targets, spec, 1e-4)
    assert torch.equal(lp, lp_ref) and torch.equal(flip, flip_ref)  # same scoring as before
    processed, _ = _processed(logits, spec, 1e-4)  # the distribution the tokens were scored under
    want = direct_entropy(processed)
    assert h.dtype == torch.float32 and bool((h >= 0).all())
    assert np.all(np.abs(h.numpy() - want) <= tolerance(processed, want))
    if mode == "raw":
        assert h[0].item() == pytest.approx(math.log(5000), rel=4 * EPS["float32"])
        assert h[1].item() < 1e-12
    else:  # top-k 40: at most log 40 nats (the uniform row 0 keeps every tied token)
        assert float(h[1:].max()) <= math.log(40) + 1e-5


def test_entropy_blocks_do_not_change_a_row() -> None:
    """Rows are independent: 3 rows scored alone give the same bits as inside 200."""
    logits = torch.randn(200, 3000, generator=torch.Generator().manual_seed(2))
    targets = torch.zeros(200, dtype=torch.long)
    spec = SPECS["processed"]
    whole = token_scores(logits, targets, spec, 1e-4)[2]
    part = token_scores(logits[97:100], targets[:3], spec, 1e-4)[2]
    assert torch.equal(whole[97:100], part)


@pytest.fixture(scope="module")
def fp32_model(tiny_model: Any) -> Any:
    return rescore.load_model(tiny_model, "float32")


@pytest.mark.parametrize("mode", SPECS)
def test_rescored_entropy_identity_on_the_tiny_model(fp32_model: Any, mode: str) -> None:
    """fp32 rescoring (right-padded batches, logits in chunks) against one direct forward per
    sequence and a float64 softmax: the same entropy to float32 ulps."""
    spec = SPECS[mode]
    rng = np.random.default_rng(3)
    vocab = fp32_model.config.vocab_size
    requests = [
        rescore.ScoreRequest(rng.integers(5, vocab, n).tolist(), rng.integers(5, vocab, m).tolist())
        for n, m in ((7, 30), (3, 12), (20, 45), (1, 5))
    ]
    scored = rescore.rescore(fp32_model, requests, spec, 1e-4, batch_tokens=64)
    for req, got in zip(requests, scored, strict=True):
        ids = torch.tensor([[*req.prompt_ids, *req.response_ids]])
        with torch.inference_mode():
            logits = fp32_model(input_ids=ids).logits[0]
        rows = logits[len(req.prompt_ids) - 1 : -1]  # the positions predicting the response
        processed, _ = _processed(rows, spec, 1e-4)
        want = direct_entropy(processed)
        assert got.entropy is not None and got.entropy.dtype == np.float32
        assert len(got.entropy) == len(req.response_ids)
        assert np.all(np.abs(got.entropy - want) <= tolerance(processed, want, reordered=True))
    assert scored[0].entropy is not None and float(scored[0].entropy.min()) > 0.0


def test_store_schema_stays_backward_compatible() -> None:
    from mismatch_probe import store

    assert "train_entropy" not in store.TOKEN_SCHEMA.names  # older stores still match it
    names = [*store.TOKEN_SCHEMA.names, "train_entropy"]
    field = store.token_schema(names).field("train_entropy")
    assert field.nullable and str(field.type) == "float"
    assert "train_entropy" not in store.token_schema(store.TOKEN_SCHEMA.names).names
