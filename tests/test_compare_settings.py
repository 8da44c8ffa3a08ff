"""``probe compare`` of precision-matrix runs (settings paired by name, each pair shown, a
setting only one run holds listed), ``--setting``, and changes judged against their noise in
the PR comment."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.cli_runner import run_probe
from tests.test_report_baseline import per_sequence_run
from tests.test_report_fixtures import matrix_run, uniform_seqs

FP32, BF16, FP8 = (
    "rollout=fp32 | train=fp32",
    "rollout=bf16 | train=fp32",
    "rollout=bf16,kv=fp8 | train=fp32",
)


def esc(setting: str) -> str:
    return setting.replace("|", "\\|")


@pytest.fixture(scope="module")
def matrices(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """base: fp32 (r = 0) and bf16 (r = 0.01); head: the same two, bf16 at r = 0.03, and an
    fp8 KV cache setting the base never ran."""
    root = tmp_path_factory.mktemp("cmp")
    base = matrix_run(
        root / "base", {FP32: uniform_seqs(0.0, [4, 6]), BF16: uniform_seqs(0.01, [4, 6])}
    )
    head = matrix_run(
        root / "head",
        {
            FP32: uniform_seqs(0.0, [4, 6]),
            BF16: uniform_seqs(0.03, [4, 6]),
            FP8: uniform_seqs(-0.8, [4, 6]),
        },
    )
    return base, head


def test_settings_are_paired_by_name(
    matrices: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    base, head = matrices
    out_dir = tmp_path / "c"
    args = ["compare", str(base), str(head), "--out", str(out_dir)]
    code, out, err = run_probe(args, monkeypatch, capsys)
    assert code == 0, err
    assert "2 settings paired by name" in out
    assert f"Key metrics of setting {FP32} (×:" in out
    assert f"Key metrics of setting {BF16} (×:" in out
    assert f"· {FP8}: only in head" in out
    assert re.search(r"kl\s+│\s+-0\.01 │\s+-0\.03 │\s+Δ-0\.02 │", out)  # signed: a difference
    text = (out_dir / "compare.md").read_text()
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads == [
        f"## Key metrics of setting {esc(FP32)}",
        f"## Key metrics of setting {esc(BF16)}",
        "## Settings only some runs hold",
        "## Plots",
    ]
    assert f"- {esc(FP8)}: only in head" in text
    assert "| base | base |" in text and str(tmp_path) not in text  # no absolute path
    for setting in ("rollout=fp32_train=fp32", "rollout=bf16_train=fp32"):
        for kind in ("ratio_hist", "position", "f_tau"):
            png = out_dir / "settings" / setting / f"compare_{kind}.png"
            assert png.read_bytes()[:4] == b"\x89PNG"
            assert f"(settings/{setting}/compare_{kind}.png)" in text


def test_setting_limits_the_comparison(
    matrices: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    base, head = matrices
    args = ["compare", str(base), str(head), "--out", str(tmp_path / "c"), "--setting", BF16]
    code, out, _ = run_probe([*args, "--format", "pr-comment"], monkeypatch, capsys)
    assert code == 0
    assert out.startswith(f"### Mismatch: head vs base (tiny-llama)\n\n{esc(BF16)} · 10 response")
    assert "rollout=fp32" not in out and "kv=fp8" not in out
    code, _, err = run_probe([*args[:-1], "rollout=fp16 | train=fp32"], monkeypatch, capsys)
    assert code == 2
    assert err == "error: --setting 'rollout=fp16 | train=fp32': none of the runs holds it\n"


def test_runs_that_share_no_setting_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    a = matrix_run(tmp_path / "a", {FP32: uniform_seqs(0.0, [4]), BF16: uniform_seqs(0.0, [4])})
    b = matrix_run(tmp_path / "b", {FP8: uniform_seqs(0.0, [4]), "x": uniform_seqs(0.0, [4])})
    code, _, err = run_probe(
        ["compare", str(a), str(b), "--out", str(tmp_path / "c")], monkeypatch, capsys
    )
    assert code == 2 and err.startswith("error: the runs share no setting (a: ")


def key_rows(comment: str) -> dict[str, list[str]]:
    block = comment.split("#### Key metrics")[1].split("####")[0]
    rows = [line.split(" | ") for line in block.splitlines() if line.startswith("| `")]
    return {r[0].strip("| `"): [c.strip(" |") for c in r[1:]] for r in rows}


def test_a_change_within_noise_gets_no_colour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Two draws of one distribution (60 responses each): every judged change holds 0 in its
    interval; a head whose log-ratios are 3 times larger is significantly worse."""
    rng = np.random.default_rng(3)
    r_main, r_pr = (0.2 * rng.standard_normal(60) for _ in range(2))
    main = per_sequence_run(tmp_path / "main", r_main)
    noisy = per_sequence_run(tmp_path / "pr", r_pr)
    worse = per_sequence_run(tmp_path / "worse", 3 * r_main)
    out_dir = str(tmp_path / "c")
    args = ["compare", str(main), str(noisy), "--out", out_dir, "--format", "pr-comment"]
    code, out, _ = run_probe(args, monkeypatch, capsys)
    assert code == 0
    rows = key_rows(out)
    for key in ("k3_kl", "kl", "chi2_token", "log_ratio_abs_mean", "f_tau_1.1", "f_tau_2"):
        change = rows[key][2]
        if change == "= no change":
            continue
        assert re.fullmatch(r"[↑↓] \S+ within noise, 95% CI of the change \[\S+, \S+\]", change), (
            key,
            change,
        )
        lo, hi = (float(x) for x in re.findall(r"\[(\S+), (\S+)\]", change)[0])
        assert lo <= 0 <= hi
    assert "🔴" not in out and "🟢" not in out
    assert rows["rollout_is_eff_sample_size"][2].endswith("(no noise estimate)")
    assert "A change is judged against its noise" in out
    args = ["compare", str(main), str(worse), "--out", out_dir, "--format", "pr-comment"]
    code, out, _ = run_probe(args, monkeypatch, capsys)
    rows = key_rows(out)
    assert (
        rows["k3_kl"][2].startswith("↑ ")
        and " 🔴 worse, 95% CI of the change [+" in rows["k3_kl"][2]
    )
    assert re.match(r"[↑↓] [+-][0-9.]+ ", rows["kl"][2])  # kl: a difference, not a percentage
    assert "%" not in rows["kl"][2].split(" within")[0].split(" 🔴")[0]


def test_pr_comment_judges_every_setting_of_head(
    matrices: tuple[Path, Path], tmp_path: Path
) -> None:
    """A baseline of one setting against a HEAD of three: the two HEAD settings without a
    baseline are judged in the comment (the failing fp8 one named in its opening), not hidden."""
    from mismatch_probe.gate.compare import load_comparison
    from mismatch_probe.report.comment import comparison_comment

    _, head = matrices
    one = matrix_run(tmp_path / "one", {BF16: uniform_seqs(0.01, [4, 6])})
    comparison = load_comparison([one, head])
    assert [s for s, _ in comparison.head_only] == [FP32, FP8]
    text = comparison_comment(comparison).replace("\\|", "|")
    opening = next(line for line in text.splitlines() if line.startswith("**Every setting of"))
    assert "of 3 settings fail a check" in opening and FP8 in opening
    assert opening.index("**Every setting of") < text.index("**Verdicts")
    only = text[text.index("#### Settings only head holds") :]
    assert FP32 in only and FP8 in only and "❌" in only
