"""Multi-turn rollouts: a trajectory grown turn by turn, one engine request per generated turn.

The multi-turn spec's trajectory is append-only: ``ids = P0 + G1 + D1 + G2 + ...``. Turn ``k``
is one request whose prompt is the trajectory so far (token ids: the sampled ``G`` ids are
never re-tokenized); its sampled ids and log-probabilities are recorded, then the prompt's
``TurnPlan`` says which context ids follow (the template's close, the given messages, the next
generation prompt). All trajectories' turn ``k`` go to the engine in one batched call.

The prompt of turn ``k`` repeats turns ``0..k-1``: the engine's prefix cache holds them
(``engine_defaults`` turns it on; each turn's cached prompt tokens are recorded). A prompts
file without open assistant turns is sampled by ``rollout.generate`` exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mismatch_probe.engine import rollout
from mismatch_probe.engine.rollout import Rollout, Turns
from mismatch_probe.prompts import EncodedPrompt
from mismatch_probe.sampling import SamplingSpec

TURN_SEED_STRIDE = 7_919  # turn k > 0 of a request: its seed plus k times this (mod 2**31)


def multi_turn(prompts: Sequence[EncodedPrompt]) -> bool:
    """True when any prompt has open assistant turns (a ``TurnPlan``)."""
    return any(p.turns is not None for p in prompts)


def engine_defaults(prompts: Sequence[EncodedPrompt]) -> dict[str, Any]:
    """Engine arguments a multi-turn scan needs (``--vllm-arg`` wins): the prefix cache on, so
    that turn ``k`` does not prefill turns ``0..k-1`` again."""
    return {"enable_prefix_caching": True} if multi_turn(prompts) else {}


@dataclass
class _Trajectory:
    """One (prompt, sample) trajectory while it grows."""

    prompt: EncodedPrompt
    sample_id: int
    continuation: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # generated, all turns
    logprobs: list[float] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return self.prompt.turns.turns if self.prompt.turns is not None else 1

    def add_turn(self, out: Any, num_cached: int | None) -> None:
        """Append the engine's output of the next turn, then the context that follows it."""
        k = len(self.starts)
        ids = list(out.token_ids)
        self.starts.append(len(self.continuation))
        self.positions += range(len(self.continuation), len(self.continuation) + len(ids))
        self.turn += [k] * len(ids)
        self.ids += ids
        self.logprobs += [float(step[t].logprob) for t, step in zip(ids, out.logprobs, strict=True)]
        self.continuation += ids
        self.reasons.append(str(out.finish_reason or "unknown"))
        self.texts.append(out.text)
        self.cached.append(int(num_cached or 0))
        if self.prompt.turns is not None:
            self.continuation += self.prompt.turns.context_after(k, ids)

    def rollout(self, seq_id: int) -> Rollout:
        turns = Turns(
            continuation=tuple(self.continuation),
            positions=tuple(self.positions),
            turn=tuple(self.turn),
            starts=tuple(self.starts),
            finish_reasons=tuple(self.reasons),
            texts=tuple(self.texts),
            cached_tokens=tuple(self.cached),
            messages=self.prompt.turns.messages if self.prompt.turns is not None else (),
        )
        return Rollout(
            seq_id=seq_id,
            prompt_id=self.prompt.prompt_id,
            sample_id=self.sample_id,
            prompt_ids=list(self.prompt.token_ids),
            response_ids=self.ids,
            rollout_logprobs=self.logprobs,
            finish_reason=self.reasons[-1],
            response_text="".join(self.texts),
            turns=turns,
        )


def turn_seed(spec: SamplingSpec, prompt_id: int, sample_id: int, turn: int) -> int:
    """Turn 0 keeps the single-turn request's seed; later turns get their own."""
    return (rollout.request_seed(spec, prompt_id, sample_id) + turn * TURN_SEED_STRIDE) % (2**31)


def generate(
    llm: Any,
    prompts: Sequence[EncodedPrompt],
    spec: SamplingSpec,
    samples_per_prompt: int,
    progress: Callable[..., Any] | bool = False,
) -> list[Rollout]:
    """Sample every prompt's trajectory (``samples_per_prompt`` each), turn by turn.

    Returns:
        Rollouts ordered by (prompt, sample); ``seq_id`` is that order's index. A multi-turn
        prompt's rollout has ``turns``; a single-turn prompt's (in a file that mixes both) is a
        one-turn trajectory whose ``turns`` has no context.
    """
    if not multi_turn(prompts):
        return rollout.generate(llm, prompts, spec, samples_per_prompt, progress)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    trajectories = [_Trajectory(p, s) for p in prompts for s in range(samples_per_prompt)]
    turn = 0
    while active := [t for t in trajectories if turn < t.num_turns]:
        params = [
            rollout._sampling_params(SamplingParams, spec, t.prompt.prompt_id, t.sample_id)
            for t in active
        ]
        for t, p in zip(active, params, strict=True):
            p.seed = turn_seed(spec, t.prompt.prompt_id, t.sample_id, turn)
        inputs = [
            TokensPrompt(prompt_token_ids=[*t.prompt.token_ids, *t.continuation]) for t in active
        ]
        outputs = llm.generate(inputs, params, use_tqdm=progress if turn == 0 else False)
        for t, out in zip(active, outputs, strict=True):
            t.add_turn(out.outputs[0], getattr(out, "num_cached_tokens", None))
        turn += 1
    return [t.rollout(i) for i, t in enumerate(trajectories)]


def prefix_cache_record(rollouts: Sequence[Rollout]) -> dict[str, int] | None:
    """``run.json``'s view of the prefix cache over the later turns' requests (turn >= 1):
    their prompt tokens and how many of them the cache held; None without multi-turn."""
    later = [(r, k) for r in rollouts if r.turns is not None for k in range(1, len(r.turns.starts))]
    if not later:
        return None
    prompt = sum(len(r.prompt_ids) + r.turns.starts[k] for r, k in later if r.turns)
    cached = sum(r.turns.cached_tokens[k] for r, k in later if r.turns)
    return {"later_turn_requests": len(later), "prompt_tokens": prompt, "cached_tokens": cached}
