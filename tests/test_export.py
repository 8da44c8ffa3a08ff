"""``probe export`` read back with each tracker's own reader (TensorBoard's event reader, a W&B
offline run's files, trackio's local store, and ``jsonl`` through ``probe ingest verl-log``),
equal to the run's metrics per step; and ``probe ingest verl-log`` of a log written by verl's
own ``FileLogger``: its trend, the V1 aggregation caveat, ``probe check --step``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.export import ExportSpec, StepPoint, export_run, scalars
from mismatch_probe.ingest import IngestConfig, run_ingest
from tests.cli_runner import run_probe
from tests.ingest_fixtures import write_prime_rl
from tests.tracker_readers import tensorboard_scalars, wandb_history, wandb_metrics
from tests.watch_writer import steps_data


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("export")
    write_prime_rl(tmp / "outputs", steps_data(3, fault=2))
    return run_ingest(IngestConfig("prime-rl", tmp / "outputs", tmp / "run")).out


def _steps(run: Path) -> dict[int, dict[str, float]]:
    data = json.loads((run / "steps.json").read_text())["steps"]
    return {int(s): m for s, m in data.items()}


def test_names_follow_verl_nemo_and_ours() -> None:
    metrics = {"k3_kl": 0.5, "kl": 0.1, "token_mult_prob_error": 1.2, "k3_kl_reverse": 0.7}
    point = StepPoint(3, {**metrics, "rollout_is_mean": 1.0, "f_tau_2": 0.2})
    out = scalars(point)
    assert out["rollout_corr/k3_kl"] == out["probe/k3_kl"] == 0.5
    assert out["rollout_corr/rollout_is_mean"] == 1.0
    assert "rollout_corr/f_tau_2" not in out  # ours, not verl's
    assert (out["train/gen_kl_error"], out["train/policy_kl_error"]) == (0.5, 0.7)
    assert out["train/token_mult_prob_error"] == 1.2
    assert (out["probe/verdict/f_tau_2"], out["probe/verdict/kl"]) == (0.0, 1.0)
    assert out["probe/verdict/failed"] == 2.0  # f_tau_2 > 0.01, mult. prob. error > 1.05
    resumed = scalars(point, resumed=True)
    assert "rollout_corr/k3_kl" not in resumed and resumed["probe/rollout_corr/k3_kl"] == 0.5
    assert resumed["probe/train/gen_kl_error"] == 0.5


def test_jsonl_is_verls_file_logger_and_reads_back(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    target = tmp_path / "probe.jsonl"
    code, out, err = run_probe(["export", str(run), "--to", "jsonl", "--out", str(target)],
                               monkeypatch, capsys)  # fmt: skip
    assert code == 0, err
    assert f"exported 3 steps to jsonl: {target}" in out
    first = json.loads(target.read_text().splitlines()[0])
    assert sorted(first) == ["data", "step"] and first["step"] == 1
    code, _, err = run_probe(["ingest", "verl-log", str(target), "--out", str(tmp_path / "t")],
                             monkeypatch, capsys)  # fmt: skip
    assert code == 0, err
    trend = _steps(tmp_path / "t")
    steps = _steps(run)
    for step, metrics in steps.items():
        verl = {k: v for k, v in metrics.items() if f"rollout_corr/{k}" in first["data"]}
        assert trend[step] == verl  # equal, not close: the numbers went through JSON twice
    assert "k3_kl" in trend[1] and "f_tau_2" not in trend[1]


def test_tensorboard_reads_back(run: Path, tmp_path: Path) -> None:
    result = export_run(run, ExportSpec("tensorboard", tmp_path / "tb"))
    assert result.steps == 3
    found, acc = tensorboard_scalars(tmp_path / "tb")
    steps = _steps(run)
    for name in ("k3_kl", "chi2_token", "kl"):
        expect = {s: np.float32(m[name]) for s, m in steps.items()}
        assert found[f"probe/{name}"] == pytest.approx(expect, rel=1e-6)
        assert found[f"rollout_corr/{name}"] == found[f"probe/{name}"]
    assert found["train/gen_kl_error"] == found["probe/k3_kl"]
    hist = acc.Histograms("probe/log_ratio")
    assert [h.step for h in hist] == [1, 2, 3]
    tokens = json.loads((run / "run.json").read_text())["counts"]["tokens"]
    assert sum(h.histogram_value.num for h in hist) == tokens


def test_wandb_offline_reads_back(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    export_run(run, ExportSpec("wandb", tmp_path / "wb", project="probe-test"))
    (run_file,) = (tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    steps = _steps(run)
    assert [r["probe/step"] for r in rows] == [1, 2, 3]
    for row in rows:
        metrics = steps[row["probe/step"]]
        assert row["probe/k3_kl"] == metrics["k3_kl"]
        assert row["rollout_corr/chi2_token"] == metrics["chi2_token"]
        assert row["probe/log_ratio/_type"] == "histogram"
        counted = sum(row["probe/log_ratio/values"]) + row["probe/log_ratio_underflow"]
        assert counted + row["probe/log_ratio_overflow"] == _tokens_of(run, row["probe/step"])
    defined = wandb_metrics(run_file)
    assert defined["probe/*"] == defined["rollout_corr/*"] == "probe/step"


def _tokens_of(run: Path, step: int) -> int:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(run / "tokens.parquet", columns=["step"])
    return int(pc.sum(pc.equal(table.column("step"), step)).as_py())


def test_wandb_resume_keeps_the_trainers_names(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    export_run(run, ExportSpec("wandb", tmp_path / "wb", wandb_run="trainrun1", project="p"))
    (run_file,) = (tmp_path / "wb").glob("wandb/offline-run-*-trainrun1/run-trainrun1.wandb")
    row = wandb_history(run_file)[0]
    assert "rollout_corr/k3_kl" not in row and "probe/rollout_corr/k3_kl" in row
    assert wandb_metrics(run_file) == {"probe/step": "", "probe/*": "probe/step"}


def test_trackio_reads_back(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    import sys

    # trackio reads its store's folder once, at import (another test, TRL's, may have imported
    # it already): imported afresh here, the earlier modules put back afterwards
    for name in [m for m in sys.modules if m == "trackio" or m.startswith("trackio.")]:
        monkeypatch.delitem(sys.modules, name)
    export_run(run, ExportSpec("trackio", project="probe-test"))
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs("probe-test", f"probe {run.name}")
    steps = _steps(run)
    assert [log["step"] for log in logs] == [1, 2, 3]
    for log in logs:
        assert log["probe/k3_kl"] == steps[log["step"]]["k3_kl"]
        assert log["train/gen_kl_error"] == steps[log["step"]]["k3_kl"]


def test_a_missing_tracker_is_one_line(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    import builtins

    real = builtins.__import__

    def no_tensorboard(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    code, _, err = run_probe(["export", str(run), "--to", "tensorboard", "--out",
                              str(tmp_path / "tb")], monkeypatch, capsys)  # fmt: skip
    assert code == 2
    assert err == (
        "error: --to tensorboard needs the tensorboard package: "
        "pip install 'mismatch-probe[tensorboard]'\n"
    )


def _verl_log(path: Path) -> None:
    """Three steps through verl's own FileLogger (orjson writes NaN as null)."""
    from verl.utils.tracking import FileLogger

    monkey = {"VERL_FILE_LOGGER_PATH": str(path)}
    import os

    old = {k: os.environ.get(k) for k in monkey}
    os.environ.update(monkey)
    try:
        logger = FileLogger("proj", "exp")
        for step in (1, 2, 3):
            logger.log({"rollout_corr/k3_kl": 1e-4 * step**3, "rollout_corr/kl": 0.01 * step,
                        "rollout_corr/log_ppl_diff_max": 0.1 * step,
                        "rollout_corr/rollout_rs_seq_max_k2_mean": 0.2,
                        "rollout_corr/chi2_token": float("nan") if step == 2 else 0.1,
                        "actor/pg_loss": 0.5, "training/global_step": step}, step)  # fmt: skip
        logger.finish()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_verl_log_is_a_trend_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    log, out = tmp_path / "exp.jsonl", tmp_path / "trend"
    _verl_log(log)
    code, stdout, err = run_probe(["ingest", "verl-log", str(log), "--out", str(out)],
                                  monkeypatch, capsys)  # fmt: skip
    assert code == 0, err
    steps = _steps(out)
    assert steps[3]["k3_kl"] == pytest.approx(2.7e-3)
    assert "chi2_token" not in steps[2] and steps[3]["chi2_token"] == 0.1  # null left out
    assert "pg_loss" not in steps[1]
    meta = json.loads((out / "run.json").read_text())
    assert meta["kind"] == "trend" and meta["counts"]["null_values"] == 1
    assert meta["v1_aggregation"] == {"log_ppl_diff_max": "max",
                                      "rollout_rs_seq_max_k2_mean": "max"}  # fmt: skip
    report = (out / "report.md").read_text()
    assert "Data integrity: not checked" in report
    assert r"rollout\_rs\_seq\_max\_k2\_mean (max)" in report  # escaped Markdown
    assert "## Trend over training steps" in report and (out / "plots" / "trend.png").is_file()
    code, stdout, _ = run_probe(["report", str(out)], monkeypatch, capsys)
    assert code == 0 and "MetricsAggregator" in stdout and "0.0027" in stdout  # the trend
    code, stdout, _ = run_probe(["check", str(out), "--step", "2", "--max", "k3_kl=1e-3"],
                                monkeypatch, capsys)  # fmt: skip
    assert code == 0 and "✔ PASS  k3_kl = 0.0008 ≤ 0.001 (max)" in stdout
    code, stdout, _ = run_probe(["check", str(out), "--max", "k3_kl=1e-3"], monkeypatch, capsys)
    assert code == 1 and "k3_kl = 0.0027" in stdout  # the last step by default
    code, _, err = run_probe(["check", str(out), "--step", "9", "--max", "k3_kl=1"],
                             monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "--step 9: not in the run (steps 1..3)" in err
