"""The trend section and the per-step commands on an ingested run: crossings, exact Markdown,
staleness notes, ``probe metrics --step``, ``probe check --step``, ``probe report``/``compare``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe.ingest import IngestConfig, run_ingest
from mismatch_probe.report.trend_table import MAX_ROWS, render_markdown, shown_steps
from mismatch_probe.rundir.trend import build_trend, staleness_note
from tests.cli_runner import run_probe as run_main
from tests.ingest_fixtures import synthetic_steps, write_prime_rl, write_slime


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("ingest")
    src = write_prime_rl(tmp / "src", synthetic_steps([10, 20, 30, 40], seqs=4, growth=0.4))
    return run_ingest(IngestConfig("prime-rl", src, tmp / "run")).out


def _steps(k3: list[float], chi2: list[float], masked: list[float]) -> dict[int, dict]:
    return {
        s: {
            "k3_kl": k3[i],
            "chi2_token": chi2[i],
            "f_tau_2": 0.0,
            "presets/geo_rs/token_masked_fraction": masked[i],
            "presets/geo_rs_token_tis/token_masked_fraction": masked[i],  # same: shown once
            "presets/token_is/token_masked_fraction": 0.0,  # never masks: not shown
        }
        for i, s in enumerate([1, 2, 3, 4])
    }


def test_crossings_are_the_steps_where_a_metric_starts_failing() -> None:
    trend = build_trend(_steps([0.1] * 4, [0.5, 1.5, 0.2, 3.0], [0.0, 0.1, 0.2, 0.3]), {})
    assert trend is not None
    assert list(trend.series) == [
        "k3_kl", "chi2_token", "f_tau_2", "presets/geo_rs/token_masked_fraction"
    ]  # fmt: skip
    assert trend.failing == {"chi2_token": {2, 4}, "f_tau_2": set()}
    assert trend.crossings == {"chi2_token": [2, 4], "f_tau_2": []}


def test_trend_markdown_exact() -> None:
    run = {"off_policy": {"max_off_policy_steps": 0, "staleness": False}}
    trend = build_trend(
        _steps([1e-3, 2e-3, 4e-3, 8e-3], [0.5, 1.5, 0.2, 0.3], [0, 0, 0, 0.25]), run
    )
    assert trend is not None
    expected = """## Trend over training steps

On-policy training: the ratio measures engine mismatch.

- ❌ chi2\\_token (≤ 1, verl): crosses at step 2

| step | `k3\\_kl` | `chi2\\_token` | `f\\_tau\\_2` | `geo\\_rs masked` |
| ---: | ---: | ---: | ---: | ---: |
| 1 | 0.001 | 0.5 | 0 | 0 |
| 2 | 0.002 | **❌ 1.5** | 0 | 0 |
| 3 | 0.004 | 0.2 | 0 | 0 |
| 4 | 0.008 | 0.3 | 0 | 0.25 |
"""
    assert render_markdown(trend, None, Path(".")) == expected


def test_long_runs_show_the_ends_the_crossings_and_spaced_steps() -> None:
    per_step = {s: {"chi2_token": 2.0 if s in (457, 458) else 0.1} for s in range(1000)}
    trend = build_trend(per_step, {})
    assert trend is not None
    shown = shown_steps(trend)
    assert {0, 999, 457} <= set(shown) and len(shown) <= MAX_ROWS + 3
    assert 458 not in trend.crossings["chi2_token"]


@pytest.mark.parametrize(
    ("off_policy", "words"),
    [
        ({"max_off_policy_steps": 0, "staleness": False}, "measures engine mismatch."),
        ({"max_off_policy_steps": 8, "staleness": True, "source": "x"}, "up to 8 policy versions"),
        ({"max_off_policy_steps": None, "staleness": True, "source": "x"}, "unknown off-policy"),
        ({"max_off_policy_steps": None, "staleness": None, "source": "x"}, "if the run was asyn"),
    ],
)
def test_staleness_note(off_policy: dict, words: str) -> None:
    assert words in staleness_note({"off_policy": off_policy})


def test_ingest_writes_the_trend_section_and_plot(run: Path) -> None:
    report = (run / "report.md").read_text()
    assert "## Trend over training steps" in report and "plots/trend.png" in report
    assert (run / "plots" / "trend.png").stat().st_size > 10_000
    assert "mismatch plus policy staleness" in report  # prime-rl is asynchronous
    assert "| steps | 4 (10..40) |" in report and "| training side | trainer\\_logprobs |" in report


def test_metrics_step_matches_steps_json(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    code, out, err = run_main(["metrics", str(run), "--step", "20", "--json"], monkeypatch, capsys)
    assert code == 0, err
    steps = json.loads((run / "steps.json").read_text())["steps"]
    data = json.loads(out)
    assert data.pop("recommendation")["reason"]  # the one non-flat key besides integrity
    integrity = json.loads((run / "integrity.json").read_text())
    assert data.pop("integrity") == {
        "findings": integrity["steps"]["20"],
        "step": 20,
        "masks_applied": integrity["masks_applied"],
    }
    assert data == pytest.approx(steps["20"])
    code, out, _ = run_main(["metrics", str(run), "--step", "last", "--json"], monkeypatch, capsys)
    data = json.loads(out)
    data.pop("recommendation")
    assert data.pop("integrity")["step"] == 40 and data == pytest.approx(steps["40"])


def test_check_step_last_and_bad_steps(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    steps = json.loads((run / "steps.json").read_text())["steps"]
    last, first = steps["40"]["k3_kl"], steps["10"]["k3_kl"]
    assert first < last
    between = f"k3_kl={(first + last) / 2}"
    code, out, _ = run_main(["check", str(run), "--max", between, "--step", "last"],
                            monkeypatch, capsys)  # fmt: skip
    assert code == 1 and "FAIL" in out
    code, out, _ = run_main(["check", str(run), "--max", between, "--step", "10"],
                            monkeypatch, capsys)  # fmt: skip
    assert code == 0 and "all bounds hold" in out
    code, _, err = run_main(["check", str(run), "--max", between, "--step", "15"],
                            monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "--step 15: not in the run (steps 10..40)" in err


def test_check_step_recomputes_without_steps_json(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    expected = json.loads((copy / "steps.json").read_text())["steps"]["30"]["k3_kl"]
    (copy / "steps.json").unlink()
    code, out, _ = run_main(["check", str(copy), "--max", f"k3_kl={expected * 1.0000001}",
                             "--step", "30"], monkeypatch, capsys)  # fmt: skip
    assert code == 0, out


def test_step_on_a_store_without_steps_is_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from tests.test_report_fixtures import uniform_run

    scan = uniform_run(tmp_path / "scan", 0.01, [3, 4])
    code, _, err = run_main(["check", str(scan), "--max", "k3_kl=1", "--step", "last"],
                            monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "no step column" in err


def test_report_and_compare_work_on_ingested_runs(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "report.md").unlink()
    (copy / "plots" / "trend.png").unlink()
    code, out, err = run_main(["report", str(copy)], monkeypatch, capsys)
    assert code == 0, err
    assert "Trend over training steps" in out and (copy / "plots" / "trend.png").exists()
    assert "## Trend over training steps" in (copy / "report.md").read_text()
    other = run_ingest(
        IngestConfig("slime", write_slime(tmp_path / "s", synthetic_steps([1, 2])), tmp_path / "r")
    ).out
    code, out, err = run_main(["compare", str(run), str(other), "--out", str(tmp_path / "c")],
                              monkeypatch, capsys)  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "c" / "compare.md").exists()


def test_ingested_run_has_no_entropy_and_says_so(run: Path) -> None:
    import pyarrow.parquet as pq

    entropy = pq.read_table(run / "tokens.parquet", columns=["train_entropy"]).column(0)
    assert entropy.null_count == len(entropy) > 0  # logs carry log-probs, not logits
    metrics = json.loads((run / "metrics.json").read_text())
    assert "entropy_mean" not in metrics and metrics["curves"]["entropy"]["available"] is False
    assert json.loads((run / "run.json").read_text())["available"]["train_entropy"] is False
    assert "train\\_entropy: not available" in (run / "report.md").read_text()
