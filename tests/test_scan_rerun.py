"""A scan's report describes that scan: the finishing step hands the run metadata and the
setting order to the report in memory, so neither a ``run.json`` an earlier scan left in the
same ``--out`` nor the alphabetical order of the settings leaks into it.

Two real scans on the tiny model into one directory: A, a fresh precision matrix whose first
setting (fp32) sorts last alphabetically; then B with ``--force``, other settings, prompt count
and temperature.
"""

from __future__ import annotations

import html
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from mismatch_probe import store
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.scan import run_scan
from mismatch_probe.report.comment import run_comment
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.settings import RolloutSetting, Setting

pytestmark = pytest.mark.engine

FP32, BF16 = Setting(RolloutSetting("float32")).name, Setting(RolloutSetting("bfloat16")).name


def scan(model: Path, prompts: Path, out: Path, **kwargs: Any) -> Any:
    cfg = ScanConfig(
        model=model,
        prompts=prompts,
        out=out,
        vllm_args={"kv_cache_memory_bytes": 64 << 20},
        **kwargs,
    )
    return run_scan(cfg, Console(file=io.StringIO()))


def plain(text: str) -> str:
    """Markdown or HTML as the words a reader sees (tags dropped, ``\\|`` unescaped)."""
    return html.unescape(re.sub(r"<[^>]+>", "", text)).replace("\\|", "|").replace("\\_", "_")


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("rerun")
    prompts = folder / "p.jsonl"
    texts = ["What is the capital of France?", "def add(a, b):", "The quick brown fox"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = folder / "run"
    a = scan(
        tiny_model,
        prompts,
        out,
        num_prompts=2,
        sampling=SamplingSpec(max_tokens=8, temperature=0.7),
        rollout_dtypes=("float32", "bfloat16"),
    )
    a_report = (out / store.REPORT_FILE).read_text()
    b = scan(
        tiny_model,
        prompts,
        out,
        num_prompts=3,
        sampling=SamplingSpec(max_tokens=8, temperature=1.0),
        rollout_dtypes=("bfloat16",),
        force=True,
    )
    return {"a": a, "a_report": a_report, "b": b, "out": out}


def test_a_fresh_matrix_keeps_the_scans_first_setting_as_reference(runs: dict[str, Any]) -> None:
    a = runs["a"]
    assert sorted([FP32, BF16])[0] == BF16  # the scan's first setting sorts last
    assert a.report.setting == FP32 and a.report.label == FP32
    assert list(a.settings) == [FP32, BF16]
    assert "Mismatch report" in runs["a_report"]
    settings_row = next(
        line for line in plain(runs["a_report"]).splitlines() if "precisions" in line
    )
    assert FP32 in settings_row


def test_forced_rescan_reports_the_new_run_everywhere(runs: dict[str, Any]) -> None:
    b, out = runs["b"], runs["out"]
    comment = run_comment(b.report)
    outputs = {
        "report.md": (out / store.REPORT_FILE).read_text(),
        "report.html": (out / "report.html").read_text(),
        "pr comment": comment,
    }
    for name, text in outputs.items():
        words = plain(text)
        assert BF16 in words, name
        assert FP32 not in words, name  # scan A's reference setting
        assert "3 from" in words and "2 from" not in words, name
        assert "temperature=1.0" in words and "temperature=0.7" not in words, name
    run = json.loads((out / store.RUN_FILE).read_text())
    assert run["settings"] == [BF16] and run["prompts"]["count"] == 3
    assert b.report.run is b.run  # the report was handed the run, not a file
