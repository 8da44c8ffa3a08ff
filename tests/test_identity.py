"""The identity check, on the real vLLM engine and a real transformers model.

Same precision on both sides must give (about) zero mismatch in every sampling configuration;
a wrong pairing of distributions must show up as large mismatch; and the rollout precision
must order the mismatch as physics says (fp32 < fp16 < bf16, mantissa bits 23 / 10 / 7).
Tests are grouped by engine configuration so that each engine starts once.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.engine import rollout
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training import rescore

from .conftest import encoded_prompts

pytestmark = pytest.mark.engine

SAMPLES = 3
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer: Any) -> list[Any]:
    return encoded_prompts(tiny_tokenizer)


@pytest.fixture(scope="module")
def fp32_model(tiny_model: Path) -> Any:
    return rescore.load_model(tiny_model, "float32")


def roll(engines: Any, prompts: list[Any], dtype: str, spec: SamplingSpec) -> list[Any]:
    llm = engines.get(dtype, spec.logprobs_mode)
    return rollout.generate(llm, prompts, spec, SAMPLES)


def log_ratios(
    model: Any, rollouts: list[Any], spec: SamplingSpec, flip_eps: float = 1e-4
) -> tuple[np.ndarray, np.ndarray]:
    """``(r = train - rollout [N], support_flip [N])`` over all response tokens."""
    requests = [rescore.ScoreRequest(r.prompt_ids, r.response_ids) for r in rollouts]
    scored = rescore.rescore(model, requests, spec, flip_eps, batch_tokens=512)
    train = np.concatenate([s.logprobs for s in scored]).astype(np.float64)
    engine = np.concatenate([r.rollout_logprobs for r in rollouts]).astype(np.float64)
    return train - engine, np.concatenate([s.support_flip for s in scored])


def k3(r: np.ndarray) -> float:
    return float(np.mean(np.expm1(r) - r))


PROCESSED = {
    "temperature": SamplingSpec(temperature=0.7, max_tokens=MAX_TOKENS),
    "top_k": SamplingSpec(top_k=20, max_tokens=MAX_TOKENS),
    "top_p": SamplingSpec(top_p=0.9, max_tokens=MAX_TOKENS),
    "all": SamplingSpec(temperature=0.7, top_k=20, top_p=0.9, max_tokens=MAX_TOKENS),
}


@pytest.mark.parametrize("name", list(PROCESSED))
def test_identity_processed(engines: Any, prompts: list[Any], fp32_model: Any, name: str) -> None:
    spec = PROCESSED[name]
    rollouts = roll(engines, prompts, "float32", spec)
    r, flip = log_ratios(fp32_model, rollouts, spec)
    assert len(r) > 100
    assert np.isfinite(r[~flip]).all()
    assert np.abs(r[~flip]).max() < 1e-3
    assert flip.mean() < 0.2  # flags are the exception, not the rule


def test_processed_rescored_raw_is_detected(
    engines: Any, prompts: list[Any], fp32_model: Any
) -> None:
    """Processed engine log-probs (T=0.7) against a raw rescoring: a pairing bug."""
    spec = PROCESSED["temperature"]
    rollouts = roll(engines, prompts, "float32", spec)
    r, _ = log_ratios(fp32_model, rollouts, replace(spec, logprobs_mode="raw"))
    assert np.abs(r).mean() > 0.05


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_identity_raw(
    engines: Any, prompts: list[Any], fp32_model: Any, temperature: float
) -> None:
    spec = SamplingSpec(temperature=temperature, max_tokens=MAX_TOKENS, logprobs_mode="raw")
    rollouts = roll(engines, prompts, "float32", spec)
    r, flip = log_ratios(fp32_model, rollouts, spec)
    assert not flip.any()  # raw mode has no support to flip
    assert np.abs(r).max() < 1e-3


def test_raw_engine_against_temperature_rescoring_is_detected(
    engines: Any, prompts: list[Any], fp32_model: Any
) -> None:
    """The deliberately wrong pairing: raw engine log-probs vs a temperature-scaled rescore."""
    spec = SamplingSpec(temperature=0.7, max_tokens=MAX_TOKENS, logprobs_mode="raw")
    rollouts = roll(engines, prompts, "float32", spec)
    r, _ = log_ratios(fp32_model, rollouts, replace(spec, logprobs_mode="processed"))
    assert np.abs(r).mean() > 0.05
    assert k3(r) > 1e-3


def test_rollout_precision_orders_mismatch(
    engines: Any, prompts: list[Any], fp32_model: Any
) -> None:
    """Same prompts and seed: k3_kl(bf16 vs fp32) > k3_kl(fp16 vs fp32) > k3_kl(fp32 vs fp32)."""
    spec = SamplingSpec(max_tokens=MAX_TOKENS)
    mismatch = {}
    for dtype in ("float16", "bfloat16", "float32"):
        r, _ = log_ratios(fp32_model, roll(engines, prompts, dtype, spec), spec)
        mismatch[dtype] = (k3(r), float(np.abs(r).mean()))
    assert mismatch["bfloat16"][0] > mismatch["float16"][0] > mismatch["float32"][0]
    assert mismatch["bfloat16"][1] > mismatch["float16"][1] > mismatch["float32"][1]
    assert mismatch["float32"][1] < 1e-4
