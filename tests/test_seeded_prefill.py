"""GRPO-sized generation on the real CPU engine: seeded requests through partial prefills.

A step's token budget (``max_num_batched_tokens``) that ends inside a prompt makes vLLM prefill
it in chunks and discard the token sampled for the partial chunk; the installed vLLM rewinds the
request's generator with ``set_offset``, which a CPU generator does not have (``RuntimeError:
CPU Generator does not use offset``). ``engine.seeded`` restores the generator instead: the
tokens must be those of the same requests sent in batches small enough for whole prefills.
"""

from __future__ import annotations

from typing import Any

import pytest

from mismatch_probe.engine import rollout
from mismatch_probe.prompts import EncodedPrompt, Prompt, encode_prompts
from mismatch_probe.sampling import SamplingSpec

from .conftest import PROMPT_TEXTS, TINY_CONTEXT

pytestmark = pytest.mark.engine

SPEC = SamplingSpec(max_tokens=3)
SAMPLES = 12  # x 4 prompts of 110-220 tokens: more prompt tokens than one step's budget


@pytest.fixture(scope="module")
def long_prompts(tiny_tokenizer: Any) -> list[EncodedPrompt]:
    raw = [Prompt(i, text=" ".join([t] * 12)) for i, t in enumerate(PROMPT_TEXTS[:4])]
    return encode_prompts(raw, tiny_tokenizer, True, TINY_CONTEXT, SPEC.max_tokens)


def test_partial_prefills_keep_seeded_tokens(engines: Any, long_prompts: list[Any]) -> None:
    llm = engines.get("float32", "processed")
    budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    sizes = [len(p.token_ids) for p in long_prompts]
    assert sum(sizes) * SAMPLES > budget  # one batch: some prompt is prefilled in chunks
    assert max(sizes) * SAMPLES < budget  # one prompt's group: every prefill whole
    together = rollout.generate(llm, long_prompts, SPEC, SAMPLES)
    apart = [r for p in long_prompts for r in rollout.generate(llm, [p], SPEC, SAMPLES)]
    assert [r.response_ids for r in together] == [r.response_ids for r in apart]
    # the seeds differ per request, so the samples of one prompt are not all the same
    assert len({tuple(r.response_ids) for r in together[:SAMPLES]}) > 1


def test_engine_failure_is_one_line_naming_the_cause(engines: Any) -> None:
    llm = engines.get("float32", "processed")
    vocab = llm.llm_engine.model_config.get_vocab_size()
    bad = EncodedPrompt(0, text="", token_ids=(1, vocab + 7))
    with pytest.raises(rollout.EngineError) as info:
        rollout.generate(llm, [bad], SPEC, 1)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("vLLM failed during generation: ")
    assert str(vocab + 7) in message or "vocab" in message.lower()
