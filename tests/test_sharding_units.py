"""Sharded scans without an engine: the plan, Ray resources, and what is refused before any
engine starts (one line on stderr, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe import store
from mismatch_probe.pipeline import sharding
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.raycluster import shard_resources
from mismatch_probe.pipeline.scan import prepare
from mismatch_probe.sampling import SamplingSpec
from tests.cli_runner import run_probe_err as run_main


def test_plan_covers_every_prompt_once() -> None:
    assert sharding.plan_shards(4, 2) == [(0, 2), (2, 4)]
    assert sharding.plan_shards(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert sharding.plan_shards(5, 1) == [(0, 5)]
    for n, k in [(10, 3), (100, 7), (8, 8)]:
        plan = sharding.plan_shards(n, k)
        assert [i for a, b in plan for i in range(a, b)] == list(range(n))
        assert max(b - a for a, b in plan) - min(b - a for a, b in plan) <= 1


@pytest.mark.parametrize(
    ("vllm_args", "gpus", "cpus", "expected"),
    [
        ({}, 0, [2.0], {"num_cpus": 2.0}),  # the local test instance: one shard at a time
        ({}, 0, [64.0, 16.0], {"num_cpus": 16.0}),  # fits the smallest node
        ({}, 8, [128.0], {"num_gpus": 1.0, "num_cpus": 1.0}),
        ({"tensor_parallel_size": 8}, 8, [128.0], {"num_gpus": 8.0, "num_cpus": 1.0}),
        (
            {"tensor_parallel_size": 4, "pipeline_parallel_size": 2},
            16,
            [128.0, 128.0],
            {"num_gpus": 8.0, "num_cpus": 1.0},
        ),
    ],
)
def test_shard_resources(
    vllm_args: dict[str, Any], gpus: float, cpus: list[float], expected: dict[str, float]
) -> None:
    assert shard_resources(vllm_args, gpus, cpus) == expected


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"fox {i}"}) + "\n" for i in range(4)))
    return path


CASES = {
    "resume without out": (["--shards", "2", "--resume"], "--resume needs the --out"),
    "resume unsharded": (["--resume", "--out", "{out}"], "--resume applies to a sharded scan"),
    "zero shards": (["--shards", "0"], "--shards must be >= 1, got 0"),
    "more shards than prompts": (["--shards", "5"], "--shards 5: more shards than prompts (4)"),
    "unknown device map": (["--train-device-map", "gpu"], "--train-device-map: unknown value"),
    "nothing to resume": (
        ["--shards", "2", "--resume", "--out", "{out}"],
        "holds no sharded run to resume",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_any_engine(
    case: str,
    tiny_model: Path,
    prompts: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    args, expected = CASES[case]
    out = tmp_path / "out"
    args = [a.replace("{out}", str(out)) for a in args]
    base = ["scan", "--model", str(tiny_model), "--prompts", str(prompts)]
    code, err = run_main([*base, *args], monkeypatch, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert not (out / store.TOKENS_DIR).exists()


def test_resume_refuses_other_options(
    tiny_model: Path, prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The recorded run (shards.json, written before the first shard) against the new options."""
    out = tmp_path / "run"
    cfg = ScanConfig(
        model=tiny_model, prompts=prompts, shards=2, out=out, sampling=SamplingSpec(max_tokens=8)
    )
    prep = prepare(cfg)
    out.mkdir()
    assert sharding.start_or_resume(out, cfg, prep, sharding.plan_shards(4, 2)) == set()
    recorded = (out / sharding.PLAN_FILE).read_text()
    base = ["scan", "--model", str(tiny_model), "--prompts", str(prompts), "--out", str(out)]
    base += ["--shards", "2", "--resume"]

    code, err = run_main([*base, "--max-tokens", "16", "--top-p", "0.9"], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: --resume: options differ from the run in {out}: sampling.max_tokens was 8, "
        "now 16; sampling.top_p was 1.0, now 0.9"
    ]
    code, err = run_main([*base, "--max-tokens", "8", "--shards", "3"], monkeypatch, capsys)
    assert code == 2 and "shards was 2, now 3" in err
    prompts.write_text(prompts.read_text().replace("fox 3", "dog 3"))
    code, err = run_main([*base, "--max-tokens", "8"], monkeypatch, capsys)
    assert code == 2 and "prompts (their content changed)" in err
    assert (out / sharding.PLAN_FILE).read_text() == recorded  # the record stays as it was
