"""Multi-turn rollouts: a trajectory grown turn by turn, one engine request per generated turn.

The multi-turn spec's trajectory is append-only: ``ids = P0 + G1 + D1 + G2 + ...``. Turn ``k``
is one request whose prompt is the trajectory so far (token ids: the sampled ``G`` ids are
never re-tokenized); its sampled ids and log-probabilities are recorded, then the prompt's
``TurnPlan`` says which context ids follow (the template's close, the given messages, the next
generation prompt). Trajectories advance independently: the engine's request loop (``vllm``'s
``LLMEngine.add_request`` / ``step``, in-process and multiprocess engines alike) gets a
trajectory's turn ``k + 1`` as soon as its turn ``k`` ends, so a short turn never waits for the
batch's longest; an interrupt aborts the requests still in the engine.

The prompt of turn ``k`` repeats turns ``0..k-1``: the engine's prefix cache holds them
(``engine_defaults`` turns it on; each turn's cached prompt tokens are recorded, and
``prefix_cache_record`` says why the rest was not cached). A prompts
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

    def rollout(self, seq_id: int, block_size: int = 0) -> Rollout:
        turns = Turns(
            continuation=tuple(self.continuation),
            positions=tuple(self.positions),
            turn=tuple(self.turn),
            starts=tuple(self.starts),
            finish_reasons=tuple(self.reasons),
            texts=tuple(self.texts),
            cached_tokens=tuple(self.cached),
            messages=self.prompt.turns.messages if self.prompt.turns is not None else (),
            block_size=block_size,
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


def request_count(prompts: Sequence[EncodedPrompt], samples_per_prompt: int) -> int:
    """Engine requests of a scan: one per generated turn of every trajectory."""
    per = sum(p.turns.turns if p.turns is not None else 1 for p in prompts)
    return per * samples_per_prompt


def generate(
    llm: Any,
    prompts: Sequence[EncodedPrompt],
    spec: SamplingSpec,
    samples_per_prompt: int,
    progress: Callable[..., Any] | bool = False,
) -> list[Rollout]:
    """Sample every prompt's trajectory (``samples_per_prompt`` each), turn by turn, each
    trajectory at its own pace: its next turn is submitted to the engine's request loop as soon
    as its own previous turn ends (``LLMEngine.add_request`` / ``step``, as agent frameworks
    drive it), while the other trajectories' turns keep running. ``progress``: a ``use_tqdm``
    callable, advanced once per finished turn request (``request_count`` in all).

    Returns:
        Rollouts ordered by (prompt, sample); ``seq_id`` is that order's index. A multi-turn
        prompt's rollout has ``turns``; a single-turn prompt's (in a file that mixes both) is a
        one-turn trajectory whose ``turns`` has no context.
    """
    if not multi_turn(prompts):
        return rollout.generate(llm, prompts, spec, samples_per_prompt, progress)
    trajectories = [_Trajectory(p, s) for p in prompts for s in range(samples_per_prompt)]
    loop = _RequestLoop(llm, spec, trajectories)
    bar = progress(total=sum(t.num_turns for t in trajectories)) if callable(progress) else None
    try:
        with rollout.running("multi-turn generation"):
            loop.run(bar)
    finally:
        loop.abort()  # nothing of an interrupted scan keeps running in the engine
        if bar is not None:
            bar.close()
    block = _block_size(llm)
    return [t.rollout(i, block) for i, t in enumerate(trajectories)]


class _RequestLoop:
    """The engine's request loop over growing trajectories: request ``turn-<i>-<k>`` is turn
    ``k`` of trajectory ``i``."""

    def __init__(self, llm: Any, spec: SamplingSpec, trajectories: list[_Trajectory]) -> None:
        self.engine = llm.llm_engine
        self.spec = spec
        self.trajectories = trajectories
        self.pending: dict[str, int] = {}  # request id -> trajectory

    def submit(self, i: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        t = self.trajectories[i]
        k = len(t.starts)
        params = rollout._sampling_params(
            SamplingParams, self.spec, t.prompt.prompt_id, t.sample_id
        )
        params.seed = turn_seed(self.spec, t.prompt.prompt_id, t.sample_id, k)
        ids = [*t.prompt.token_ids, *t.continuation]
        request = f"turn-{i}-{k}"
        self.engine.add_request(request, TokensPrompt(prompt_token_ids=ids), params)
        self.pending[request] = i

    def run(self, bar: Any) -> None:
        for i in range(len(self.trajectories)):
            self.submit(i)
        while self.pending:
            for out in self.engine.step():
                if not out.finished or out.request_id not in self.pending:
                    continue
                i = self.pending.pop(out.request_id)
                t = self.trajectories[i]
                t.add_turn(out.outputs[0], getattr(out, "num_cached_tokens", None))
                if bar is not None:
                    bar.update(1)
                if len(t.starts) < t.num_turns:
                    self.submit(i)

    def abort(self) -> None:
        if self.pending:
            self.engine.abort_request(list(self.pending))
            self.pending.clear()


def _block_size(llm: Any) -> int:
    """The engine's KV-cache block size (the prefix cache keeps whole blocks); 0 if unknown."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return int(getattr(getattr(config, "cache_config", None), "block_size", 0) or 0)


def prefix_cache_record(rollouts: Sequence[Rollout]) -> dict[str, int] | None:
    """``run.json``'s view of the prefix cache over the later turns' requests (turn >= 1):
    their prompt tokens, how many of them the cache held, and why the rest was not held, in
    three parts that sum to the rest: ``uncached_new_context_tokens`` (the given messages and
    the next generation prompt, never computed before the request), ``uncached_partial_block_
    tokens`` (computed for the previous turn, but in its last, incomplete KV block: the cache
    keeps whole blocks of ``block_size`` tokens, and the last sampled token has no KV yet) and
    ``uncached_other_tokens`` (in whole blocks and not served: evicted). None without
    multi-turn."""
    later = [(r, k) for r in rollouts if r.turns is not None for k in range(1, len(r.turns.starts))]
    if not later:
        return None
    parts = [_request_parts(r, k) for r, k in later]
    keys = ("prompt_tokens", "cached_tokens", "uncached_new_context_tokens",
            "uncached_partial_block_tokens", "uncached_other_tokens")  # fmt: skip
    record = {"later_turn_requests": len(later)}
    record.update({key: sum(p[j] for p in parts) for j, key in enumerate(keys)})
    record["block_size"] = max((r.turns.block_size for r, _ in later if r.turns), default=0)
    return record


def _request_parts(r: Rollout, k: int) -> tuple[int, int, int, int, int]:
    """Turn ``k``'s request: prompt tokens, cached, and the three uncached parts."""
    assert r.turns is not None
    t = r.turns
    generated = sum(1 for turn in t.turn if turn == k - 1)
    before = len(r.prompt_ids) + t.starts[k - 1] + generated  # the end of turn k-1's ids
    prompt = len(r.prompt_ids) + t.starts[k]
    cached = min(t.cached_tokens[k], prompt)
    block = t.block_size
    reusable = (before - 1) // block * block if block else before - 1  # whole blocks with KV
    uncached = prompt - cached
    new = min(prompt - before, uncached)
    partial = min(max(before - reusable, 0), uncached - new)
    return prompt, cached, new, partial, uncached - new - partial
