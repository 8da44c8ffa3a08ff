"""Multi-turn on the embedded default model (SmolLM2-135M-Instruct, its own ChatML template),
with the bundled tool-use conversations: fp32 against fp32 gives per-turn k3 about 0 on every
turn, a bf16 engine gives mismatch on every turn. Two engines start here (fp32, bf16), one at a
time, beside one fp32 training model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe import models
from mismatch_probe.engine import rollout, turns
from mismatch_probe.pipeline import trajectory
from mismatch_probe.prompts import encode_prompts, load_prompts
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.settings import RolloutSetting
from mismatch_probe.training import rescore

pytestmark = pytest.mark.engine

AGENTIC = Path(__file__).resolve().parent.parent / "prompts" / "agentic.jsonl"
SPEC = SamplingSpec(max_tokens=8)
CONTEXT = 2048


@pytest.fixture(scope="module")
def setup() -> tuple[Path, Any, list[Any]]:
    from transformers import AutoTokenizer

    model_dir = models.resolve_model(None)  # converted once into the cache
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    raw = load_prompts(AGENTIC, limit=3)  # 2, 4 and 2 generated turns
    return model_dir, tokenizer, encode_prompts(raw, tokenizer, True, CONTEXT, SPEC.max_tokens)


def sample(model_dir: Path, prompts: list[Any], dtype: str) -> list[Any]:
    kwargs = rollout.engine_kwargs(
        model_dir,
        RolloutSetting(dtype),
        SPEC,
        CONTEXT,
        {"kv_cache_memory_bytes": 256 << 20, **turns.engine_defaults(prompts)},
    )
    with rollout.engine(kwargs) as llm:
        return turns.generate(llm, prompts, SPEC, 1)


def per_turn_abs(model: Any, rollouts: list[Any]) -> dict[int, np.ndarray]:
    requests = [trajectory.score_request(r) for r in rollouts]
    scored = rescore.rescore(model, requests, SPEC, 1e-4)
    out: dict[int, list[float]] = {}
    for r, s in zip(rollouts, scored, strict=True):
        diff = s.logprobs.astype(np.float64) - np.asarray(r.rollout_logprobs, np.float64)
        for t, x in zip(trajectory.token_turns(r), diff, strict=True):
            out.setdefault(t, []).append(float(x))
    return {t: np.asarray(v) for t, v in out.items()}


def test_default_model_per_turn_identity_and_bf16(setup: tuple[Path, Any, list[Any]]) -> None:
    model_dir, tokenizer, prompts = setup
    assert [p.turns.turns for p in prompts] == [2, 4, 2]
    fp32 = sample(model_dir, prompts, "float32")
    bf16 = sample(model_dir, prompts, "bfloat16")
    for r in fp32:  # ChatML: a stopped turn ends with <|im_end|>, the template's "\n" follows
        assert r.prompt_ids == list(prompts[r.prompt_id].token_ids)
        assert [r.turns.continuation[i] for i in r.turns.positions] == r.response_ids
        t = r.turns
        for k, reason in enumerate(t.finish_reasons[:-1]):
            end = t.starts[k] + sum(1 for x in t.turn if x == k)  # first context id
            closing = tokenizer.decode(list(t.continuation[end : end + 2]))
            assert closing == ("\n<|im_start|>" if reason == "stop" else "<|im_end|>\n"), k
    model = rescore.load_model(model_dir, "float32")
    identity = per_turn_abs(model, fp32)
    assert sorted(identity) == [0, 1, 2, 3]
    for t, r in identity.items():
        assert np.abs(r).max() < 1e-3, t
        assert float(np.mean(np.expm1(r) - r)) < 1e-6, t
    mismatch = per_turn_abs(model, bf16)
    assert sorted(mismatch) == [0, 1, 2, 3]
    for t, r in mismatch.items():
        assert float(np.mean(np.abs(r))) > 1e-3, t
