"""The misaligned-settings checks (metrics spec section 8): ``temperature_mismatch`` and
``truncated_support``, on stores built from the tiny model's real logits (one transformers
forward in fp32 and one in bf16, shared by the module), each side scored at its own setting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.metrics.integrity import ERROR, compute_integrity
from mismatch_probe.metrics.sampling_checks import (
    MEDIAN_BINS_PER_DECADE,
    SUPPORT_CHECK,
    TEMPERATURE_CHECK,
    SamplingAccumulator,
)
from tests.ingest_fixtures import synthetic_steps
from tests.test_integrity import write_store

INGEST = {"kind": "ingest"}
SEQS, LENGTH = 24, 32
NEW = (TEMPERATURE_CHECK, SUPPORT_CHECK)


@pytest.fixture(scope="module")
def logits(tiny_model: Path) -> dict[str, Any]:
    """``{dtype: [SEQS, LENGTH, vocab] float64 logits}`` of random token ids, fp32 and bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.randint(5, 384, (SEQS, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=getattr(torch, dtype))
        with torch.no_grad():
            out[dtype] = model(ids).logits[:, :-1].double().numpy()
    return out


def log_softmax(z: np.ndarray, temperature: float = 1.0, top_p: float | None = None) -> np.ndarray:
    """Per position ``log softmax(z / T)``, renormalized over the top-p nucleus (``-inf``
    outside) when ``top_p`` is given: vLLM's processing order."""
    z = z / temperature
    lp = z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
    if top_p is None:
        return lp
    order = np.argsort(-lp, axis=-1)
    sorted_p = np.exp(np.take_along_axis(lp, order, -1))
    keep_sorted = np.cumsum(sorted_p, -1) - sorted_p < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    lp = np.where(keep, lp, -np.inf)
    return lp - np.logaddexp.reduce(lp, axis=-1, keepdims=True)


def sample(lp: np.ndarray, seed: int = 1) -> np.ndarray:
    """One token per position drawn from ``exp(lp)`` (the rollout side's distribution)."""
    rng = np.random.default_rng(seed)
    p = np.exp(lp)
    cdf = np.cumsum(p / p.sum(-1, keepdims=True), -1)
    u = rng.uniform(size=(*cdf.shape[:-1], 1))
    return np.minimum((cdf < u).sum(-1), lp.shape[-1] - 1)


def findings(tmp_path: Path, train: np.ndarray, rollout: np.ndarray, run: Any = INGEST) -> dict:
    path = write_store(tmp_path / "t.parquet", train.tolist(), rollout.tolist())
    return {f.check: f for f in compute_integrity(path, run).findings}


def sides(
    logits: dict[str, Any], rollout: dict[str, Any], train: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    """(train_lp, rollout_lp) of tokens sampled from the rollout side's distribution; each
    side: ``{"dtype", "temperature", "top_p"}`` (defaults float32, 1.0, none)."""

    def lp(side: dict[str, Any]) -> np.ndarray:
        z = logits[side.get("dtype", "float32")]
        return log_softmax(z, side.get("temperature", 1.0), side.get("top_p"))

    roll, tr = lp(rollout), lp(train)
    tokens = sample(roll)[..., None]
    pick = [np.take_along_axis(x, tokens, -1)[..., 0].astype(np.float32) for x in (tr, roll)]
    return pick[0], pick[1]


@pytest.mark.parametrize(("temperature", "direction"), [(0.7, "sharper"), (1.3, "flatter")])
def test_a_temperature_gap_fires_with_its_direction(
    logits: dict[str, Any], tmp_path: Path, temperature: float, direction: str
) -> None:
    train, rollout = sides(logits, {"temperature": temperature}, {})
    found = findings(tmp_path, train, rollout)
    assert set(found) & set(NEW) == {TEMPERATURE_CHECK}
    f = found[TEMPERATURE_CHECK]
    assert f.severity == ERROR and f.tokens == SEQS * LENGTH and f.sequences == SEQS
    assert f"the rollout side is {direction}" in f.message
    acc = SamplingAccumulator()
    acc.update(np.zeros(train.size, np.int64), train.ravel().astype(float),
               rollout.ravel().astype(float), np.ones(train.size, bool))  # fmt: skip
    b, rho = acc.fit()
    r = train.ravel().astype(float) - rollout.ravel()
    assert b == pytest.approx(np.polyfit(train.ravel(), r, 1)[0], rel=1e-6)
    assert rho == pytest.approx(np.corrcoef(train.ravel(), r)[0, 1], rel=1e-6)
    assert (b < 0) == (direction == "sharper") and abs(rho) >= 0.3 and abs(b) >= 0.05
    rollout_r = np.corrcoef(rollout.ravel(), r)[0, 1]
    assert acc.rollout_rho() == pytest.approx(rollout_r, rel=1e-6) and rollout_r * rho > 0.09


def test_noise_and_misaligned_tokens_are_no_temperature(tmp_path: Path) -> None:
    """The guard: noise on one side (``b = var(e)/var(train)`` > 0, nothing on the rollout
    side) and a shift by one (the two sides' correlations of opposite signs) have a slope on
    ``train_lp`` that passes the spec's two bounds, and are not a temperature gap."""
    rng = np.random.default_rng(4)
    rollout = rng.uniform(-3.0, -0.05, (4, 60))
    noisy = np.minimum(rollout + rng.normal(0.0, 0.6, rollout.shape), -1e-6)
    shifted = np.concatenate([rollout[:, 1:], np.full((4, 1), -1.0)], axis=1)
    for train in (noisy, shifted):
        acc = SamplingAccumulator()
        acc.update(np.repeat(np.arange(4), 60), train.ravel(), rollout.ravel(),
                   np.ones(train.size, bool))  # fmt: skip
        b, rho = acc.fit()
        assert abs(b) >= 0.05 and abs(rho) >= 0.3  # the spec's letter alone would fire
        assert acc.findings() == []


def test_the_same_tokens_rescored_at_another_temperature_fire_too(
    logits: dict[str, Any], tmp_path: Path
) -> None:
    """The selftest's injection: the training side rescored at T = 0.7 (sharper than the
    rollout side at T = 1): the rollout side reads as flatter."""
    train, rollout = sides(logits, {}, {"temperature": 0.7})
    found = findings(tmp_path, train, rollout)
    assert "the rollout side is flatter" in found[TEMPERATURE_CHECK].message


@pytest.mark.parametrize("truncated", ["rollout", "train"])
def test_a_nucleus_on_one_side_only_is_truncated_support(
    logits: dict[str, Any], tmp_path: Path, truncated: str
) -> None:
    nucleus = {"top_p": 0.9}
    rollout_side, train_side = (nucleus, {}) if truncated == "rollout" else ({}, nucleus)
    train, rollout = sides(logits, rollout_side, train_side)
    if truncated == "train":  # the engine samples outside the trainer's nucleus: -inf there
        keep = np.isfinite(train)
        train, rollout = np.where(keep, train, -1.0), np.where(keep, rollout, -1.0)
    found = findings(tmp_path, train, rollout)
    assert set(found) & set(NEW) == {SUPPORT_CHECK}  # temperature_mismatch yields to it
    f = found[SUPPORT_CHECK]
    sign = "negative" if truncated == "rollout" else "positive"
    assert f.severity == ERROR and f"is {sign} on" in f.message
    assert f"the {'rollout' if truncated == 'rollout' else 'training'} log-probs" in f.message
    r = (train.astype(float) - rollout)[np.abs(train.astype(float) - rollout) > 1e-6]
    median = float(np.median(r))
    mass = float(f.message.split("implied nucleus mass ")[1].split(";")[0])
    assert mass == pytest.approx(np.exp(-abs(median)), rel=0.01)


@pytest.mark.parametrize(
    "setting",
    [
        {"dtype": "bfloat16"},
        {"dtype": "bfloat16", "temperature": 0.7},
        {"dtype": "bfloat16", "temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.3},
    ],
    ids=["bf16", "bf16-T0.7", "bf16-T0.7-top_p0.9", "fp32-T1.3"],
)
def test_silent_when_both_sides_share_the_setting(
    logits: dict[str, Any], tmp_path: Path, setting: dict[str, Any]
) -> None:
    """Rollout in bf16 (or fp32), training in fp32, both at the same temperature and nucleus:
    only numerical noise is left."""
    train_side = {k: v for k, v in setting.items() if k != "dtype"}
    train, rollout = sides(logits, setting, train_side)
    keep = np.isfinite(train)  # a support flip at the nucleus edge: the scan's -inf, excluded
    found = findings(tmp_path, np.where(keep, train, -1.0), np.where(keep, rollout, -1.0))
    assert not set(found) & set(NEW), [found[c].message for c in set(found) & set(NEW)]


@pytest.mark.parametrize(("seed", "growth"), [(0, 0.05), (1, 0.05), (3, 0.05)])
def test_silent_on_the_ingest_fixtures(tmp_path: Path, seed: int, growth: float) -> None:
    """``synthetic_steps`` (the framework-log fixtures' data), made large enough to be judged
    (at least 100 tokens per step)."""
    data = synthetic_steps([1, 2, 3], seqs=40, seed=seed, growth=growth)
    seqs = [s for step in data.values() for s in step]
    steps = [step for step, batch in data.items() for _ in batch]
    path = write_store(tmp_path / "t.parquet", [s.train for s in seqs],
                       [s.rollout for s in seqs], steps)  # fmt: skip
    result = compute_integrity(path, INGEST)
    assert sum(len(s.train) for s in data[3]) >= 100
    every = [*result.findings, *(f for fs in result.steps.values() for f in fs)]
    assert not {f.check for f in every} & set(NEW)


def test_a_step_with_a_temperature_gap_is_found_in_that_step(
    logits: dict[str, Any], tmp_path: Path
) -> None:
    same_train, same_rollout = sides(logits, {"dtype": "bfloat16"}, {})
    hot_train, hot_rollout = sides(logits, {"temperature": 1.3}, {})
    train = np.concatenate([same_train, same_train, hot_train])
    rollout = np.concatenate([same_rollout, same_rollout, hot_rollout])
    steps = [1] * SEQS + [2] * SEQS + [3] * SEQS
    path = write_store(tmp_path / "t.parquet", train.tolist(), rollout.tolist(), steps)
    result = compute_integrity(path, INGEST)
    assert [TEMPERATURE_CHECK in {f.check for f in result.steps[s]} for s in (1, 2, 3)] == [
        False, False, True,
    ]  # fmt: skip


def test_thresholds_and_the_median() -> None:
    """100 differing tokens are judged, 99 are not; the histogram median is within its bin."""
    rng = np.random.default_rng(0)
    for n, fires in ((99, False), (100, True)):
        train = rng.uniform(-4, -0.1, n)
        rollout = train + 0.1  # r = -0.1 everywhere: a nucleus of mass e^-0.1
        acc = SamplingAccumulator()
        acc.update(np.arange(n), train, rollout, np.ones(n, bool))
        assert (acc.support_sign() == -1) is fires
    r = np.concatenate([-rng.lognormal(-4, 2, 5000), rng.lognormal(-5, 1, 300)])
    acc = SamplingAccumulator()
    acc.update(np.zeros(len(r), np.int64), np.full(len(r), -1.0) + r, np.full(len(r), -1.0),
               np.ones(len(r), bool))  # fmt: skip
    assert acc.median() == pytest.approx(np.median(r), rel=10 ** (1 / MEDIAN_BINS_PER_DECADE) - 1)
    at_edge = SamplingAccumulator()  # a median of exactly -1e-3 is not below -1e-3
    at_edge.update(np.zeros(200, np.int64), np.full(200, -1e-3), np.zeros(200),
                   np.ones(200, bool))  # fmt: skip
    assert at_edge.support_sign() == 0
