"""``probe scan`` of multi-turn prompts on the real engine and the tiny model: the store's turn
columns, ``metrics.json`` ``per_turn``, ``plots/turns.png``, the report section and the PR
comment table, with a precision matrix, several samples per prompt, ``--same-tokens`` and
``--attribute``, and a sharded scan."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from mismatch_probe import store
from mismatch_probe.engine import rollout
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.scan import run_scan
from mismatch_probe.pipeline.sharding import run_sharded
from mismatch_probe.report.comment import run_comment
from mismatch_probe.rundir import load_report
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.settings import RolloutSetting, Setting

from .test_multiturn import CONVERSATIONS, MAX_TOKENS

pytestmark = pytest.mark.engine

PER_TURN_FIELDS = {
    "turn",
    "sequences",
    "tokens",
    "k3_kl",
    "kl",
    "abs_log_ratio_mean",
    "token_mult_prob_error",
    "first_token_abs_log_ratio_mean",
    "context_tokens_mean",
}
FP32, BF16 = (Setting(RolloutSetting(d)).name for d in ("float32", "bfloat16"))


def scan_config(tiny_model: Path, prompts: Path, out: Path, **kwargs: Any) -> ScanConfig:
    defaults: dict[str, Any] = {
        "samples_per_prompt": 2,
        "sampling": SamplingSpec(max_tokens=MAX_TOKENS),
        "vllm_args": {"kv_cache_memory_bytes": 64 << 20},
    }
    return ScanConfig(model=tiny_model, prompts=prompts, out=out, **{**defaults, **kwargs})


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "agentic.jsonl"
    path.write_text("".join(json.dumps({"messages": list(c)}) + "\n" for c in CONVERSATIONS))
    return path


@pytest.fixture(scope="module")
def matrix(tiny_model: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("matrix")
    cfg = scan_config(tiny_model, prompts, out, rollout_dtypes=("float32", "bfloat16"))
    return run_scan(cfg, Console(file=io.StringIO()))


def per_turn(out: Path, setting: str) -> list[dict[str, Any]]:
    from mismatch_probe.metrics import compute_metrics

    return list(compute_metrics(out / store.TOKENS_FILE, setting=setting).per_turn)


def test_store_holds_turns(matrix: Any) -> None:
    tokens = pq.read_table(matrix.out_dir / store.TOKENS_FILE)
    sequences = pq.read_table(matrix.out_dir / store.SEQUENCES_FILE)
    assert tokens.schema.field("turn").type == "int32"
    fp32 = sequences.filter(pc.equal(sequences.column("setting"), FP32))
    # two samples of each prompt: 3, 2 and 1 generated turns
    assert fp32.column("num_turns").to_pylist() == [3, 3, 2, 2, 1, 1]
    reasons = [r.split(",") for r in fp32.column("turn_finish_reasons").to_pylist()]
    assert [len(r) for r in reasons] == [3, 3, 2, 2, 1, 1]
    assert {x for r in reasons for x in r} <= {"stop", "length"}
    drift = fp32.column("rerender_differs").to_pylist()
    assert drift[4:] == [None, None] and None not in drift[:4]  # multi-turn trajectories only
    for seq_id in fp32.column("seq_id").to_pylist():
        rows = tokens.filter(pc.equal(tokens.column("seq_id"), seq_id))
        turn = rows.column("turn").to_pylist()
        assert turn == sorted(turn)
        position = rows.column("position").to_pylist()
        assert position == sorted(set(position))  # gaps at the given context, never repeats


def test_run_json_says_why_later_turns_were_not_cached(matrix: Any) -> None:
    run = json.loads((matrix.out_dir / store.RUN_FILE).read_text())
    for entry in run["rollouts"]:
        cache = entry["prefix_cache"]
        parts = ("cached_tokens", "uncached_new_context_tokens",
                 "uncached_partial_block_tokens", "uncached_other_tokens")  # fmt: skip
        assert sum(cache[k] for k in parts) == cache["prompt_tokens"] > 0
        assert cache["later_turn_requests"] == 2 * (2 + 1) and cache["block_size"] > 0
        # the CPU backend's smaller block for a multi-turn scan: the engine ran with it, and
        # each later turn recomputes less than one block of the turn before it
        block = rollout.CPU_PREFIX_REUSE_DEFAULTS["block_size"]
        assert cache["block_size"] == entry["engine_args"]["block_size"] == block
        assert cache["uncached_partial_block_tokens"] < block * cache["later_turn_requests"]


def test_metrics_json_per_turn(matrix: Any) -> None:
    data = json.loads((matrix.out_dir / store.METRICS_FILE).read_text())
    rows = data["per_turn"]
    assert [r["turn"] for r in rows] == [0, 1, 2]
    assert all(set(r) == PER_TURN_FIELDS for r in rows)
    assert [r["sequences"] for r in rows] == [6, 4, 2]
    assert sum(r["tokens"] for r in rows) == data["num_tokens"]
    context = [r["context_tokens_mean"] for r in rows]
    assert context == sorted(context) and context[1] > context[0] + 1
    assert 0.0 <= data["rerender_trajectory_fraction"] <= 1.0
    assert 0.0 <= data["rerender_token_fraction"] <= 1.0


def test_fp32_identity_and_bf16_mismatch_per_turn(matrix: Any) -> None:
    for row in per_turn(matrix.out_dir, FP32):
        assert row["k3_kl"] < 1e-6, row
        assert row["first_token_abs_log_ratio_mean"] < 1e-3, row
    for row in per_turn(matrix.out_dir, BF16):
        assert row["abs_log_ratio_mean"] > 1e-3, row


def test_report_plot_and_comment(matrix: Any) -> None:
    out = matrix.out_dir
    assert (out / "plots" / "turns.png").stat().st_size > 1000
    report = (out / "report.md").read_text()
    section = report.split("## Per turn")[1]
    assert "| turn | sequences | tokens |" in section
    assert "rerender_trajectory_fraction" in section
    assert "![k3 and first-token |r| per turn](plots/turns.png)" in section
    ctx, _ = load_report(out)
    comment = run_comment(ctx)
    assert "#### Per turn" in comment
    assert comment.count("\n| 2 | 2 |") == 1  # turn 2: the two samples of the 3-turn prompt
    prefix = [r["prefix_cache"] for r in matrix.run["rollouts"]]
    assert all(p["later_turn_requests"] == 6 and p["cached_tokens"] > 0 for p in prefix)


def test_same_tokens_and_attribute(tiny_model: Path, prompts: Path, tmp_path: Path) -> None:
    cfg = scan_config(
        tiny_model,
        prompts,
        tmp_path,
        rollout_dtypes=("float32", "bfloat16"),
        same_tokens=True,
        attribute=True,
        sampling=SamplingSpec(max_tokens=MAX_TOKENS, logprobs_mode="raw"),
    )
    result = run_scan(cfg, Console(file=io.StringIO()))
    tokens = pq.read_table(tmp_path / store.TOKENS_FILE)
    ids = {
        s: tokens.filter(pc.equal(tokens.column("setting"), s)).column("token_id").to_pylist()
        for s in result.settings
    }
    assert ids[FP32] == ids[BF16]
    fp32 = per_turn(tmp_path, FP32)
    assert [r["turn"] for r in fp32] == [0, 1, 2]
    assert all(r["k3_kl"] < 1e-8 for r in fp32)  # prefill fp32 vs transformers fp32, raw
    assert all(r["abs_log_ratio_mean"] > 1e-3 for r in per_turn(tmp_path, BF16))
    attribution = json.loads((tmp_path / "attribution.json").read_text())
    assert set(attribution) == set(result.settings)


def test_sharded_scan_matches_turns(tiny_model: Path, prompts: Path, tmp_path: Path) -> None:
    cfg = scan_config(tiny_model, prompts, tmp_path, rollout_dtypes=("float32",), shards=2)
    result = run_sharded(cfg, Console(file=io.StringIO()))
    data = json.loads((result.out_dir / store.METRICS_FILE).read_text())
    assert [r["turn"] for r in data["per_turn"]] == [0, 1, 2]
    assert all(r["k3_kl"] < 1e-6 for r in data["per_turn"])
    assert all(r["context_tokens_mean"] is not None for r in data["per_turn"])


def test_moe_routing_replay_on_trajectories(
    prompts: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Routes are captured over the whole trajectory (prefill replay) and the store's positions
    pick the generated tokens' rows: R3 removes mismatch on multi-turn rollouts too."""
    from mismatch_probe.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe")
    out = tmp_path_factory.mktemp("moe_run")
    cfg = scan_config(
        model,
        prompts,
        out,
        samples_per_prompt=1,
        routing_replay=("none", "rollout"),
        sampling=SamplingSpec(max_tokens=MAX_TOKENS, logprobs_mode="raw"),  # = processed at T=1
    )
    run_scan(cfg, Console(file=io.StringIO()))
    tokens = pq.read_table(out / store.TOKENS_FILE)
    routes = pq.read_table(out / "routing.parquet")
    assert set(tokens.column("turn").to_pylist()) == {0, 1, 2}
    # one route row per trajectory position after the first prompt, generated or given
    seqs = pq.read_table(out / store.SEQUENCES_FILE)
    assert int((routes.column("position").to_numpy() >= 0).sum()) > tokens.num_rows
    assert seqs.column("num_turns").to_pylist()[:3] == [3, 2, 1]
    (entry,) = json.loads((out / "routing.json").read_text()).values()
    modes = entry["replay"]["modes"]
    assert modes["rollout"]["k3_kl"] < modes["none"]["k3_kl"]
    data = json.loads((out / store.METRICS_FILE).read_text())
    assert [r["turn"] for r in data["per_turn"]] == [0, 1, 2]
