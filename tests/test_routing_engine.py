"""Routing on the real vLLM engine (prefill-replay capture, in process) and transformers.

On a tiny Qwen3-MoE (2 layers, 8 experts, top-2): a bfloat16 rollout rescored in float32 routes
some tokens differently (random routers sit near ties) and forcing the engine's routes (R3)
lowers the mismatch; float32 on both sides routes identically and replay changes nothing; the
batched, chunked capture puts every row where a one-sequence-at-a-time capture does. Each engine
configuration starts once per module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest

from mismatch_probe import store
from mismatch_probe.engine import rollout
from mismatch_probe.engine.routing import (
    StepRecorder,
    capture_routes,
    engine_setup,
)
from mismatch_probe.routing import RoutingShape, routing_shape
from mismatch_probe.routing.metrics import analyze_run, differing, routing_metrics
from mismatch_probe.routing.replay import REPLAY_MODES, forced_routes
from mismatch_probe.routing.store import routing_table, write_routing
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training import rescore
from mismatch_probe.training.routing import TrainRouting
from tests.conftest import encoded_prompts
from tests.tolerances import ulp_bound

pytestmark = pytest.mark.engine

SPEC = SamplingSpec(max_tokens=40)
SAMPLES = 3
SINGLE = 6  # sequences also captured one at a time
# Small scheduler budgets: replayed sequences (~50 tokens) are chunked and share steps. Sampling
# itself must not chunk a prompt: vLLM's CPU runner cannot rewind a seeded request's generator
# ("CPU Generator does not use offset"), so 4 prompts of <= 24 tokens fit one step.
CHUNKED = {"max_num_batched_tokens": 96, "max_num_seqs": 4}


@dataclass
class EngineRun:
    shape: RoutingShape
    rollouts: list[rollout.Rollout]
    routes: list[np.ndarray]  # batched capture, [P + R - 1, L, K] each
    single: list[np.ndarray]  # the first SINGLE sequences, captured one at a time
    capture_path: str
    steps: list[tuple[list[str], np.ndarray]]  # batched capture: (request ids, first positions)


def run_engine(model: Path, dtype: str, extra: dict[str, Any]) -> EngineRun:
    from transformers import AutoConfig, AutoTokenizer

    shape = routing_shape(AutoConfig.from_pretrained(model))
    assert shape is not None
    prompts = encoded_prompts(AutoTokenizer.from_pretrained(model))
    setup = engine_setup()
    kwargs = {
        "model": str(model),
        "dtype": dtype,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",
        "seed": 0,
        "max_model_len": 512,
        "kv_cache_memory_bytes": 128 << 20,
        "disable_log_stats": True,
        **setup.kwargs,
        **extra,
    }
    with rollout.engine(kwargs, rollout.engine_env(setup.env)) as llm:
        rolls = rollout.generate(llm, prompts, SPEC, SAMPLES)
        with spy_steps() as steps:
            routes = capture_routes(llm, rolls, shape, setup.capture_path)
        single = [capture_routes(llm, [r], shape, setup.capture_path)[0] for r in rolls[:SINGLE]]
    return EngineRun(shape, rolls, routes, single, setup.capture_path, steps)


@contextmanager
def spy_steps() -> Iterator[list[tuple[list[str], np.ndarray]]]:
    """Per step of the capture (first MoE layer): its request ids and each one's first position."""
    steps: list[tuple[list[str], np.ndarray]] = []
    assemble = StepRecorder.assemble

    def spy(self: StepRecorder, columns: dict[str, int]) -> dict[str, np.ndarray]:
        steps.extend(
            (ids, pos[start[:-1]]) for layer, ids, start, pos, _ in self.steps if layer == 0
        )
        return assemble(self, columns)

    with mock.patch.object(StepRecorder, "assemble", spy):
        yield steps


@dataclass
class Rescored:
    logprobs: dict[str, np.ndarray]  # replay mode -> [N] train log-probs of all response tokens
    train_routes: list[np.ndarray]  # the training router's own routes (mode "none")
    log_ratio: dict[str, np.ndarray]  # replay mode -> [N] r = train - rollout


def rescore_modes(model: Any, run: EngineRun) -> Rescored:
    requests = [rescore.ScoreRequest(r.prompt_ids, r.response_ids) for r in run.rollouts]
    engine = np.concatenate([r.rollout_logprobs for r in run.rollouts]).astype(np.float64)
    logprobs, recorded = {}, {}
    for mode in REPLAY_MODES:
        routing = TrainRouting(model, requests, run.shape, forced_routes(mode, run.routes))
        scored = rescore.rescore(model, requests, SPEC, 1e-4, 512, batch_context=routing.batch)
        logprobs[mode] = np.concatenate([s.logprobs for s in scored]).astype(np.float64)
        recorded[mode] = routing.recorded
    ratios = {m: lp - engine for m, lp in logprobs.items()}
    return Rescored(logprobs, recorded["none"], ratios)


def response_rows(routes: list[np.ndarray], run: EngineRun) -> np.ndarray:
    """``[N, L, K]``: the columns that predict response tokens (``P - 1 .. P + R - 2``)."""
    return np.concatenate(
        [r[len(s.prompt_ids) - 1 :] for r, s in zip(routes, run.rollouts, strict=True)]
    )


def k3(r: np.ndarray) -> float:
    return float(np.mean(np.expm1(r) - r))


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mismatch_probe.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("routing") / "qwen3_moe", arch="qwen3_moe")


@pytest.fixture(scope="module", autouse=True)
def no_dense_engine(engines: Any) -> None:
    """The session pool's in-process engine (dense tiny model) closed first: alive, it keeps
    vLLM's process-wide parallel groups, made without the expert-parallel group a MoE needs."""
    engines.close()


@pytest.fixture(scope="module")
def fp32_trainer(qwen_moe: Path) -> Any:
    return rescore.load_model(qwen_moe, "float32")


@pytest.fixture(scope="module")
def bf16_run(qwen_moe: Path) -> EngineRun:
    return run_engine(qwen_moe, "bfloat16", CHUNKED)


@pytest.fixture(scope="module")
def fp32_run(qwen_moe: Path) -> EngineRun:
    return run_engine(qwen_moe, "float32", {})


@pytest.fixture(scope="module")
def bf16_scored(bf16_run: EngineRun, fp32_trainer: Any) -> Rescored:
    return rescore_modes(fp32_trainer, bf16_run)


@pytest.fixture(scope="module")
def fp32_scored(fp32_run: EngineRun, fp32_trainer: Any) -> Rescored:
    return rescore_modes(fp32_trainer, fp32_run)


def test_routes_cover_every_fed_position(bf16_run: EngineRun) -> None:
    assert bf16_run.capture_path == "prefill_replay"
    for routes, r in zip(bf16_run.routes, bf16_run.rollouts, strict=True):
        assert routes.shape == (len(r.prompt_ids) + len(r.response_ids) - 1, 2, 2)
        assert routes.min() >= 0 and routes.max() < 8
        assert (routes[..., 0] < routes[..., 1]).all()  # two distinct experts, ascending


def test_batched_capture_matches_one_at_a_time(bf16_run: EngineRun) -> None:
    """All 18 sequences replayed together, in 96-token chunked steps, vs each alone."""
    total = sum(len(r) for r in bf16_run.routes)
    assert total > 5 * CHUNKED["max_num_batched_tokens"]  # many steps
    assert max(len(r) for r in bf16_run.routes) > CHUNKED["max_num_batched_tokens"] / 2
    assert sum(len(ids) > 1 for ids, _ in bf16_run.steps) > 5  # steps shared by sequences
    assert sum(len(ids) == 1 for ids, _ in bf16_run.steps) < len(bf16_run.steps)
    assert any(first.max() > 0 for _, first in bf16_run.steps)  # a chunk continuing a prefill
    for batched, alone in zip(bf16_run.routes, bf16_run.single, strict=False):
        np.testing.assert_array_equal(batched, alone)
    # a capture that put rows at the wrong sequence or position would not pass the above:
    a, b = bf16_run.single[0], bf16_run.single[1]
    n = min(len(a), len(b))
    assert (a[:n] != b[:n]).any() and (a[1:] != a[:-1]).any()


def test_fp32_engine_routes_like_fp32_trainer(fp32_run: EngineRun, fp32_scored: Rescored) -> None:
    """Same precision both sides: the routes agree (an independent check of the column order,
    prompt columns included), and replaying them changes nothing."""
    rollout_all = np.concatenate(fp32_run.routes)
    train_all = np.concatenate(fp32_scored.train_routes)
    assert differing(rollout_all, train_all).mean() <= 0.005
    metrics = routing_metrics(
        response_rows(fp32_run.routes, fp32_run),
        response_rows(fp32_scored.train_routes, fp32_run),
        fp32_scored.log_ratio["none"],
        fp32_run.shape.moe_layers,
    )
    assert metrics.any_layer_differs <= 0.01
    lp = fp32_scored.logprobs
    moved = ulp_bound(lp["none"])  # replay reorders float32 sums: a few ulps
    assert np.abs(lp["rollout"] - lp["none"]).max() <= moved
    r = fp32_scored.log_ratio["none"]
    assert np.abs(r).max() < 1e-4
    # k3(r) ~ mean(r^2) / 2 moves by at most mean(|r| + moved) * moved when each r moves by moved
    assert k3(fp32_scored.log_ratio["rollout"]) == pytest.approx(
        k3(r), rel=0, abs=float(np.mean(np.abs(r) + moved)) * moved
    )


def test_bf16_routing_disagrees_and_r3_removes_mismatch(
    bf16_run: EngineRun, bf16_scored: Rescored
) -> None:
    metrics = routing_metrics(
        response_rows(bf16_run.routes, bf16_run),
        response_rows(bf16_scored.train_routes, bf16_run),
        bf16_scored.log_ratio["none"],
        bf16_run.shape.moe_layers,
    )
    assert metrics.tokens == len(bf16_scored.log_ratio["none"]) > 500
    assert max(metrics.layer_disagreement) > 0
    assert 0 < metrics.any_layer_differs < 0.5
    assert metrics.differ.mean_abs_log_ratio > metrics.agree.mean_abs_log_ratio
    r = bf16_scored.log_ratio
    assert k3(r["rollout"]) < k3(r["none"])
    assert np.abs(r["rollout"]).mean() < np.abs(r["none"]).mean()


def test_run_files_round_trip(bf16_run: EngineRun, bf16_scored: Rescored, tmp_path: Path) -> None:
    """routing.parquet + tokens.parquet of both replay modes -> the same metrics as the arrays."""
    names = {"none": "rollout=bf16 | train=fp32", "rollout": "rollout=bf16 | train=fp32,r3"}
    n = len(bf16_run.rollouts)
    routing, tokens = [], []
    for k, (mode, name) in enumerate(names.items()):
        seq_ids = [k * n + i for i in range(n)]
        plens = [len(r.prompt_ids) for r in bf16_run.rollouts]
        routing.append(
            routing_table(name, seq_ids, plens, bf16_run.routes, bf16_scored.train_routes)
        )
        tokens.append(token_table(name, seq_ids, bf16_run.rollouts, bf16_scored.logprobs[mode]))
    write_routing(
        tmp_path / "routing.parquet",
        pa.concat_tables(routing),
        bf16_run.shape,
        bf16_run.capture_path,
        {"tool": "mismatch_probe"},
    )
    store.write_table(tmp_path / "tokens.parquet", pa.concat_tables(tokens), store.TOKEN_SCHEMA, {})
    metrics, replay = analyze_run(tmp_path, tmp_path, names)
    direct = routing_metrics(
        response_rows(bf16_run.routes, bf16_run),
        response_rows(bf16_scored.train_routes, bf16_run),
        bf16_scored.log_ratio["none"],
        bf16_run.shape.moe_layers,
    )
    assert metrics.layer_disagreement == direct.layer_disagreement
    assert metrics.by_differing_layers[1].tokens == direct.by_differing_layers[1].tokens
    assert replay.modes["rollout"].k3_kl < replay.modes["none"].k3_kl
    assert replay.k3_removed["rollout"] > 0


def token_table(name: str, seq_ids: list[int], rolls: list[Any], train: np.ndarray) -> pa.Table:
    lengths = [len(r.response_ids) for r in rolls]
    n = sum(lengths)
    return pa.table(
        {
            "setting": [name] * n,
            "seq_id": pa.array(np.repeat(seq_ids, lengths), pa.int64()),
            "prompt_id": pa.array(np.repeat([r.prompt_id for r in rolls], lengths), pa.int64()),
            "sample_id": pa.array(np.repeat([r.sample_id for r in rolls], lengths), pa.int32()),
            "position": pa.array(np.concatenate([np.arange(k) for k in lengths]), pa.int32()),
            "token_id": pa.array([t for r in rolls for t in r.response_ids], pa.int32()),
            "token_text": [""] * n,
            "rollout_logprob": pa.array(
                [x for r in rolls for x in r.rollout_logprobs], pa.float32()
            ),
            "train_logprob": pa.array(train, pa.float32()),
            "support_flip": [False] * n,
        }
    )


def test_mixtral_capture_and_replay(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same capture and replay on a Mixtral-style model (vLLM's MixtralForCausalLM)."""
    from mismatch_probe.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("routing") / "mixtral", arch="mixtral")
    run = run_engine(path, "bfloat16", {})
    scored = rescore_modes(rescore.load_model(path, "float32"), run)
    diff = differing(response_rows(run.routes, run), response_rows(scored.train_routes, run))
    assert diff.any()
    for batched, alone in zip(run.routes, run.single, strict=False):
        np.testing.assert_array_equal(batched, alone)
    assert k3(scored.log_ratio["rollout"]) < k3(scored.log_ratio["none"])
