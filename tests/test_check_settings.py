"""``probe check`` on a precision-matrix run: every setting gated, each failing one named;
``--setting`` limits the gate; ``CheckConfig`` owns the option rules.

Every token of a setting has the same log-ratio r (``uniform_seqs``), so by hand:
``k3_kl = e^r - 1 - r`` and ``f_tau_2 = 1`` when ``|r| > ln 2``, else 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.gate.bounds import Bound
from mismatch_probe.gate.config import CheckConfig
from tests.cli_runner import run_probe
from tests.test_report_fixtures import matrix_run, uniform_seqs

FP32 = "rollout=fp32 | train=fp32"
BF16 = "rollout=bf16 | train=fp32"
FP8 = "rollout=bf16,kv=fp8 | train=fp32"
# The data-integrity line every check prints first (these stores are clean).
CLEAN = "✔ Data integrity: clean (no placeholder, shift, copy, bad log-prob or sampling gap)"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> str:
    """fp32 (r = 0, the identity, first), bf16 (r = 0.01), bf16 with an fp8 KV cache (r = -0.8:
    train below rollout, so no log-prob rises above 0)."""
    settings = {FP32: 0.0, BF16: 0.01, FP8: -0.8}
    seqs = {name: uniform_seqs(r, [4, 6]) for name, r in settings.items()}
    return str(matrix_run(tmp_path_factory.mktemp("check") / "m", seqs))


def check(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any) -> tuple[int, str]:
    code, out, err = run_probe(["check", *args], monkeypatch, capsys)
    return code, out + err


def test_every_setting_is_gated_and_each_failure_named(
    matrix: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    code, out = check([matrix, "--max", "f_tau_2=0.01", "--max", "k3_kl=1e-3"], monkeypatch, capsys)
    assert code == 1
    assert out.splitlines() == [
        CLEAN,
        f"✔ setting {FP32}",
        "  ✔ PASS  f_tau_2 = 0 ≤ 0.01 (max)",
        "  ✔ PASS  k3_kl = 0 ≤ 0.001 (max)",
        f"✔ setting {BF16}",
        "  ✔ PASS  f_tau_2 = 0 ≤ 0.01 (max)",
        "  ✔ PASS  k3_kl = 5.0167e-05 ≤ 0.001 (max)",  # e^0.01 - 1.01
        f"✘ setting {FP8}",
        "  ✘ FAIL  f_tau_2 = 1 > 0.01 (max) by 0.99, 100× the bound",
        "  ✘ FAIL  k3_kl = 0.249329 > 0.001 (max) by 0.2483, 249× the bound",  # e^-0.8 - 0.2
        f"2 of 6 bounds failed in 3 settings: 1 setting failed: {FP8} (f_tau_2, k3_kl)",
    ]


def test_setting_limits_the_gate(matrix: str, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    args = [matrix, "--max", "f_tau_2=0.01", "--setting", BF16, "--setting", FP32]
    code, out = check(args, monkeypatch, capsys)
    assert code == 0
    assert out.splitlines() == [  # the scan's order, whatever the options' order
        CLEAN,
        f"✔ setting {FP32}",
        "  ✔ PASS  f_tau_2 = 0 ≤ 0.01 (max)",
        f"✔ setting {BF16}",
        "  ✔ PASS  f_tau_2 = 0 ≤ 0.01 (max)",
        "all bounds hold in 2 settings",
    ]


def test_unknown_setting_exits_2_naming_what_the_run_holds(
    matrix: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = [matrix, "--max", "k3_kl=1", "--setting", "rollout=bf16 | train=fp16"]
    code, out = check(args, monkeypatch, capsys)
    assert code == 2
    assert out == (
        "error: --setting 'rollout=bf16 | train=fp16': m has no such setting "
        f"(did you mean '{BF16}'?) (it holds: {FP32}; {BF16}; {FP8})\n"
    )


def test_growth_is_gated_per_setting_paired_by_name(
    matrix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The baseline lacks the fp8 setting and holds bf16 at r = 0.005: bf16's k3_kl grew
    about 4x (5.0167e-05 / 1.2502e-05, small runs: point to point); fp8 is listed as ungated."""
    seqs = {FP32: uniform_seqs(0.0, [4, 6]), BF16: uniform_seqs(0.005, [4, 6])}
    base = matrix_run(tmp_path / "base", seqs)
    args = [matrix, "--baseline", str(base), "--max-increase", "k3_kl=2x"]
    code, out = check(args, monkeypatch, capsys)
    assert code == 1
    assert out.splitlines() == [
        CLEAN,
        f"baseline {base}",
        f"✔ setting {FP32}",
        "  ✔ PASS  k3_kl = 0 vs baseline 0: from 0 ≤ ×2 (max increase)",
        f"✘ setting {BF16}",
        "  ✘ FAIL  k3_kl = 5.0167e-05 vs baseline 1.25208e-05: ×4.01 > ×2 (max increase) by "
        "2.513e-05",  # r = 0.005 as stored in float32: k3_kl 1.252e-05
        f"✔ setting {FP8}",
        "  · not in the baseline: its growth is not gated",
        f"1 of 2 bounds failed in 3 settings: 1 setting failed: {BF16} (k3_kl)",
    ]


def test_a_baseline_without_any_of_the_settings_exits_2(
    matrix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    base = matrix_run(tmp_path / "base", {"a": uniform_seqs(0.0, [4]), "b": uniform_seqs(0.0, [4])})
    args = [matrix, "--baseline", str(base), "--max-increase", "k3_kl=2x"]
    code, out = check(args, monkeypatch, capsys)
    assert code == 2
    assert out.startswith("error: the baseline base has none of the run's settings")


def test_config_is_built_and_validated_once(tmp_path: Path) -> None:
    cfg = CheckConfig.from_options(
        tmp_path, ["k3_kl=1e-3"], ["prob_pearson=0.99"], settings=[BF16, BF16, FP32]
    )
    assert cfg.bounds == (Bound("k3_kl", "max", 1e-3), Bound("prob_pearson", "min", 0.99))
    assert cfg.settings == (BF16, FP32)  # duplicates dropped, order kept
    with pytest.raises(ProbeError, match="no bound given"):
        CheckConfig(tmp_path)
    with pytest.raises(ProbeError, match="--significance 1: a confidence level in"):
        CheckConfig(tmp_path, cfg.bounds, level=1.0)
    with pytest.raises(ProbeError, match="--step checks one training step's bounds"):
        CheckConfig.from_options(tmp_path, [], [], tmp_path, ["k3_kl=2x"], step="last")
    with pytest.raises(AttributeError):
        cfg.level = 0.5  # type: ignore[misc]  # frozen
