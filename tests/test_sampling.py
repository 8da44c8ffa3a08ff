"""The training side's copy of vLLM's logit processing, against vLLM's own implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training.logits import _top_k_top_p, token_logprobs
from tests.tolerances import ulp_bound


def vllm_reference(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    n = logits.shape[0]
    k = torch.full((n,), spec.top_k, dtype=torch.long) if spec.uses_top_k else None
    p = torch.full((n,), spec.top_p) if spec.uses_top_p else None
    return apply_top_k_top_p_pytorch(logits.clone(), k, p)


def mixed_logits(vocab: int = 5000, seed: int = 0) -> torch.Tensor:
    """Peaked rows (nucleus in a few tokens) and flat rows (nucleus beyond any window)."""
    g = torch.Generator().manual_seed(seed)
    peaked = torch.randn(40, vocab, generator=g) * 4
    flat = torch.randn(8, vocab, generator=g) * 0.01
    return torch.cat([peaked, flat])


@pytest.mark.parametrize(
    "spec",
    [SamplingSpec(top_k=20), SamplingSpec(top_p=0.9), SamplingSpec(top_k=50, top_p=0.8)],
    ids=["top_k", "top_p", "both"],
)
def test_masks_equal_vllm(spec: SamplingSpec) -> None:
    logits = mixed_logits()
    ours, _ = _top_k_top_p(logits, spec, eps=0.0)
    assert torch.equal(torch.isinf(ours), torch.isinf(vllm_reference(logits, spec)))


def test_top_p_keeps_exactly_the_nucleus() -> None:
    """probs 0.5, 0.3, 0.15, 0.05 with p=0.7: exclusive mass 0, .5, .8, .95 -> keep 2 tokens."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    spec = SamplingSpec(top_p=0.7)
    lp, flip = token_logprobs(logits, torch.tensor([1]), spec, flip_eps=1e-3)
    want = torch.tensor(0.3 / 0.8).log().item()  # float32 log-softmax over 2 kept tokens
    assert lp.item() == pytest.approx(want, rel=0, abs=ulp_bound(np.array([want])))
    assert not flip.item()
    masked, _ = _top_k_top_p(logits, spec, eps=0.0)
    assert torch.isinf(masked[0, 2:]).all() and not torch.isinf(masked[0, :2]).any()


def test_boundary_within_eps_is_flagged() -> None:
    """Exclusive mass at the third token is 0.8 = p exactly: a last-bit change flips it."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    _, flip = token_logprobs(logits, torch.tensor([0]), SamplingSpec(top_p=0.8 + 1e-5), 1e-4)
    assert flip.item()


def test_token_outside_support_is_minus_inf_and_flagged() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    lp, flip = token_logprobs(logits, torch.tensor([3]), SamplingSpec(top_k=2), flip_eps=0.0)
    assert torch.isneginf(lp).item() and flip.item()


def test_temperature_and_raw_modes() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    target = torch.tensor([0])
    hot = SamplingSpec(temperature=0.5)
    expected = torch.log_softmax(logits / 0.5, -1)[0, 0]
    assert token_logprobs(logits, target, hot, 0.0)[0].item() == pytest.approx(expected.item())
    raw = SamplingSpec(temperature=0.5, top_k=1, logprobs_mode="raw")
    expected_raw = torch.log_softmax(logits, -1)[0, 0]
    assert token_logprobs(logits, target, raw, 0.0)[0].item() == pytest.approx(expected_raw.item())
    greedy = SamplingSpec(temperature=0.0, top_p=0.5)  # greedy: vLLM reports raw log-probs
    assert token_logprobs(logits, target, greedy, 0.0)[0].item() == pytest.approx(
        expected_raw.item()
    )


def test_batched_rescoring_equals_one_sequence_at_a_time(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """Right padding, masks and the logits_to_keep window change nothing."""
    import numpy as np

    from mismatch_probe.training import rescore

    model = rescore.load_model(tiny_model, "float32")
    rng = np.random.default_rng(0)
    requests = [
        rescore.ScoreRequest(
            rng.integers(5, 300, rng.integers(2, 30)).tolist(),
            rng.integers(5, 300, rng.integers(1, 25)).tolist(),
        )
        for _ in range(12)
    ]
    spec = SamplingSpec(temperature=0.8, top_p=0.9)
    batched = rescore.rescore(model, requests, spec, 1e-4, batch_tokens=4096)
    single = rescore.rescore(model, requests, spec, 1e-4, batch_tokens=1)
    for b, s in zip(batched, single, strict=True):
        finite = np.isfinite(s.logprobs)
        bound = ulp_bound(s.logprobs)  # padding changes the GEMM shapes, so the sum order
        np.testing.assert_allclose(b.logprobs[finite], s.logprobs[finite], rtol=0, atol=bound)


def test_top_p_window_cascade_equals_full_sort() -> None:
    """Rows resolved in the first window, the second, and by the full sort agree with vLLM."""
    from mismatch_probe.training.logits import _top_p

    g = torch.Generator().manual_seed(1)
    scales = torch.tensor([8.0] * 4 + [1.0] * 4 + [0.05] * 4)[:, None]  # peaked .. flat
    logits = torch.randn(12, 5000, generator=g) * scales
    ours, _ = _top_p(logits, 0.9, 0.0, windows=(16, 256))
    reference = vllm_reference(logits, SamplingSpec(top_p=0.9))
    assert torch.equal(torch.isinf(ours), torch.isinf(reference))


def test_tokens_removed_by_top_k_never_count_as_top_p_flips() -> None:
    """top_p close to 1 with top-k: zero-probability tokens sit at exclusive mass ~1 = p."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    spec = SamplingSpec(top_k=3, top_p=0.995)
    _, flip = token_logprobs(logits, torch.tensor([0]), spec, flip_eps=8e-3)
    assert not flip.item()
