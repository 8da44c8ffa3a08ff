"""``probe scan --attribute`` from the outside: refusals before any engine starts, and one real
scan whose attribution ``probe report`` reproduces from the store alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe import store
from mismatch_probe.metrics.attribution import compute_attribution
from tests.cli_runner import run_probe_err as run_main


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n{"prompt": "What is the capital of France?"}\n')
    return path


REFUSALS = {
    "processed mode": (["--attribute", "--logprobs-mode", "processed"], {}, "needs raw log-prob"),
    "stale without attribute": (["--stale-model", "."], {}, "--stale-model needs --attribute"),
    "missing stale model": (
        ["--attribute", "--stale-model", "/no/such/checkpoint"],
        {},
        "model path does not exist",
    ),
    "batch invariant arg": (
        ["--vllm-arg", "VLLM_BATCH_INVARIANT=1"],
        {},
        "not supported by the CPU backend",
    ),
    "batch invariant env": ([], {"VLLM_BATCH_INVARIANT": "1"}, "not supported by the CPU backend"),
    "batch invariant bad value": (
        ["--vllm-arg", "VLLM_BATCH_INVARIANT=yes"],
        {},
        "must be an integer",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_before_any_engine_with_one_line(
    case: str,
    tiny_model: Path,
    prompts_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    args, env, expected = REFUSALS[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    base = ["scan", "--model", str(tiny_model), "--prompts", str(prompts_file), "--out", str(out)]
    code, err = run_main([*base, *args], monkeypatch, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0]
    assert not out.exists()


@pytest.mark.engine
def test_scan_attribute_then_report_reproduces_it(
    tiny_model: Path,
    prompts_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: starts faster
    run = tmp_path / "run"
    args = ["scan", "--model", str(tiny_model), "--prompts", str(prompts_file), "--attribute"]
    args += ["--rollout-dtype", "float32", "--max-tokens", "12", "--out", str(run)]
    args += ["--stale-model", str(tiny_model), "--vllm-arg", f"kv_cache_memory_bytes={64 << 20}"]
    args += ["--train-device-map", "cpu"]
    code, err = run_main(args, monkeypatch, capsys)
    assert code == 0, err[-2000:]

    schema = pq.read_schema(run / store.TOKENS_FILE)
    for field in store.RUNG_FIELDS[:4]:  # no routing replay: no own-routes column
        assert schema.field(field.name).type == pa.float32() and schema.field(field.name).nullable
    assert "train_no_replay_logprob" not in schema.names
    meta = json.loads((run / store.RUN_FILE).read_text())
    assert meta["batch_invariant"] is False
    assert meta["sampling"]["logprobs_mode"] == "raw"  # --attribute's default
    assert meta["config"]["attribute"] is True
    # The stale model loads as the training model does: placed by --train-device-map, recorded.
    assert meta["train_device_map"]["float32"]["requested"] == "cpu"
    assert set(meta["attribution_device_map"]) == {"stale=float32"}  # L3: the training scores
    assert meta["attribution_device_map"]["stale=float32"]["requested"] == "cpu"
    assert meta["attribution_device_map"]["stale=float32"]["devices"] == ["cpu"]

    scanned = (run / "attribution.json").read_text()
    setting = meta["setting"]
    result = json.loads(scanned)[setting]
    assert list(result) == ["dominant", "links"]
    assert set(result["links"]) == {
        "decode_vs_prefill",
        "batch",
        "kernels",
        "precision",
        "staleness",
    }
    assert result["links"]["staleness"]["max_abs"] == 0.0  # the same checkpoint
    assert json.loads(scanned) == json.loads(json.dumps(compute_attribution(run)))
    assert "## Attribution" in (run / "report.md").read_text()
    assert (run / "plots" / "attribution.png").stat().st_size > 0

    for name in ("attribution.json", "report.md", "plots/attribution.png", "metrics.json"):
        (run / name).unlink()
    code, err = run_main(["report", str(run)], monkeypatch, capsys)
    assert code == 0, err
    assert (run / "attribution.json").read_text() == scanned
    assert (run / "plots" / "attribution.png").exists()

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    code, err = run_main(
        ["compare", str(run), str(copy), "--out", str(tmp_path / "cmp")], monkeypatch, capsys
    )
    assert code == 0, err
    compare_md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "## Attribution" in compare_md and "`precision`" in compare_md
