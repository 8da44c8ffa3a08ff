"""``probe scan`` on a tiny MoE model: routes stored, measured, replayed (R3), reported."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.scan import run_scan
from mismatch_probe.sampling import SamplingSpec

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mismatch_probe.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe")
    prompts = tmp_path_factory.mktemp("p") / "p.jsonl"
    texts = ["What is the capital of France?", "Solve 3x + 5 = 20.", "def add(a, b):", "Hi"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path_factory.mktemp("run")
    cfg = ScanConfig(
        model=model,
        prompts=prompts,
        out=out,
        samples_per_prompt=4,
        sampling=SamplingSpec(max_tokens=40, logprobs_mode="raw"),  # = processed at T=1
        routing_replay=("none", "rollout"),
        attribute=True,
        vllm_args={"kv_cache_memory_bytes": 64 << 20},
    )
    run_scan(cfg, Console(file=io.StringIO()))
    return out


def test_routing_is_stored_keyed_like_the_tokens(moe_run: Path) -> None:
    routes = pq.read_table(moe_run / "routing.parquet")
    tokens = pq.read_table(moe_run / "tokens.parquet")
    run = json.loads((moe_run / "run.json").read_text())
    assert run["routing"]["capture_path"] == "prefill_replay"
    assert run["routing"]["top_k"] == 2
    response_rows = int((routes.column("position").to_numpy() >= 0).sum())
    assert response_rows == tokens.num_rows  # one route row per response token, every setting


def test_r3_removes_mismatch_and_the_report_shows_it(moe_run: Path) -> None:
    data = json.loads((moe_run / "routing.json").read_text())
    (entry,) = data.values()
    assert max(entry["metrics"]["layer_disagreement"]) > 0  # bf16 flips near-tie routers
    modes = entry["replay"]["modes"]
    assert modes["rollout"]["k3_kl"] < modes["none"]["k3_kl"]
    report = (moe_run / "report.md").read_text()
    assert "## MoE routing" in report and "replay=rollout" in report
    assert (moe_run / "plots" / "routing_disagreement.png").is_file()


def test_engine_args_are_the_ones_the_engine_started_with(moe_run: Path) -> None:
    """run.json records the capture's engine arguments and environment, not a recomputation."""
    (record,) = json.loads((moe_run / "run.json").read_text())["rollouts"]
    assert record["engine_args"]["enable_prefix_caching"] is False
    assert record["engine_args"]["kv_cache_memory_bytes"] == 64 << 20
    assert record["engine_args"]["distributed_executor_backend"] == "uni"
    assert record["engine_env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_probe_report_redraws_the_routing_plots(moe_run: Path) -> None:
    from mismatch_probe.pipeline.publish import publish
    from mismatch_probe.rundir import load_report

    plots = moe_run / "plots"
    names = ("routing_disagreement.png", "routing_logratio_by_layers.png")
    for name in names:
        (plots / name).unlink()
    paths = publish(*load_report(moe_run))
    assert all((plots / name).is_file() for name in names)
    assert paths["plot_routing_disagreement"] == plots / names[0]


def test_attribution_adds_the_routing_link(moe_run: Path) -> None:
    """The replay setting's links telescope to its whole mismatch, one of them routing."""
    import numpy as np

    from mismatch_probe.metrics.attribution import MISMATCH_LINKS, link_ratios

    data = json.loads((moe_run / "attribution.json").read_text())
    none, replay = "rollout=bf16 | train=fp32", "rollout=bf16 | train=fp32,replay=rollout"
    assert "routing" not in data[none]["links"]
    assert data[replay]["links"]["routing"]["max_abs"] > 0  # replaying flipped routes moves r
    tokens = pq.read_table(moe_run / "tokens.parquet", filters=[("setting", "=", replay)])
    ratios = link_ratios(tokens)
    total = sum(ratios[k][0] for k in MISMATCH_LINKS)
    train = tokens.column("train_logprob").to_numpy().astype(np.float64)
    roll = tokens.column("rollout_logprob").to_numpy().astype(np.float64)
    np.testing.assert_allclose(total, train - roll, rtol=0, atol=1e-6)  # the spec's promise
