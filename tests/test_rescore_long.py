"""Rescoring long sequences: memory bounded by ``batch_tokens``, results those of one big pass.

A tiny model with a 32k-token context rescores one long sequence (longer than ``batch_tokens``):
the decoder runs once over the whole sequence, its logits are computed a chunk of positions at a
time, and every tensor of the operations that carries a vocabulary axis is recorded (a
``TorchDispatchMode`` sees each aten op's output): none may hold more than ``batch_tokens``
positions' logits. The results must equal those of the unchunked computation (the LM head and
``token_logprobs`` on all positions at once) to a few float32 ulps: each row of the head's GEMM
is the same dot products whatever the number of rows, but another row count may pick another
GEMM kernel and blocking on another CPU (bitwise equal here except for 1-row GEMV chunks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training import rescore
from mismatch_probe.training.logits import token_logprobs
from tests.tolerances import ulp_bound

CONTEXT = 32768
# One 8k-token sequence (2 layers of 8k attention: about a second here); the response is long
# enough that its unchunked logits would be 12x the bound, short enough to process quickly.
PROMPT, RESPONSE = 7000, 1192
SMALL = 100  # batch_tokens far below the sequence (not a dimension of the tiny model)
SPEC = SamplingSpec(temperature=0.8, top_k=200, top_p=0.98)


class VocabTensors(TorchDispatchMode):
    """Records the element count of every op output that has an axis of size ``vocab``."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and self.vocab in t.shape:
                self.sizes.append(t.numel())
        return out


@dataclass
class Run:
    chunked: rescore.Scored  # batch_tokens = SMALL
    whole: rescore.Scored  # batch_tokens large enough to hold the sequence
    unchunked: tuple[np.ndarray, np.ndarray]  # head + token_logprobs on all positions at once
    vocab_sizes: list[int]  # numel of each vocabulary-axis tensor while rescoring chunked
    decoder_inputs: list[tuple[int, ...]]  # input shapes the decoder saw while rescoring chunked
    vocab: int


def _decoder_inputs(model: Any, record: list[tuple[int, ...]]) -> Any:
    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        record.append(tuple(kwargs["input_ids"].shape))

    return model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)


def _decoder_outputs(model: Any, record: list[torch.Tensor]) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        record.append(output.last_hidden_state)

    return model.get_decoder().register_forward_hook(hook)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mismatch_probe.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny32k") / "llama", context=CONTEXT)
    model = rescore.load_model(path, "float32")
    assert model.config.max_position_embeddings == CONTEXT
    return model


def _unchunked(model: Any, hidden: torch.Tensor, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The reference: the LM head and ``token_logprobs`` on all response positions at once,
    from the decoder's ``[1, L, H]`` output ``hidden``."""
    with torch.inference_mode():
        logits = model.get_output_embeddings()(hidden[0, PROMPT - 1 : -1])  # [RESPONSE, V]
        lp, flip = token_logprobs(logits, torch.tensor(ids[PROMPT:]), SPEC, 1e-4)
    return lp.numpy(), flip.numpy()


@pytest.fixture(scope="module")
def run(long_model: Any) -> Run:
    rng = np.random.default_rng(0)
    vocab = long_model.config.vocab_size
    request = rescore.ScoreRequest(
        rng.integers(5, vocab, PROMPT).tolist(), rng.integers(5, vocab, RESPONSE).tolist()
    )
    mode, shapes, hidden = VocabTensors(vocab), [], []
    handles = [_decoder_inputs(long_model, shapes), _decoder_outputs(long_model, hidden)]
    try:
        with mode:
            (chunked,) = rescore.rescore(long_model, [request], SPEC, 1e-4, batch_tokens=SMALL)
        (whole,) = rescore.rescore(long_model, [request], SPEC, 1e-4, batch_tokens=CONTEXT)
    finally:
        for handle in handles:
            handle.remove()
    reference = _unchunked(long_model, hidden[-1], [*request.prompt_ids, *request.response_ids])
    return Run(chunked, whole, reference, mode.sizes, shapes[:1], vocab)


def test_long_sequence_is_one_forward(run: Run) -> None:
    assert run.decoder_inputs == [(1, PROMPT + RESPONSE)]  # attention is never split
    assert len(run.chunked.logprobs) == RESPONSE


def test_no_tensor_holds_more_than_batch_tokens_positions_of_logits(run: Run) -> None:
    assert run.vocab_sizes  # the recorder saw the logits
    assert max(run.vocab_sizes) <= SMALL * run.vocab
    assert RESPONSE > 10 * SMALL  # unchunked logits would be far above the bound


def test_chunked_equals_one_pass(run: Run) -> None:
    """Equal flags; equal values to a few ulps where no support flip is flagged (a flagged row's
    nucleus may differ by a last-bit change, and targets outside the support are flagged)."""
    lp, flip = run.unchunked
    assert (~flip).sum() > RESPONSE / 5  # many values compared
    for scored in (run.chunked, run.whole):
        assert np.array_equal(scored.support_flip, flip)
        np.testing.assert_allclose(scored.logprobs[~flip], lp[~flip], rtol=0, atol=ulp_bound(lp))


def test_own_head_is_chunked_and_exact() -> None:
    """A head with extras (Granite's logit scaling) runs through the model's own forward, a
    chunk at a time, and equals that forward on the whole sequence."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    config = GraniteConfig(
        vocab_size=384,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        logits_scaling=4.0,
        initializer_range=0.08,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    prompt, response = rng.integers(0, 384, 40).tolist(), rng.integers(0, 384, 700).tolist()
    mode = VocabTensors(384)
    with mode:
        (chunked,) = rescore.rescore(
            model, [rescore.ScoreRequest(prompt, response)], SPEC, 1e-4, batch_tokens=64
        )
    ids = torch.tensor([prompt + response])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # the model's own head
        lp, flip = token_logprobs(logits, ids[0, len(prompt) :], SPEC, 1e-4)
    assert max(mode.sizes) <= 64 * 384
    kept, want = ~flip.numpy(), lp.numpy()
    assert np.array_equal(chunked.support_flip, ~kept) and kept.sum() > 100
    np.testing.assert_allclose(chunked.logprobs[kept], want[kept], rtol=0, atol=ulp_bound(want))
    plain = model.get_output_embeddings()  # the scaling was applied: not the bare linear head
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0, len(prompt) - 1 : -1]
        assert not torch.allclose(plain(hidden), logits)


def test_own_head_restores_the_decoder() -> None:
    """After a chunked own-head rescoring the decoder runs its real forward again."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    config = GraniteConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, logits_scaling=2.0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    rescore.rescore(model, [rescore.ScoreRequest([1, 2], [3, 4, 5])], SPEC, 1e-4, batch_tokens=2)
    assert "forward" not in model.get_decoder().__dict__
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)
