"""A sharded scan on a local Ray instance, a killed shard redone by ``--resume``, and the result
against the same scan in one process.

One module fixture runs, on the tiny model (three engine starts in all):

1. the plain scan in this process (its multiprocess engine must be gone before the training
   model loads);
2. ``--ray local --shards 2`` on ``ray.init(num_cpus=2)``: each shard asks for the node's two
   CPUs, so the shards run one at a time; once one shard has finished, the worker running the
   other is killed (SIGKILL, by the pid in its ``_RUNNING`` marker): the scan fails with one
   message and the finished shard stays;
3. the same scan with ``--resume``: the finished shard is skipped, the killed one redone.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics import compute_metrics
from mismatch_probe.metrics.stream import STRUCTURED_KEYS
from mismatch_probe.pipeline import sharding
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.scan import ScanResult, run_scan
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.store import dataset
from mismatch_probe.training import rescore
from tests.test_dataset import assert_same_metrics

pytestmark = pytest.mark.engine
ray = pytest.importorskip("ray")  # the ray extra is in the dev set: `make test` has it

QUIET = Console(quiet=True)


@dataclass
class Scans:
    plain: ScanResult
    failure: str  # the message of the scan whose shard was killed
    killed: int  # the shard whose worker was killed
    before: dict[int, Any]  # the finished shards' markers after the failure
    resumed: ScanResult
    engine_children: list[str]  # engine processes alive when the training model loaded


def kill_second_shard(tokens_dir: Path, found: dict[str, int], timeout: float = 600) -> None:
    """Once one shard is finished and another is running, SIGKILL the other's worker."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = dataset.done_shards(tokens_dir)
        for k, folder in dataset.shards(tokens_dir).items():
            running = folder / sharding.RUNNING
            if done and k not in done and running.is_file():
                pid = json.loads(running.read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                found.update(shard=k, pid=pid)
                return
        time.sleep(0.1)


def engine_children(ignore: frozenset[int] = frozenset()) -> list[str]:
    """Engine processes still running, except ``ignore`` (a zombie has exited and holds no
    memory: vLLM's shutdown leaves its engine-core process unreaped)."""
    import psutil

    return [
        f"{p.pid} {p.name()}"
        for p in psutil.Process().children(recursive=True)
        if "VLLM" in p.name() and p.status() != psutil.STATUS_ZOMBIE and p.pid not in ignore
    ]


@pytest.fixture(scope="module")
def scans(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: Any
) -> Scans:
    root = tmp_path_factory.mktemp("sharded")
    prompts = root / "p.jsonl"
    texts = ["hello", "The quick brown fox", "What is the capital", "Two plus two"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    base = ScanConfig(
        model=tiny_model,
        prompts=prompts,
        samples_per_prompt=2,
        sampling=SamplingSpec(max_tokens=8, top_p=0.95),
        rollout_dtypes=("float32",),
        vllm_args={"kv_cache_memory_bytes": 64 << 20},
    )
    alive: list[str] = []
    load = rescore.load_model
    # engines started before this scan (the session's EnginePool keeps one) are not its own
    earlier = frozenset(int(e.split()[0]) for e in engine_children())

    def checked_load(*args: Any, **kwargs: Any) -> Any:
        alive.extend(engine_children(earlier))
        return load(*args, **kwargs)

    monkeypatch_module.setattr(rescore, "load_model", checked_load)
    plain = run_scan(replace(base, out=root / "plain"), QUIET)
    monkeypatch_module.setattr(rescore, "load_model", load)

    cfg = replace(base, out=root / "ray", shards=2, ray="local")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        found: dict[str, int] = {}
        killer = threading.Thread(target=kill_second_shard, args=(root / "ray" / "tokens", found))
        killer.start()
        with pytest.raises(ProbeError) as failure:
            sharding.run_sharded(cfg, QUIET)
        killer.join()
        before = dataset.done_shards(root / "ray" / store.TOKENS_DIR)
        resumed = sharding.run_sharded(replace(cfg, resume=True), QUIET)
    finally:
        ray.shutdown()
    return Scans(plain, str(failure.value), found["shard"], before, resumed, alive)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_engine_is_gone_before_the_training_model_loads(scans: Scans) -> None:
    assert scans.engine_children == []


def test_killed_shard_fails_the_scan_and_resume_redoes_it(scans: Scans) -> None:
    k = scans.killed
    assert f"shard(s) failed: {k} (" in scans.failure
    assert "rerun the same command with --resume" in scans.failure
    assert sorted(scans.before) == [1 - k]  # the other shard had finished and was kept
    after = dataset.done_shards(scans.resumed.out_dir / store.TOKENS_DIR)
    assert sorted(after) == [0, 1]
    assert after[1 - k] == scans.before[1 - k]  # skipped: its marker (pid, timings) unchanged
    assert after[k]["prompts"] == [2 * k, 2 * k + 2]
    assert not list((scans.resumed.out_dir / store.TOKENS_DIR).rglob(sharding.RUNNING))


def sorted_tokens(path: Path) -> Any:
    table = pq.read_table(path, columns=[f.name for f in store.TOKEN_SCHEMA])
    return table.sort_by([("seq_id", "ascending"), ("position", "ascending")])


def test_sharded_scan_samples_the_same_tokens(scans: Scans) -> None:
    """Same (setting, seq_id, position, token) rows as the one-process scan. Log-probs: both
    sides float32; a shard batches 4 requests instead of 8, and the CPU backend's decode is not
    batch-invariant, so a logit may differ by the rounding of its dot products: at most about
    n * 2^-24 * sum|w_i h_i| with n = 256 (the widest layer) and sums of order 1-10 for this
    model, i.e. < 1.5e-4; a log-softmax difference is at most twice the largest logit's."""
    plain = sorted_tokens(scans.plain.out_dir / store.TOKENS_FILE)
    sharded = sorted_tokens(scans.resumed.out_dir / store.TOKENS_DIR)
    assert sharded.num_rows == plain.num_rows > 0
    for column in ("setting", "seq_id", "prompt_id", "sample_id", "position", "token_id"):
        assert sharded.column(column).equals(plain.column(column)), column
    for column in ("rollout_logprob", "train_logprob"):
        a, b = (t.column(column).to_numpy() for t in (plain, sharded))
        np.testing.assert_allclose(b, a, rtol=0, atol=3e-4)


def test_sharded_run_files(scans: Scans) -> None:
    out = scans.resumed.out_dir
    run = json.loads((out / store.RUN_FILE).read_text())
    assert run["shards"]["count"] == 2 and run["shards"]["ray"] == "local"
    assert sorted(r["shard"] for r in run["shards"]["records"]) == [0, 1]
    for placement in run["train_device_map"].values():
        assert placement["float32"]["used"] == "cpu"
    assert run["rollouts"][0]["tokens_per_s"] > 0
    plain_run = json.loads((scans.plain.out_dir / store.RUN_FILE).read_text())
    assert plain_run["train_device_map"]["float32"]["devices"] == ["cpu"]
    sequences = pq.read_table(out / store.SEQUENCES_DIR)
    assert sequences.num_rows == 8
    reports = [
        json.loads((r.out_dir / "metrics.json").read_text()) for r in (scans.plain, scans.resumed)
    ]
    drop = STRUCTURED_KEYS
    flat = [{k: v for k, v in m.items() if k not in drop} for m in reports]
    assert set(flat[0]) == set(flat[1])
    # the same tokens; log-probs within the bound above, so compare the counts exactly
    assert flat[1]["num_tokens"] == flat[0]["num_tokens"]
    assert (out / "report.md").is_file()
    assert compute_metrics(out).flat()["num_tokens"] == flat[0]["num_tokens"]
    if reports[0]["curves"]["worst_tokens"] == reports[1]["curves"]["worst_tokens"]:
        assert_same_metrics(flat[0], flat[1])  # bit-identical log-probs: same numbers


@pytest.fixture(scope="module")
def moe_scans(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny MoE model scanned in one process and in 2 shards run here one after the other
    (no Ray: the shard code is the same; Ray is covered above), both replay modes."""
    from mismatch_probe.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("moe_sharded")
    model = build_tiny_model(root / "qwen3_moe", arch="qwen3_moe")
    prompts = root / "p.jsonl"
    texts = ["What is the capital of France?", "Solve 3x + 5 = 20.", "def add(a, b):"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    base = ScanConfig(
        model=model,
        prompts=prompts,
        samples_per_prompt=2,
        sampling=SamplingSpec(max_tokens=12),
        rollout_dtypes=("float32",),
        routing_replay=("none", "rollout"),
        vllm_args={"kv_cache_memory_bytes": 64 << 20},
    )
    run_scan(replace(base, out=root / "plain"), QUIET)
    sharding.run_sharded(replace(base, out=root / "sharded", shards=2), QUIET)
    return root / "plain", root / "sharded"


def sorted_routes(path: Path) -> Any:
    table = pq.read_table(path, columns=["setting", "seq_id", "position", "rollout_experts"])
    return table.sort_by(
        [("setting", "ascending"), ("seq_id", "ascending"), ("position", "ascending")]
    )


def test_sharded_moe_scan_stores_the_same_routes(moe_scans: tuple[Path, Path]) -> None:
    plain, sharded = moe_scans
    assert dataset.part_files(sharded / "routing") == [
        sharded / "routing" / f"shard={k}" / dataset.PART for k in range(2)
    ]
    a, b = sorted_tokens(plain / store.TOKENS_FILE), sorted_tokens(sharded / store.TOKENS_DIR)
    for column in ("setting", "seq_id", "position", "token_id"):
        assert b.column(column).equals(a.column(column)), column
    routes = [sorted_routes(plain / "routing.parquet"), sorted_routes(sharded / "routing")]
    assert routes[0].num_rows > 0 and routes[1].equals(routes[0])
    run = json.loads((sharded / store.RUN_FILE).read_text())
    assert run["routing"]["top_k"] == 2
    data = [json.loads((p / "routing.json").read_text()) for p in moe_scans]
    assert data[1].keys() == data[0].keys()
    for key in data[0]:
        got, want = data[1][key]["metrics"], data[0][key]["metrics"]
        assert got["layer_disagreement"] == pytest.approx(want["layer_disagreement"], abs=1e-12)
    assert "## MoE routing" in (sharded / "report.md").read_text()
