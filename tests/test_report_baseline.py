"""``probe check --baseline``: growth bounds computed by hand, comparability, and bootstrap
intervals checked against what they must be (a collapsed interval when every sequence is the
same, the plug-in standard error of a mean, the same draw for paired runs)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.gate import bootstrap
from mismatch_probe.gate.baseline import IncreaseResult, differences, gate
from mismatch_probe.gate.bounds import Increase, parse_increase
from mismatch_probe.gate.config import CheckConfig
from tests.test_report_check import run_main
from tests.test_report_fixtures import Seq, make_run, mixed_seqs, uniform_run

LENGTHS = [4, 6, 5, 5] * 6  # 24 responses, 120 tokens: enough sequences for an interval
LP = math.log(0.5)


def stored(r: float) -> float:
    """The log-ratio as the token store holds it: both log-probs rounded to float32."""
    return float(np.float32(LP + r)) - float(np.float32(LP))


def k3(r: float) -> float:
    return math.expm1(stored(r)) - stored(r)


def chi2(r: float) -> float:
    return math.exp(2 * stored(r)) - 1.0


# A uniform run's log-ratio is one positive constant on every token: what a training side
# renormalized over a nucleus looks like (truncated_support, an integrity error). The gate
# tests here are about bounds, so they accept that finding by name, as a user would.
ACCEPT_UNIFORM = ["--accept", "truncated_support"]


def per_sequence_run(path: Path, r: np.ndarray, length: int = 5) -> Path:
    """One response per entry of ``r``, every token of response i with log-ratio ``r[i]``."""
    seqs = [Seq([f"t{j}" for j in range(length)], [LP] * length, [LP + x] * length,
                [False] * length) for x in r]  # fmt: skip
    return make_run(path, seqs)


def edit_run_json(run: Path, **changes: Any) -> Path:
    """Change fields of ``run.json``: ``model__config_sha256="x"`` sets run["model"][...]."""
    data = json.loads((run / "run.json").read_text())
    for key, value in changes.items():
        *parents, last = key.split("__")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    (run / "run.json").write_text(json.dumps(data))
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("baseline")
    return {
        "main": str(uniform_run(base / "main", 0.01, LENGTHS)),
        "pr": str(uniform_run(base / "pr", 0.03, LENGTHS)),
        "small": str(uniform_run(base / "small", 0.03, [4, 6])),
    }


# --- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("k3_kl=1.5x", Increase("k3_kl", "factor", 1.5)),
        (" chi2_token = 2X ", Increase("chi2_token", "factor", 2.0)),
        ("f_tau_2=+0.001", Increase("f_tau_2", "absolute", 0.001)),
        ("kl=+0", Increase("kl", "absolute", 0.0)),
    ],
)
def test_parse_increase(spec: str, expected: Increase) -> None:
    assert parse_increase(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("k3_kl=1.5", "expected METRIC=FACTORx or METRIC=+AMOUNT"),
        ("k3_kl", "expected METRIC=FACTORx"),
        ("k3_kl=abcx", "'abc' is not a number"),
        ("k3_kl=0x", "a factor must be a finite number > 0"),
        ("k3_kl=infx", "a factor must be a finite number > 0"),
        ("f_tau_2=+-1", "an amount ≥ 0"),
    ],
)
def test_parse_increase_rejects(spec: str, message: str) -> None:
    with pytest.raises(ProbeError, match=re.escape(message)):
        parse_increase(spec)


@pytest.mark.parametrize(
    ("kind", "amount", "value", "base", "passed"),
    [
        ("factor", 1.5, 0.0149, 0.01, True),
        ("factor", 1.5, 0.0151, 0.01, False),
        ("factor", 1.5, 0.015, 0.01, True),  # the limit itself holds
        ("factor", 2.0, 1e-12, 0.0, False),  # any growth from 0 fails a factor
        ("absolute", 0.001, 0.0109, 0.01, True),
        ("absolute", 0.001, 0.0111, 0.01, False),
        ("absolute", 0.0, -0.03, -0.01, True),  # kl fell: no increase
    ],
)
def test_point_rule(kind: str, amount: float, value: float, base: float, passed: bool) -> None:
    assert IncreaseResult(Increase("m", kind, amount), value, base, 0.95).passed is passed


# --- the gate on runs whose metrics are known by hand ------------------------------------------


def test_growth_over_the_baseline(
    runs: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Every token: r = 0.01 in main, 0.03 in the PR, so k3_kl grows by k3(0.03)/k3(0.01) =
    9.06x and chi2_token by chi2(0.03) - chi2(0.01) = +0.0416; every sequence is alike, so
    the bootstrap intervals collapse onto the points."""
    ratio = k3(0.03) / k3(0.01)
    delta = chi2(0.03) - chi2(0.01)
    assert 9.0 < ratio < 9.1 and 0.041 < delta < 0.042
    args = ["check", runs["pr"], "--baseline", runs["main"], "--max", "k3_kl=0.01"]
    args += ACCEPT_UNIFORM
    args += ["--max-increase", "k3_kl=9.1x", "--max-increase", "chi2_token=+0.042"]
    args += ["--max-increase", "kl=+0"]
    code, out = run_main(args, monkeypatch, capsys)
    assert code == 0, out
    every = out.splitlines()
    start = every.index(f"baseline {runs['main']}")
    assert "error (accepted) truncated_support" in out  # the finding is said, and accepted
    lines = every[start:]
    assert lines[0] == f"baseline {runs['main']}"
    assert lines[1] == f"✔ PASS  k3_kl = {k3(0.03):.6g} ≤ 0.01 (max)"
    assert lines[2] == (
        f"✔ PASS  k3_kl = {k3(0.03):.6g} vs baseline {k3(0.01):.6g}: ×{ratio:.3g} ≤ ×9.1 "
        "(max increase)"
    )
    assert lines[3].startswith(
        f"        95% CI: head [{k3(0.03):.4g}, {k3(0.03):.4g}], "
        f"baseline [{k3(0.01):.4g}, {k3(0.01):.4g}]; head − 9.1×base in ["
    )
    assert lines[4] == (
        f"✔ PASS  chi2_token = {chi2(0.03):.6g} vs baseline {chi2(0.01):.6g}: {delta:+.4g} "
        "≤ +0.042 (max increase)"
    )
    assert lines[6] == (
        f"✔ PASS  kl = {-stored(0.03):.6g} vs baseline {-stored(0.01):.6g}: "
        f"{stored(0.01) - stored(0.03):+.4g} ≤ +0 (max increase)"
    )
    assert lines[-1] == "all bounds hold"

    args = ["check", runs["pr"], "--baseline", runs["main"]]
    args += ["--max-increase", "k3_kl=9x", "--max-increase", "chi2_token=+0.041"]
    code, out = run_main([*args, *ACCEPT_UNIFORM], monkeypatch, capsys)
    assert code == 1
    every = out.splitlines()
    lines = every[every.index(f"baseline {runs['main']}") :]
    assert lines[1].startswith(
        f"✘ FAIL  k3_kl = {k3(0.03):.6g} vs baseline {k3(0.01):.6g}: ×{ratio:.3g} > ×9 "
        f"(max increase) by {k3(0.03) - 9 * k3(0.01):.4g}"
    )
    assert lines[2].endswith("(above 0: significant)")
    assert lines[3].startswith("✘ FAIL  chi2_token") and lines[-1] == "2 of 2 bounds failed"


def test_small_runs_are_compared_point_to_point(
    runs: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = ["check", runs["small"], "--baseline", runs["main"], "--max-increase", "k3_kl=10x"]
    code, out = run_main(args, monkeypatch, capsys)
    assert code == 0 and "CI" not in out  # 2 sequences: no interval


def test_runs_that_measure_different_things_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    main = edit_run_json(uniform_run(tmp_path / "main", 0.01, LENGTHS), prompts__sha256="p1")
    pr = edit_run_json(
        uniform_run(tmp_path / "pr", 0.01, LENGTHS, prompts="elsewhere/p.jsonl"),
        prompts__sha256="p1",
    )
    base = ["check", str(pr), "--baseline", str(main), "--max-increase", "k3_kl=1.5x"]
    code, out = run_main([*base, *ACCEPT_UNIFORM], monkeypatch, capsys)
    assert code == 0  # same prompts (hash), only the file's path differs
    edit_run_json(pr, model__config_sha256="def", prompts__sha256="p2", sampling__top_p=0.9)
    code, out = run_main(base, monkeypatch, capsys)
    assert code == 2
    assert out.strip() == (
        "error: the runs are not comparable: model config differs (head: def; baseline: abc); "
        "prompts differs (head: p2; baseline: p1); top_p differs (head: 0.9; baseline: 1.0) "
        "(--allow-different to gate them anyway)"
    )
    code, out = run_main([*base, "--allow-different", *ACCEPT_UNIFORM], monkeypatch, capsys)
    assert code == 0
    assert "⚠ model config differs (head: def; baseline: abc)" in out.splitlines()


def test_what_one_run_does_not_record_is_not_compared() -> None:
    """A baseline scanned by an older version has no prompts hash: the file names are
    compared instead (not their directories, which differ between two checkouts)."""
    head = {"model": {"config_sha256": "a"}, "prompts": {"path": "/pr/p.jsonl", "sha256": "h"}}
    base: dict[str, Any] = {"model": {"config_sha256": "a"}, "prompts": {"path": "/main/p.jsonl"}}
    assert differences(head, base) == []
    base["prompts"]["path"] = "/main/q.jsonl"
    assert differences(head, base) == ["prompts file differs (head: p.jsonl; baseline: q.jsonl)"]
    base["prompts"]["sha256"] = "h"
    assert differences(head, base) == []  # the same prompts, whatever the files are called


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-increase", "k3_kl=1.5x"], "error: --max-increase needs --baseline"),
        (["--baseline", "{main}"], "error: --baseline needs at least one --max-increase"),
        (
            ["--baseline", "{main}", "--max-increase", "k3kl=2x"],
            "error: --max-increase k3kl: the run has no such metric (did you mean k3_kl",
        ),
        (
            ["--baseline", "{main}", "--max-increase", "k3_kl=2x", "--significance", "1"],
            "error: --significance 1: a confidence level in (0, 1)",
        ),
        (["--baseline", "{main}", "--max-increase", "k3_kl=2"], "expected METRIC=FACTORx"),
        (
            ["--baseline", "{nowhere}", "--max-increase", "k3_kl=2x"],
            "is not a run directory",
        ),
    ],
)
def test_bad_usage_exits_2(
    runs: dict[str, str],
    tmp_path: Path,
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    filled = [a.format(nowhere=tmp_path / "nope", **runs) for a in args]
    code, out = run_main(["check", runs["pr"], *filled], monkeypatch, capsys)
    assert code == 2 and message in out
    assert "PASS" not in out and "FAIL" not in out


# --- the bootstrap -----------------------------------------------------------------------------


def test_point_of_the_bootstrap_is_the_metric(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", mixed_seqs())
    stored = json.loads((run / "metrics.json").read_text())
    stats = bootstrap.sequence_stats(run)
    assert stats.num_sequences == 3 and stats.n.tolist() == [7.0, 7.0, 5.0]
    for metric in bootstrap.TERMS:
        assert stats.value(metric) == pytest.approx(stored[metric], rel=1e-12)


def test_standard_error_of_a_mean(tmp_path: Path) -> None:
    """Equal lengths make k3_kl the mean of the per-sequence k3(r_i); the bootstrap's standard
    error must be the plug-in one, sd/sqrt(S) with the 1/S variance. Its Monte Carlo relative
    error with B = 2000 is about 1/sqrt(2B) = 1.6%, so 8% is five of those."""
    r = 0.2 * np.random.default_rng(7).standard_normal(400)
    stats = bootstrap.sequence_stats(per_sequence_run(tmp_path / "run", r))
    (reps,) = bootstrap.replicates([stats], "k3_kl")
    per_seq = np.expm1(r) - r
    plug_in = per_seq.std(ddof=0) / math.sqrt(len(r))
    assert reps.std(ddof=1) == pytest.approx(plug_in, rel=0.08)
    lo, hi = bootstrap.interval(reps, 0.95)
    assert lo < per_seq.mean() < hi
    assert (hi - lo) == pytest.approx(2 * 1.959964 * plug_in, rel=0.15)  # near normal
    again = bootstrap.replicates([bootstrap.sequence_stats(tmp_path / "run")], "k3_kl")[0]
    assert np.array_equal(reps, again)  # fixed seed: the same interval every time


def test_paired_runs_share_one_draw(tmp_path: Path) -> None:
    r = 0.2 * np.random.default_rng(1).standard_normal(40)
    a = bootstrap.sequence_stats(per_sequence_run(tmp_path / "a", r))
    b = bootstrap.sequence_stats(per_sequence_run(tmp_path / "b", 2 * r))
    assert bootstrap.paired([a, b])
    reps_a, reps_b = bootstrap.replicates([a, a], "chi2_token")
    assert np.array_equal(reps_a, reps_b)  # the same run twice: identical replicates
    shifted = bootstrap.SeqStats(b.seq_id + 1000, b.n, b.sums)
    assert not bootstrap.paired([a, shifted])
    ra, rb = bootstrap.replicates([a, shifted], "chi2_token")
    assert not np.array_equal(ra, rb)


def test_noise_passes_and_a_real_increase_fails(tmp_path: Path) -> None:
    """Two draws of the same distribution: the PR's point is above the baseline's but the
    interval of head - base includes 0 (noise, passes ``1.0x``); the same draw scaled by 1.5
    (k3 about 2.25x) fails ``1.5x`` significantly."""
    rng = np.random.default_rng(3)
    r_main, r_pr = (0.2 * rng.standard_normal(60) for _ in range(2))
    main = per_sequence_run(tmp_path / "main", r_main)
    noisy = per_sequence_run(tmp_path / "noisy", r_pr)
    worse = per_sequence_run(tmp_path / "worse", 1.5 * r_main)
    result = gate(CheckConfig.from_options(noisy, baseline=main, increases=["k3_kl=1.0x"]))
    (res,) = result.increases
    assert res.value > res.base and not res.point_passed  # above the limit, point-wise
    assert res.excess_ci is not None and res.excess_ci[0] <= 0 < res.excess_ci[1]
    assert result.passed
    cfg = CheckConfig.from_options(worse, baseline=main, increases=["k3_kl=1.5x"])
    (res,) = gate(cfg).increases
    assert res.excess_ci is not None and res.excess_ci[0] > 0 and not res.passed


def test_an_overflowing_term_gets_no_interval(tmp_path: Path) -> None:
    r = np.full(30, 0.01)
    r[0] = 800.0  # exp(800) overflows float64: k3_kl is capped and flagged, no interval
    stats = bootstrap.sequence_stats(per_sequence_run(tmp_path / "run", r))
    assert not stats.usable("k3_kl") and stats.usable("chi2_token")


def test_one_setting_of_a_matrix_store(tmp_path: Path) -> None:
    """A store holding several settings: the sums cover the chosen setting's rows only."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from mismatch_probe import store
    from mismatch_probe.metrics import compute_metrics
    from tests.test_report_fixtures import token_table, uniform_seqs

    first = token_table(uniform_seqs(0.01, [4, 6]), "fp16")
    second = token_table(uniform_seqs(0.05, [5, 3, 2]), "bf16")
    second = second.set_column(1, "seq_id", pc.add(second.column("seq_id"), 10))
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / store.TOKENS_FILE
    store.write_table(path, pa.concat_tables([first, second]), store.TOKEN_SCHEMA, {})
    for setting, ids in (("fp16", [0, 1]), ("bf16", [10, 11, 12])):
        stats = bootstrap.sequence_stats(tmp_path / "m", setting)
        assert stats.seq_id.tolist() == ids
        expected = compute_metrics(path, setting=setting).scalars
        for metric in bootstrap.TERMS:
            assert stats.value(metric) == pytest.approx(expected[metric], rel=1e-12)
