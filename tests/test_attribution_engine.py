"""Attribution on the real vLLM engine (session pool, raw mode) and real transformers models.

Each module fixture samples with one engine dtype, reads the engine rungs (prefill batched and
one sequence at a time), rescores at the training dtypes and fills the other rungs through the
scan's own functions (``attribution.add_train_rungs``, ``scan.write_store``), then computes the
links from the written store. Fixtures are ordered by engine so each engine starts once.

Tolerances:

* Telescoping: links are float64 differences of stored float32 rungs; their sum differs from
  ``train - rollout`` only by float64 rounding (~1e-15 at log-probs of order 10), far inside
  the 1e-6 the attribution spec promises.
* fp32 on both sides: every link below 1e-3 (the spec's bound for the fp32 identity, about
  1e4 float32 ulps of a log-probability of order 1).
* Precision physics: with fp32 training, the precision link is the rounding of the rollout
  dtype: 10 mantissa bits (fp16) against 7 (bf16), so |r| scales by about 2^3 and k3 (~ r^2/2)
  by about 2^6; we only require the order. "Far above the fp32 identity level" means at least
  2^13 times the whole fp32/fp32 k3 (the 23 - 10 = 13 bits fp16 loses against fp32, taken once
  although k3 is quadratic in them).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from mismatch_probe.engine import rollout
from mismatch_probe.metrics.attribution import MISMATCH_LINKS, compute_attribution, link_ratios
from mismatch_probe.pipeline import attribution, scan
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.prompts import Prompt, encode_prompts
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.settings import RolloutSetting, Setting
from mismatch_probe.training import rescore

from .conftest import TINY_CONTEXT

pytestmark = pytest.mark.engine

TEXTS = ["What is the capital of France?", "Solve for x: 3x + 5 = 20.", "def add(a, b):", "Hi"]
SPEC = SamplingSpec(max_tokens=16, logprobs_mode="raw")
TELESCOPE_ATOL = 1e-6  # the attribution spec's promise
FP32_LINK_MAX = 1e-3  # the spec's fp32 identity bound on |r|
FP16_VS_FP32_BITS = 23 - 10


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer: Any) -> list[Any]:
    raw = [Prompt(i, text=t) for i, t in enumerate(TEXTS)]
    return encode_prompts(raw, tiny_tokenizer, chat=True, max_context=TINY_CONTEXT, max_tokens=64)


class Run(SimpleNamespace):
    """What a fixture hands to the tests: the run, its rescored settings, store and result."""


def config(rollout_dtype: str, train: tuple[str, ...], stale: Path | None = None) -> ScanConfig:
    return ScanConfig(
        sampling=SPEC,
        rollout_dtypes=(rollout_dtype,),
        train_dtypes=train,
        attribute=True,
        stale_model=stale,
    )


def rescored(model_dir: Path, rollouts: list[Any], dtype: str) -> SimpleNamespace:
    requests = [rescore.ScoreRequest(r.prompt_ids, r.response_ids) for r in rollouts]
    model = rescore.load_model(model_dir, dtype)
    scored = rescore.rescore(model, requests, SPEC, 0.0, batch_tokens=512)
    return SimpleNamespace(rollouts=rollouts, scored=scored, seq_offset=0, rungs=None)


def build(model_dir: Path, run: Any, train: tuple[str, ...], stale: Path | None = None) -> dict:
    """Rescore at each training dtype and add every rung (the scan's code path)."""
    scored = {Setting(run.setting, t): rescored(model_dir, run.rollouts, t) for t in train}
    for i, r in enumerate(scored.values()):
        r.seq_offset = i * len(run.rollouts)
    prep = SimpleNamespace(model_dir=model_dir, attribution_devices={})
    attribution.add_train_rungs(config(run.setting.dtype, train, stale), prep, [run], scored)
    return scored


def sampled(engines: Any, prompts: list[Any], dtype: str) -> SimpleNamespace:
    llm = engines.get(dtype, "raw")
    rollouts = rollout.generate(llm, prompts, SPEC, 1)
    rungs = attribution.engine_rungs(llm, rollouts)
    return SimpleNamespace(setting=RolloutSetting(dtype), rollouts=rollouts, rungs=rungs)


def stored(scored: dict, tokenizer: Any, out: Path) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    paths = scan.write_store(out, scored, tokenizer, {})
    return Run(path=paths["tokens"], result=compute_attribution(paths["tokens"]))


@pytest.fixture(scope="module")
def fp32(
    engines: Any, prompts: list[Any], tiny_model: Path, tiny_tokenizer: Any, tmp_path_factory: Any
) -> Run:
    run = sampled(engines, prompts, "float32")
    out = stored(build(tiny_model, run, ("float32",)), tiny_tokenizer, tmp_path_factory.mktemp("a"))
    out.run = run
    return out


@pytest.fixture(scope="module")
def bf16(
    engines: Any, prompts: list[Any], tiny_model: Path, tiny_tokenizer: Any, tmp_path_factory: Any
) -> Run:
    run = sampled(engines, prompts, "bfloat16")
    scored = build(tiny_model, run, ("bfloat16", "float32"))
    return stored(scored, tiny_tokenizer, tmp_path_factory.mktemp("b"))


@pytest.fixture(scope="module")
def fp16(
    engines: Any, prompts: list[Any], tiny_model: Path, tiny_tokenizer: Any, tmp_path_factory: Any
) -> Run:
    run = sampled(engines, prompts, "float16")
    scored = build(tiny_model, run, ("float32",))
    return stored(scored, tiny_tokenizer, tmp_path_factory.mktemp("c"))


def name(rollout_dtype: str, train: str) -> str:
    return Setting(RolloutSetting(rollout_dtype), train).name


def check_telescoping(path: Path) -> None:
    table = pq.read_table(path)
    for column in ("engine_prefill_logprob", "engine_prefill_single_logprob"):
        assert table.column(column).null_count == 0
        assert table.schema.field(column).type == "float"  # float32
    ratios = link_ratios(table)
    assert all(ratios[k][1].all() for k in MISMATCH_LINKS if k in ratios)
    total = sum(ratios[k][0] for k in MISMATCH_LINKS if k in ratios)
    train = table.column("train_logprob").to_numpy().astype(np.float64)
    roll = table.column("rollout_logprob").to_numpy().astype(np.float64)
    assert len(train) > 2 * len(TEXTS)  # several tokens per response
    np.testing.assert_allclose(total, train - roll, rtol=0, atol=TELESCOPE_ATOL)


def test_fp32_every_link_small_and_batch_bitwise(fp32: Run) -> None:
    check_telescoping(fp32.path)
    links = fp32.result[name("float32", "float32")]["links"]
    assert set(links) == {"decode_vs_prefill", "batch", "kernels", "precision"}
    assert all(stats["max_abs"] < FP32_LINK_MAX for stats in links.values())
    # This CPU backend's prefill is bit-identical batched or alone (not so for its decode, and
    # a GPU backend without batch-invariant kernels may differ here).
    assert links["batch"]["bitwise_identical_fraction"] == pytest.approx(1.0, rel=1e-7)
    table = pq.read_table(fp32.path)
    assert table.column("engine_prefill_logprob").equals(
        table.column("engine_prefill_single_logprob")
    )


def test_same_dtype_makes_the_precision_link_exactly_zero(bf16: Run) -> None:
    check_telescoping(bf16.path)
    same = bf16.result[name("bfloat16", "bfloat16")]["links"]
    assert same["precision"]["max_abs"] == 0.0
    assert same["precision"]["share"] == 0.0
    table = pq.read_table(bf16.path, filters=[("setting", "=", name("bfloat16", "bfloat16"))])
    ratios = link_ratios(table)
    others = sum(ratios[k][0] for k in ("decode_vs_prefill", "batch", "kernels"))
    train = table.column("train_logprob").to_numpy().astype(np.float64)
    roll = table.column("rollout_logprob").to_numpy().astype(np.float64)
    np.testing.assert_allclose(others, train - roll, rtol=0, atol=TELESCOPE_ATOL)
    # at fp32 training the precision link carries real rounding
    assert bf16.result[name("bfloat16", "float32")]["links"]["precision"]["max_abs"] > 0.0


def test_precision_link_follows_mantissa_bits(fp32: Run, bf16: Run, fp16: Run) -> None:
    check_telescoping(fp16.path)
    k3 = {
        "fp16": fp16.result[name("float16", "float32")]["links"]["precision"]["k3"],
        "bf16": bf16.result[name("bfloat16", "float32")]["links"]["precision"]["k3"],
    }
    identity = sum(s["k3"] for s in fp32.result[name("float32", "float32")]["links"].values())
    assert k3["fp16"] < k3["bf16"]
    assert min(k3.values()) > 2**FP16_VS_FP32_BITS * identity
    assert min(k3.values()) > 0.0


def mixed_checkpoint(base: Path, other: Path, alpha: float, out: Path) -> Path:
    """``base + alpha * (other - base)`` weights (the tiny builder's seed 0 and seed 1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = AutoModelForCausalLM.from_pretrained(base)
    b = AutoModelForCausalLM.from_pretrained(other).state_dict()
    a.load_state_dict({k: v + alpha * (b[k] - v) for k, v in a.state_dict().items()})
    a.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def test_staleness_grows_with_the_weight_change(
    fp32: Run, tiny_model: Path, tiny_tokenizer: Any, tmp_path: Path
) -> None:
    from mismatch_probe.models.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "seed1", seed=1)
    stale_k3 = []
    for alpha in (0.0, 1e-3, 1e-2, 1e-1):
        mix = tmp_path / f"mix{alpha:g}"
        ckpt = tiny_model if alpha == 0.0 else mixed_checkpoint(tiny_model, other, alpha, mix)
        scored = build(tiny_model, fp32.run, ("float32",), stale=ckpt)
        result = stored(scored, tiny_tokenizer, tmp_path / f"store{alpha:g}").result
        links = result[name("float32", "float32")]["links"]
        assert list(links)[-1] == "staleness"
        stale_k3.append(links["staleness"]["k3"])
        if alpha == 0.0:  # the same checkpoint: exactly zero, token by token
            assert links["staleness"]["max_abs"] == 0.0
    assert stale_k3[0] == 0.0
    assert all(a < b for a, b in itertools.pairwise(stale_k3))
