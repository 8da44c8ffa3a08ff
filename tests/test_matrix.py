"""Precision matrix: several settings in one scan, on the real engine and the tiny model."""

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
from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.scan import run_scan
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.settings import RolloutSetting, Setting
from tests.test_plots_visible import check_all, record_figures

pytestmark = pytest.mark.engine

SMALL = {
    "num_prompts": 4,
    "samples_per_prompt": 3,
    "vllm_args": {"kv_cache_memory_bytes": 64 << 20},
}


def scan(tiny_model: Path, prompts: Path, out: Path, **kwargs: Any) -> Any:
    cfg = ScanConfig(
        model=tiny_model,
        prompts=prompts,
        out=out,
        sampling=SamplingSpec(max_tokens=24),
        **SMALL,
        **kwargs,
    )
    return run_scan(cfg, Console(file=io.StringIO()))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    texts = ["What is the capital of France?", "Solve 3x + 5 = 20.", "def add(a, b):", "Hello"]
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def matrix(tiny_model: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """fp32/fp16/bf16 x KV auto/fp8 x quantization none/fp8 (skipped on CPU), train fp32."""
    return scan(
        tiny_model,
        prompts,
        tmp_path_factory.mktemp("matrix"),
        rollout_dtypes=("float32", "float16", "bfloat16"),
        kv_cache_dtypes=("auto", "fp8"),
        quantizations=("none", "fp8"),
    )


def name(dtype: str, kv: str = "auto") -> str:
    return Setting(RolloutSetting(dtype, kv)).name


def test_matrix_orders_precisions(matrix: Any) -> None:
    k3 = {n: m["k3_kl"] for n, m in matrix.settings.items()}
    assert k3[name("float32")] < k3[name("float16")] < k3[name("bfloat16")]


@pytest.fixture(scope="module")
def kv_fp8() -> bool:
    """Whether this CPU runs an fp8 KV cache (AVX-512 or AMX; an AVX2-only CPU cannot)."""
    from mismatch_probe.engine.rollout import cpu_fp8_kv_cache_supported

    return cpu_fp8_kv_cache_supported()


def test_fp8_kv_cache_adds_mismatch(matrix: Any, kv_fp8: bool) -> None:
    if not kv_fp8:  # this CPU cannot run it: every fp8-KV setting skipped, saying why
        kv = {n: r for n, r in matrix.skipped.items() if "kv=fp8" in n and "quant" not in n}
        assert len(kv) == 3
        assert all("fp8 KV cache needs AVX-512 or AMX" in reason for reason in kv.values())
        return
    k3 = {n: m["k3_kl"] for n, m in matrix.settings.items()}
    assert k3[name("float32", "fp8")] > 10 * k3[name("float32")]


def test_fp8_weights_are_skipped_with_reason(matrix: Any, kv_fp8: bool) -> None:
    weights = {n: r for n, r in matrix.skipped.items() if "quant=fp8" in n}
    assert len(weights) == 6
    assert all("fp8 weight quantization is not supported" in r for r in weights.values())
    # the fp8 KV cache is suggested instead only where this CPU can run it
    assert all(("--kv-cache-dtype fp8" in r) == kv_fp8 for r in weights.values())
    assert len(matrix.settings) == (6 if kv_fp8 else 3)
    assert len(matrix.skipped) == (6 if kv_fp8 else 9)


def test_matrix_store_has_one_block_per_setting(matrix: Any) -> None:
    tokens = pq.read_table(matrix.out_dir / store.TOKENS_FILE)
    names = tokens.column("setting").unique().to_pylist()
    assert sorted(names) == sorted(matrix.settings)
    for setting in names:
        rows = tokens.filter(pc.equal(tokens.column("setting"), setting))
        assert matrix.settings[setting]["num_tokens"] == rows.num_rows
    ranked = json.loads((matrix.out_dir / "settings.json").read_text())["order"]
    k3 = [matrix.settings[n]["k3_kl"] for n in ranked]
    assert k3 == sorted(k3)
    assert all(m["rollout_tokens_per_s"] > 0 for m in matrix.settings.values())


def test_same_tokens_gives_identical_ids(tiny_model: Path, prompts: Path, tmp_path: Path) -> None:
    result = scan(
        tiny_model,
        prompts,
        tmp_path,
        rollout_dtypes=("float32", "float16", "bfloat16"),
        same_tokens=True,
    )
    tokens = pq.read_table(tmp_path / store.TOKENS_FILE)
    ids = {
        s: tokens.filter(pc.equal(tokens.column("setting"), s)).column("token_id").to_pylist()
        for s in result.settings
    }
    assert len(ids) == 3
    assert len({tuple(v) for v in ids.values()}) == 1
    k3 = {n: m["k3_kl"] for n, m in result.settings.items()}
    assert k3[name("float32")] < k3[name("float16")] < k3[name("bfloat16")]
    assert k3[name("float32")] < 1e-8  # prefill fp32 vs HF fp32, raw: the identity
    assert result.run["sampling"]["rescoring"] == "raw"
    assert "prefill" in result.run["sampling"]["rollout_logprobs"]


def test_nothing_runnable_is_an_error(tiny_model: Path, prompts: Path, tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="no setting could run"):
        scan(tiny_model, prompts, tmp_path, quantizations=("fp8",))


def test_strict_turns_a_skip_into_an_error(tiny_model: Path, prompts: Path, tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="fp8 weight quantization is not supported"):
        scan(tiny_model, prompts, tmp_path, quantizations=("fp8",), strict=True)
    assert not (tmp_path / store.TOKENS_FILE).exists()


def test_matrix_report_shows_settings_side_by_side(matrix: Any) -> None:
    report = (matrix.out_dir / "report.md").read_text()
    top = report.split("## Every setting judged")[1].split("## Settings")[0]
    for setting in matrix.settings:  # every setting judged, near the top
        assert f"| {setting.replace('|', chr(92) + '|')} |" in top
    section = report.split("## Precision settings overlaid")[1]
    best = min(matrix.settings, key=lambda n: matrix.settings[n]["k3_kl"])
    assert f"Lowest mismatch: {best}".replace("|", "\\|") in section
    for kind in ("ratio_hist", "position", "f_tau"):
        assert (matrix.out_dir / "plots" / "settings" / f"compare_{kind}.png").is_file()
        assert f"plots/settings/compare_{kind}.png" in section


def test_matrix_store_has_typed_setting_columns(matrix: Any) -> None:
    path = matrix.out_dir / store.TOKENS_FILE
    fp8 = pq.read_table(path, columns=["setting"], filters=[("kv_cache_dtype", "=", "fp8")])
    assert set(fp8.column("setting").to_pylist()) == {n for n in matrix.settings if "kv=fp8" in n}
    bf16 = pq.read_table(path, columns=["setting"], filters=[("rollout_dtype", "=", "bfloat16")])
    assert set(bf16.column("setting").to_pylist()) == {n for n in matrix.settings if "bf16" in n}


def test_matrix_plots_show_every_series(matrix: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real scan's report, its first setting the identity (fp32/fp32): every series of every
    plot, the settings' overlays included, is visible (``test_plots_visible``)."""
    from mismatch_probe.pipeline.publish import publish
    from mismatch_probe.rundir import load_report

    assert next(iter(json.loads((matrix.out_dir / "run.json").read_text())["settings"])) == name(
        "float32"
    )
    figures = record_figures(monkeypatch)
    publish(*load_report(matrix.out_dir))
    overlays = {f"compare_{kind}.png" for kind in ("ratio_hist", "position", "f_tau")}
    check_all(figures, overlays | {"f_tau.png", "position.png", "ratio_hist.png"})


def test_the_sampling_checks_are_silent_on_every_setting(matrix: Any) -> None:
    """``temperature_mismatch`` and ``truncated_support`` (both sides share their settings in
    a scan): no finding on the run, nor on any setting's tokens alone."""
    from mismatch_probe.metrics.integrity import IntegrityAccumulator, _columns
    from mismatch_probe.metrics.sampling_checks import SAMPLING_CHECKS

    found = json.loads((matrix.out_dir / "integrity.json").read_text())["findings"]
    assert not {f["check"] for f in found} & set(SAMPLING_CHECKS)
    tokens = pq.read_table(matrix.out_dir / store.TOKENS_FILE)
    for setting in matrix.settings:
        acc = IntegrityAccumulator()
        acc.update(*_columns(tokens.filter(pc.equal(tokens.column("setting"), setting))))
        assert acc.sampling.n > 100 and acc.sampling.findings() == [], setting
