"""``probe metrics``: JSON and table output, options, settings, and exit code 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.cli import main
from mismatch_probe.metrics import PRESETS, MetricsConfig, compute_metrics
from mismatch_probe.metrics.recommend import OUTCOMES
from mismatch_probe.store import TOKEN_SCHEMA, TOKENS_FILE, write_table

SETTINGS = ("rollout=bf16 | train=fp32", "rollout=fp32 | train=fp32")


def _tokens(setting: str, first_seq: int, seed: int) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    lengths = [3, 1, 5, 2]
    n = sum(lengths)
    rollout = -rng.exponential(1.0, n)
    return {
        "setting": [setting] * n,
        "seq_id": np.repeat(np.arange(first_seq, first_seq + len(lengths)), lengths).tolist(),
        "prompt_id": np.repeat(np.arange(len(lengths)), lengths).tolist(),
        "sample_id": [0] * n,
        "position": np.concatenate([np.arange(k) for k in lengths]).tolist(),
        "token_id": rng.integers(0, 100, n).tolist(),
        "token_text": ["x"] * n,
        "rollout_logprob": rollout.tolist(),
        "train_logprob": np.minimum(rollout + rng.normal(0, 0.3, n), 0.0).tolist(),
        "support_flip": (rng.random(n) < 0.3).tolist(),
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory whose token store holds one setting (the full token schema)."""
    write_table(tmp_path / TOKENS_FILE, pa.table(_tokens(SETTINGS[0], 0, 0)), TOKEN_SCHEMA, {})
    return tmp_path


def _probe(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["probe", "metrics", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_is_one_flat_object_of_spec_names(run_dir: Path, monkeypatch, capsys) -> None:
    code, out, err = _probe(monkeypatch, capsys, str(run_dir), "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert next(iter(data)) == "integrity"  # shown first
    assert data.pop("integrity") == {"findings": [], "masks_applied": []}
    recommendation = data.pop("recommendation")  # the one non-flat key (spec section 7)
    assert recommendation["outcome"] in OUTCOMES and recommendation["reason"]
    expected = compute_metrics(run_dir / TOKENS_FILE, MetricsConfig()).flat()
    assert data == pytest.approx(expected)
    for key in ("kl", "k3_kl", "chi2_token", "prob_abs_diff_max", "f_tau_2", "num_tokens"):
        assert isinstance(data[key], float)
    assert data["num_tokens"] == 11.0 and data["num_sequences"] == 4.0
    assert {f"presets/{name}/eff_sample_size" for name in PRESETS} <= data.keys()


def test_options_reach_the_config(run_dir: Path, monkeypatch, capsys) -> None:
    args = [
        str(run_dir / TOKENS_FILE),
        "--json",
        "--rollout-is=sequence",
        "--rollout-is-threshold=0.5_5.0",
        "--rollout-rs=token_k1,seq_max_k3",
        "--rollout-rs-threshold=0.5_2.0,0.1",
        "--batch-normalize",
        "--preset=geo_rs",
        "--preset=k3_rs",
    ]
    code, out, _ = _probe(monkeypatch, capsys, *args)
    data = json.loads(out)
    assert code == 0
    assert "rollout_is_oob_ratio" in data and "rollout_is_batch_norm_factor" in data
    assert "rollout_rs_seq_max_k3_masked_fraction" in data
    assert {k.split("/")[1] for k in data if k.startswith("presets/")} == {"geo_rs", "k3_rs"}


def test_tables(run_dir: Path, monkeypatch, capsys) -> None:
    code, out, _ = _probe(monkeypatch, capsys, str(run_dir))
    assert code == 0
    for title in ("Importance sampling (token TIS 2)", "Off-policy", "Presets", "k3_rs"):
        assert title in out


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--rollout-is-threshold", "2_0.5"], "'2_0.5'"),
        (["--rollout-is-threshold", "abc"], "'abc'"),
        (["--rollout-is-threshold", "0"], "'0'"),
        (["--rollout-is-threshold", "-1"], "'-1'"),
        (["--rollout-rs", "token_k1,seq_sum_k2", "--rollout-rs-threshold", "1,2,3"], "'1,2,3'"),
        (["--rollout-rs", "seq_mean_k3", "--rollout-rs-threshold", "_"], "'_' for seq_mean_k3"),
        (["--rollout-rs", "seq_sum_k9", "--rollout-rs-threshold", "2"], "'seq_sum_k9'"),
        (["--rollout-is", "chunk"], "'chunk'"),
        (["--preset", "nope"], "'nope'"),
        (["--setting", "fp8"], "'fp8'"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    run_dir: Path, monkeypatch, capsys, args: list[str], named: str
) -> None:
    code, out, err = _probe(monkeypatch, capsys, str(run_dir), *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err


def test_missing_column_and_missing_file(tmp_path: Path, monkeypatch, capsys) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"seq_id": [1], "position": [0]}), path)
    code, _, err = _probe(monkeypatch, capsys, str(path))
    assert code == 2 and "rollout_logprob, train_logprob" in err
    code, _, err = _probe(monkeypatch, capsys, str(tmp_path / "none.parquet"))
    assert code == 2 and "no such file" in err


def test_scattered_sequence_rows_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    rows = {"seq_id": [1, 2, 1], "position": [0, 0, 1]}
    lp = {"rollout_logprob": [-1.0, -1.0, -1.0], "train_logprob": [-1.0, -1.0, -1.0]}
    pq.write_table(pa.table({**rows, **lp}), tmp_path / "t.parquet")
    code, _, err = _probe(monkeypatch, capsys, str(tmp_path / "t.parquet"))
    assert code == 2 and "not contiguous" in err


def test_several_settings_need_a_choice(tmp_path: Path, monkeypatch, capsys) -> None:
    both = [_tokens(SETTINGS[0], 0, 0), _tokens(SETTINGS[1], 100, 1)]
    table = pa.concat_tables([pa.table(t) for t in both])
    write_table(tmp_path / TOKENS_FILE, table, TOKEN_SCHEMA, {})
    code, _, err = _probe(monkeypatch, capsys, str(tmp_path), "--json")
    assert code == 2 and "holds 2 settings" in err and SETTINGS[1] in err
    code, out, _ = _probe(monkeypatch, capsys, str(tmp_path), "--json", "--setting", SETTINGS[1])
    assert code == 0 and json.loads(out)["num_tokens"] == 11.0


def test_exit_code_from_the_console_script(run_dir: Path) -> None:
    cmd = [sys.executable, "-m", "mismatch_probe.cli", "metrics", str(run_dir)]
    proc = subprocess.run([*cmd, "--rollout-is-threshold", "2_0.5"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "error: rollout_is_threshold '2_0.5': lower bound 2 is above upper bound 0.5\n"
    )


def test_help_documents_every_option_and_preset(monkeypatch, capsys) -> None:
    code, out, _ = _probe(monkeypatch, capsys, "--help")
    assert code == 0
    flat = " ".join(out.split())
    for option in ("--rollout-is ", "--rollout-is-threshold", "--rollout-rs ", "--json"):
        assert option in flat
    for option in ("--rollout-rs-threshold", "--batch-normalize", "--preset", "--setting"):
        assert option in flat
    for name in PRESETS:
        assert name in flat
