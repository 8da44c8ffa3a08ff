"""``probe check --min first_divergent_layer=N`` on crafted run directories with a
``layers.json`` (no engine): a divergence below N fails, at or above N passes, no divergence
(``null``) passes; ``--max`` and ``--max-increase`` of it are refused; a run without
``layers.json`` says what writes one; a matrix run is gated setting by setting; the PR comment
names each setting's first divergent layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mismatch_probe.report.layers import comment_lines
from mismatch_probe.rundir.layers import gated, write_layers
from tests.cli_runner import run_probe
from tests.test_report_fixtures import matrix_run, uniform_run, uniform_seqs

FP32 = "rollout=fp32 | train=fp32"
BF16 = "rollout=bf16 | train=fp32"


def _curve(first: int | None) -> dict[str, Any]:
    rows = [{"layer": i, "mean_rel": 1e-7 * (1 + i), "max_rel": 1e-6, "mean_cosine": 1.0,
             "worst_tokens": [], "after_final_norm": i == 2} for i in range(3)]  # fmt: skip
    return {"layers": rows, "floor": [1e-7] * 3, "first_divergent_layer": first,
            "largest_growth_layer": 1, "tokens": 10, "sequences": 2}  # fmt: skip


def _check(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any) -> tuple[int, str]:
    code, out, err = run_probe(["check", *args], monkeypatch, capsys)
    return code, out + err


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One-setting runs diverging at layer 1, nowhere, and one without ``layers.json``; a
    matrix run whose fp32 setting diverges nowhere and bf16 at layer 0."""
    base = tmp_path_factory.mktemp("layergate")
    out = {}
    for name, first in (("at1", 1), ("none", None)):
        out[name] = uniform_run(base / name, 0.01, [4, 6])
        write_layers(out[name], {"floor_source": "nominal", "settings": {"s": _curve(first)}})
    out["plain"] = uniform_run(base / "plain", 0.01, [4, 6])
    seqs = {FP32: uniform_seqs(0.0, [4, 6]), BF16: uniform_seqs(0.01, [4, 6])}
    out["matrix"] = matrix_run(base / "matrix", seqs)
    data = {"floor_source": "nominal", "settings": {FP32: _curve(None), BF16: _curve(0)}}
    write_layers(out["matrix"], data)
    return out


def test_min_gates_the_first_divergent_layer(
    runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    code, out = _check([str(runs["at1"]), "--min", "first_divergent_layer=1"], monkeypatch, capsys)
    assert code == 0 and "✔ PASS  first_divergent_layer = 1 ≥ 1 (min)" in out
    code, out = _check([str(runs["at1"]), "--min", "first_divergent_layer=2"], monkeypatch, capsys)
    assert code == 1 and "✘ FAIL  first_divergent_layer = 1 < 2 (min) by 1" in out
    args = [str(runs["none"]), "--min", "first_divergent_layer=99"]
    code, out = _check(args, monkeypatch, capsys)
    assert code == 0 and "✔ PASS  first_divergent_layer = none ≥ 99 (min)" in out
    assert gated(runs["none"], None) == {"first_divergent_layer": float("inf")}


@pytest.mark.parametrize(
    ("run", "args", "message"),
    [
        ("at1", ["--max", "first_divergent_layer=3"], "--max first_divergent_layer: a later"),
        ("plain", ["--min", "first_divergent_layer=1"], "no layers.json for it: probe scan"),
    ],
)
def test_wrong_side_or_no_layers_json_exits_2(
    runs: dict[str, Path],
    run: str,
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    code, out = _check([str(runs[run]), *args], monkeypatch, capsys)
    assert code == 2 and message in out and "Traceback" not in out
    assert "PASS" not in out and "FAIL" not in out


def test_max_increase_of_it_is_refused(
    runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = [str(runs["at1"]), "--baseline", str(runs["none"])]
    code, out = _check([*args, "--max-increase", "first_divergent_layer=+1"], monkeypatch, capsys)
    assert code == 2 and "--max-increase first_divergent_layer: a later" in out


def test_matrix_gated_per_setting_and_named_in_the_comment(
    runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = [str(runs["matrix"]), "--min", "first_divergent_layer=1"]
    code, out = _check(args, monkeypatch, capsys)
    assert code == 1
    assert "  ✔ PASS  first_divergent_layer = none ≥ 1 (min)" in out
    assert "  ✘ FAIL  first_divergent_layer = 0 < 1 (min) by 1" in out
    assert f"1 setting failed: {BF16} (first_divergent_layer)" in out
    data = {"settings": {FP32: _curve(None), BF16: _curve(0)}}
    (line, _) = comment_lines(data["settings"][FP32], data)
    assert line.startswith("**First divergent layer:** none")
    assert "per setting: rollout=fp32 \\| train=fp32: none; rollout=bf16 \\| train=fp32: 0" in line
