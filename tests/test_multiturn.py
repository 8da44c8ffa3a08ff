"""Multi-turn rollouts on the real vLLM engine and the tiny model (the multi-turn spec).

The trajectory is ``P0 + G1 + D1 + G2 + ...``: its ids must be exactly the prompt's ids, the
engine's sampled ids and the rendered given messages, in order; rescoring the whole trajectory
in one forward pass at fp32 must give per-turn k3 about 0 on every turn (the per-turn split
invents nothing), and a bf16 engine must show mismatch on every turn. Engines come from the
shared pool (``conftest.EnginePool``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.engine import turns
from mismatch_probe.pipeline import trajectory
from mismatch_probe.prompts import Prompt, encode_prompts
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training import rescore

from .conftest import TINY_CONTEXT

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
SAMPLES = 2
# Long enough that turn 1's prompt spans a whole KV block (128 tokens on CPU): the prefix cache
# can then serve it.
SYSTEM = (
    "Reinforcement learning trains a policy from rewards; rollouts come from an inference "
    "engine. The quick brown fox jumps over the lazy dog. A language model predicts the next "
    "token. What is the capital of France? Paris is the capital of France. Two plus two equals "
    "four. def add(a, b): return a + b  # Python code with numbers 0 1 2 3 4 5 6 7 8 9."
)
CONVERSATIONS = (
    (
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is two plus two? Use the calculator."},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "And the capital of France?"},
        {"role": "assistant"},
    ),
    (
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Solve for x: 3x + 5 = 20."},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "x = 5"},
        {"role": "assistant", "content": None},
    ),
    ({"role": "user", "content": "The quick brown fox"},),  # single turn, in the same file
)


def conversation_prompts(tokenizer: Any) -> list[Any]:
    raw = [Prompt(i, messages=m) for i, m in enumerate(CONVERSATIONS)]
    return encode_prompts(raw, tokenizer, True, TINY_CONTEXT, MAX_TOKENS)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer: Any) -> list[Any]:
    return conversation_prompts(tiny_tokenizer)


@pytest.fixture(scope="module")
def fp32_model(tiny_model: Path) -> Any:
    return rescore.load_model(tiny_model, "float32")


SPEC = SamplingSpec(max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def fp32_rollouts(engines: Any, prompts: list[Any]) -> list[Any]:
    return turns.generate(engines.get("float32", "processed"), prompts, SPEC, SAMPLES)


def per_turn_log_ratios(model: Any, rollouts: list[Any]) -> dict[int, np.ndarray]:
    """turn -> ``[N_t]`` ``r = train - rollout`` over that turn's tokens of every rollout."""
    scored = rescore.rescore(
        model, [trajectory.score_request(r) for r in rollouts], SPEC, 1e-4, batch_tokens=2048
    )
    out: dict[int, list[float]] = {}
    for r, s in zip(rollouts, scored, strict=True):
        diff = s.logprobs.astype(np.float64) - np.asarray(r.rollout_logprobs, np.float64)
        for t, x in zip(trajectory.token_turns(r), diff, strict=True):
            out.setdefault(t, []).append(float(x))
    return {t: np.asarray(v) for t, v in out.items()}


def test_trajectory_ids_are_prompt_sampled_and_given_in_order(
    fp32_rollouts: list[Any], prompts: list[Any], tiny_tokenizer: Any
) -> None:
    assert len(fp32_rollouts) == len(prompts) * SAMPLES
    for r in fp32_rollouts:
        p = prompts[r.prompt_id]
        assert r.prompt_ids == list(p.token_ids)
        t = r.turns
        assert t is not None
        n = p.turns.turns if p.turns is not None else 1
        assert len(t.starts) == len(t.finish_reasons) == n
        expected: list[int] = []
        for k in range(n):
            generated = [x for x, turn in zip(r.response_ids, t.turn, strict=True) if turn == k]
            assert 0 < len(generated) <= MAX_TOKENS
            assert t.starts[k] == len(expected)
            expected += generated
            if p.turns is not None:
                given = p.turns.context_after(k, generated)
                expected += given
                if k < n - 1:  # what follows is the template's rendering of the given message
                    text = tiny_tokenizer.decode(list(given))
                    role = [m for m in CONVERSATIONS[r.prompt_id] if "content" in m]
                    assert text.endswith("<|end|><|assistant|>")
                    assert any(m["content"] and m["content"] in text for m in role)
        assert list(t.continuation) == expected
        assert [t.continuation[i] for i in t.positions] == r.response_ids
        assert len(r.rollout_logprobs) == len(r.response_ids)
    assert {r.turns.finish_reasons[0] for r in fp32_rollouts} <= {"stop", "length"}


def test_a_turn_cut_at_max_tokens_is_closed_as_the_template_closes_it(
    fp32_rollouts: list[Any], tiny_tokenizer: Any
) -> None:
    cut = [
        (r, k)
        for r in fp32_rollouts
        for k, reason in enumerate(r.turns.finish_reasons[:-1])
        if reason == "length"
    ]
    assert cut, "a random tiny model runs to --max-tokens on some turn"
    for r, k in cut:
        after = r.turns.continuation[r.turns.starts[k] + MAX_TOKENS]
        assert after == tiny_tokenizer.eos_token_id  # <|end|> appended as context, not scored
        assert r.turns.starts[k] + MAX_TOKENS not in r.turns.positions


def test_fp32_identity_on_every_turn(fp32_model: Any, fp32_rollouts: list[Any]) -> None:
    ratios = per_turn_log_ratios(fp32_model, fp32_rollouts)
    assert sorted(ratios) == [0, 1, 2]
    for t, r in ratios.items():
        assert len(r) > 0
        assert np.abs(r).max() < 1e-3, t
        assert float(np.mean(np.expm1(r) - r)) < 1e-6, t


def test_later_turns_reuse_the_prefix_cache(fp32_rollouts: list[Any], prompts: list[Any]) -> None:
    record = turns.prefix_cache_record(fp32_rollouts)
    assert record is not None
    later = sum(p.turns.turns - 1 for p in prompts if p.turns is not None) * SAMPLES
    assert record["later_turn_requests"] == later  # turns 1, 2 of the first; turn 1 of the second
    # turn k's prompt holds turns 0..k-1 whole: the cache serves at least their full blocks
    assert record["cached_tokens"] >= 128 * record["later_turn_requests"]


def test_bf16_mismatch_on_every_turn(engines: Any, prompts: list[Any], fp32_model: Any) -> None:
    rollouts = turns.generate(engines.get("bfloat16", "processed"), prompts, SPEC, SAMPLES)
    ratios = per_turn_log_ratios(fp32_model, rollouts)
    assert sorted(ratios) == [0, 1, 2]
    for t, r in ratios.items():
        assert float(np.mean(np.abs(r))) > 1e-3, t
