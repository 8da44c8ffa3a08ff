"""Multi-turn rollouts on the real vLLM engine and the tiny model (the multi-turn spec).

The trajectory is ``P0 + G1 + D1 + G2 + ...``: its ids must be exactly the prompt's ids, the
engine's sampled ids and the rendered given messages, in order; rescoring the whole trajectory
in one forward pass at fp32 must give per-turn k3 about 0 on every turn (the per-turn split
invents nothing), and a bf16 engine must show mismatch on every turn. Engines come from the
shared pool (``conftest.EnginePool``).
"""

from __future__ import annotations

import re
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


def test_prefix_cache_record_says_why_the_rest_was_not_cached(
    fp32_rollouts: list[Any], prompts: list[Any]
) -> None:
    record = turns.prefix_cache_record(fp32_rollouts)
    assert record is not None and record["block_size"] > 0
    parts = ("cached_tokens", "uncached_new_context_tokens", "uncached_partial_block_tokens",
             "uncached_other_tokens")  # fmt: skip
    assert sum(record[k] for k in parts) == record["prompt_tokens"]
    # the given messages between turns were never computed before their request
    given = sum(
        r.turns.starts[k] - r.turns.starts[k - 1] - r.turns.turn.count(k - 1)
        for r in fp32_rollouts
        for k in range(1, len(r.turns.starts))
    )
    assert record["uncached_new_context_tokens"] == given > 0
    # the CPU backend keeps whole blocks: the previous turn's last, partial block is recomputed
    assert (
        0
        < record["uncached_partial_block_tokens"]
        <= record["block_size"] * len([1 for r in fp32_rollouts for _ in r.turns.starts[1:]])
    )


def test_every_turn_advances_the_progress(engines: Any, prompts: list[Any]) -> None:
    """Plain lines (no terminal): the phase counts every turn of every trajectory."""
    import io

    from rich.console import Console

    from mismatch_probe.progress import PlainProgress, vllm_progress

    out = io.StringIO()
    total = turns.request_count(prompts, SAMPLES)
    bar = vllm_progress(PlainProgress(Console(file=out)), "gen fp32", total, "turns")
    turns.generate(engines.get("float32", "processed"), prompts, SPEC, SAMPLES, bar)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"gen fp32: started, {total} turns"
    assert lines[-1].startswith(f"gen fp32: done, {total} turns in ")
    assert total == 2 * (3 + 2 + 1)  # two samples of a 3-turn, a 2-turn and a 1-turn prompt


class _ScriptedEngine:
    """A stand-in for vLLM's ``LLMEngine`` in a unit test of the request loop's scheduling
    alone (the real engine runs in every other test here): request ``turn-<i>-<k>`` finishes
    after ``lengths[i][k]`` steps; submissions and finishes are logged in order."""

    def __init__(self, lengths: dict[int, list[int]]) -> None:
        self.lengths, self.left, self.log = lengths, {}, []
        self.aborted: list[str] = []

    def add_request(self, request: str, prompt: Any, params: Any) -> None:
        i, k = (int(x) for x in request.split("-")[1:])
        self.left[request] = self.lengths[i][k]
        self.log.append(("submit", request))

    def step(self) -> list[Any]:
        from types import SimpleNamespace

        done = []
        for request in list(self.left):
            self.left[request] -= 1
            if self.left[request] == 0:
                del self.left[request]
                self.log.append(("finish", request))
                out = SimpleNamespace(token_ids=[1], logprobs=[{1: SimpleNamespace(logprob=-1.0)}],
                                      finish_reason="length", text="x")  # fmt: skip
                done.append(SimpleNamespace(request_id=request, finished=True, outputs=[out],
                                            num_cached_tokens=0))  # fmt: skip
        return done

    def abort_request(self, requests: list[str]) -> None:
        self.aborted += requests


def test_a_trajectory_submits_its_next_turn_when_its_own_turn_ends(prompts: list[Any]) -> None:
    """Trajectory 0's turns take 1 step each, trajectory 1's first turn takes 10: trajectory 0
    runs its second and third turns while trajectory 1's first is still generating."""
    from types import SimpleNamespace

    three = next(p for p in prompts if p.turns is not None and p.turns.turns == 3)
    engine = _ScriptedEngine({0: [1, 1, 1], 1: [10, 1, 1]})
    trajectories = [turns._Trajectory(three, 0), turns._Trajectory(three, 1)]
    loop = turns._RequestLoop(SimpleNamespace(llm_engine=engine), SPEC, trajectories)
    loop.run(None)
    log = engine.log
    assert log.index(("submit", "turn-0-2")) < log.index(("finish", "turn-1-0"))
    assert [len(t.starts) for t in trajectories] == [3, 3] and not loop.pending


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_keeps_counting_after_the_first_turn(prompts: list[Any], terminal: bool) -> None:
    """The request loop advances the bar once per finished turn of every trajectory, turn 1+
    included: plain lines name the counts past the first turns' requests, a terminal's bar ends
    complete (a bar handed to turn 0's generate alone would stop at 2 of 6)."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from mismatch_probe.progress import make_progress, vllm_progress

    three = next(p for p in prompts if p.turns is not None and p.turns.turns == 3)
    trajectories = [turns._Trajectory(three, 0), turns._Trajectory(three, 1)]
    out = io.StringIO()
    progress = make_progress(Console(file=out, force_terminal=terminal, width=100))
    with progress:
        bar = vllm_progress(progress, "gen fp32", 6, "turns")(total=6)
        engine = _ScriptedEngine({0: [1, 2, 1], 1: [3, 1, 2]})
        turns._RequestLoop(SimpleNamespace(llm_engine=engine), SPEC, trajectories).run(bar)
        bar.close()
    if terminal:
        (task,) = progress.tasks
        assert task.completed == task.total == 6
        assert "6/6" in out.getvalue()
    else:
        lines = out.getvalue().splitlines()
        counted = [int(m.group(1)) for m in map(re.compile(r"gen fp32: (\d)/6").match, lines) if m]
        assert counted == [1, 2, 3, 4, 5]  # turns 1 and 2 (requests 3..6) reported too
        assert lines[-1].startswith("gen fp32: done, 6 turns in ")
