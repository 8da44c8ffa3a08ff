"""Multi-turn against single-turn on the embedded default model, in one run: a 3-turn scan
(story requests, "Go on." between turns) against a single-turn scan of the same first requests
whose budget is three times as large (the same number of tokens at most, ``3 * MAX_TOKENS``).

Each turn's request repeats the trajectory so far; the engine's prefix cache must keep that from
costing a prefill of the whole context each turn, and the training side scores each trajectory
once. Generated lengths differ (a turn may stop early), so the comparison is per generated
token: ``ratio = (multi-turn seconds / token) / (single-turn seconds / token)`` over generation
and rescoring (the goal: within 1.3). Trajectories advance independently in the engine's
request loop (``engine.turns``); ``prefix_cache`` says how many later-turn prompt tokens the
cache held and why the rest was not held (new context, partial KV blocks, other).
``default_block`` is the 3-turn scan again with the CPU backend's default KV block (128 tokens)
instead of the smaller one probe asks for in a multi-turn scan (``rollout.
CPU_PREFIX_REUSE_DEFAULTS``): what that block is worth, in the same run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.scan import run_scan
from mismatch_probe.sampling import SamplingSpec

PROMPTS = 8
MAX_TOKENS = 32
TURNS = 3
REPEATS = 2  # A/B alternated, best of each
GOAL = 1.3  # multi-turn seconds per token over single-turn
DEFAULT_CPU_BLOCK = 128  # vLLM's KV block on the CPU backend (vllm/platforms/cpu.py)
# An agent's system prompt is long (tools, rules): its blocks are what the prefix cache keeps.
SYSTEM = (
    "You are a storyteller agent. You write vivid, detailed stories with named characters, "
    "places and dialogue. Rules: never summarise, never end a story early, keep every detail "
    "consistent with what was written before, describe sounds, smells and colours, give each "
    "character a distinct voice, and end each reply in the middle of the action so that the "
    "story can go on. Tools: outline(topic) returns a plot outline; names(culture) returns "
    "character names; map(place) describes a setting. When the user says 'Go on', continue "
    "exactly where you stopped, in the same style, without repeating anything. Write in the "
    "past tense and the third person, in plain English, with short paragraphs."
)
TOPICS = ("a lighthouse keeper", "a lost robot", "a desert caravan", "a night train",
          "a mountain village", "a pirate cook", "a clockmaker", "a winter market")  # fmt: skip


def _conversations() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(3-turn lines, single-turn lines) of the same requests: open-ended, so that turns tend to
    run to their budget and both scans generate about the same number of tokens."""
    multi, single = [], []
    for topic in TOPICS[:PROMPTS]:
        request = {"role": "user", "content": f"Write a long, detailed story about {topic}."}
        head = [{"role": "system", "content": SYSTEM}, request]
        turns: list[dict[str, Any]] = [{"role": "assistant", "content": None}]
        for _ in range(TURNS - 1):
            turns += [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": None}]
        multi.append({"messages": head + turns})
        single.append({"messages": head})
    return multi, single


def _scan(
    lines: list[dict[str, Any]], max_tokens: int, tmp: Path, name: str, **vllm_args: Any
) -> dict[str, Any]:
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    spec = SamplingSpec(max_tokens=max_tokens)
    cfg = ScanConfig(prompts=path, sampling=spec, out=tmp / name, vllm_args=vllm_args)
    result = run_scan(cfg, Console(stderr=True))
    timings = result.run["timings"]
    tokens = result.metrics["num_tokens"]
    work = timings["generation"] + timings["rescoring"]
    record = {
        "response_tokens": tokens,
        "generation_seconds": timings["generation"],
        "rescoring_seconds": timings["rescoring"],
        "seconds_per_token": work / tokens,
    }
    prefix = result.run["rollouts"][0].get("prefix_cache")
    return {**record, "prefix_cache": prefix} if prefix else record


def bench_multiturn() -> dict[str, Any]:
    """Both scans ``REPEATS`` times, alternated; the best of each kept (a shared machine)."""
    import os

    multi, single = _conversations()
    load_before = [round(x, 2) for x in os.getloadavg()]
    tries: dict[str, list[dict[str, Any]]] = {"multi": [], "single": [], "default_block": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(REPEATS):
            tries["multi"].append(_scan(multi, MAX_TOKENS, Path(tmp), f"multi{k}"))
            tries["single"].append(_scan(single, TURNS * MAX_TOKENS, Path(tmp), f"single{k}"))
            tries["default_block"].append(
                _scan(multi, MAX_TOKENS, Path(tmp), f"block{k}", block_size=DEFAULT_CPU_BLOCK)
            )
    total = lambda r: r["generation_seconds"] + r["rescoring_seconds"]  # noqa: E731
    three, one, default = (min(tries[n], key=total) for n in ("multi", "single", "default_block"))
    return {
        "prompts": PROMPTS,
        "ratio_seconds": total(three) / total(one),
        "multi_turn": {"turns": TURNS, "max_tokens_per_turn": MAX_TOKENS, **three},
        "single_turn": {"max_tokens": TURNS * MAX_TOKENS, **one},
        "ratio_seconds_per_token": three["seconds_per_token"] / one["seconds_per_token"],
        "default_block": {"block_size": DEFAULT_CPU_BLOCK, **default},
        "speedup_per_token_smaller_block": default["seconds_per_token"]
        / three["seconds_per_token"],
        "goal_ratio": GOAL,
        "load": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
    }
