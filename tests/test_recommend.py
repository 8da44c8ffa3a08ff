"""The recommendation rule (spec section 7) on crafted stores, one per outcome, and where it
shows: metrics.json, ``probe metrics --json``, report.md's first sentence, the PR comment and
every setting of a matrix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from mismatch_probe import store
from mismatch_probe.cli import main
from mismatch_probe.metrics import MetricsConfig, compute_metrics
from mismatch_probe.metrics.recommend import CONCENTRATED, Recommendation, pct, recommend
from mismatch_probe.pipeline.publish import publish
from mismatch_probe.report.comment import run_comment
from mismatch_probe.report.markdown import escape
from mismatch_probe.rundir import load_report

SEQS, LEN = 200, 20
SETTING = "rollout=bf16 | train=fp32"


def log_ratios(kind: str, seed: int = 0) -> np.ndarray:
    """``[SEQS, LEN]`` ``r`` for each crafted case."""
    rng = np.random.default_rng(seed)
    if kind == "identical":  # k3 about 5e-9: nothing to correct
        return rng.normal(0.0, 1e-4, (SEQS, LEN))
    if kind == "diffuse":  # k3 about 1e-3, weights within [0.8, 1.25]: token TIS is harmless
        return np.clip(rng.normal(0.0, 0.05, (SEQS, LEN)), -0.2, 0.2)
    if kind == "heavy":  # every preset either masks over 1% or leaves an ESS below 0.9
        return rng.normal(0.0, 1.0, (SEQS, LEN))
    r = rng.normal(0.0, 1e-3, (SEQS, LEN))  # "concentrated": two sequences carry it all
    r[3, 5], r[77, 0] = 4.0, -3.0
    return r


def tokens(r: np.ndarray, setting: str = SETTING, first_seq: int = 0) -> pa.Table:
    s, t = r.shape
    rollout = np.full((s, t), -6.0)  # low enough that train = rollout + r stays below 0
    return pa.table(
        {
            "setting": [setting] * (s * t),
            "seq_id": np.repeat(np.arange(first_seq, first_seq + s), t),
            "prompt_id": np.repeat(np.arange(s), t),
            "sample_id": np.zeros(s * t, np.int32),
            "position": np.tile(np.arange(t), s).astype(np.int32),
            "token_id": np.zeros(s * t, np.int32),
            "token_text": ["x"] * (s * t),
            "rollout_logprob": rollout.ravel().astype(np.float32),
            "train_logprob": np.minimum(rollout + r, 0.0).ravel().astype(np.float32),
            "support_flip": np.zeros(s * t, bool),
        }
    )


def write_run(path: Path, *tables: pa.Table) -> Path:
    path.mkdir(parents=True)
    table = pa.concat_tables(tables)
    store.write_table(path / store.TOKENS_FILE, table, store.TOKEN_SCHEMA, {})
    settings = list(dict.fromkeys(table.column("setting").to_pylist()))
    run = {"setting": settings[0], "settings": settings, "model": {"name": "tiny"}}
    store.write_json(path / store.RUN_FILE, run)
    return path


def decide(
    path: Path, errors: tuple[str, ...] = (), config: MetricsConfig | None = None
) -> Recommendation:
    result = compute_metrics(path, config)
    sweep = result.tables["threshold_sweep"]
    return recommend(result.flat(), result.config.describe(), sweep, errors)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("recommend")
    kinds = ("identical", "diffuse", "heavy", "concentrated")
    return {k: write_run(base / k, tokens(log_ratios(k))) for k in kinds}


def test_none_needed(runs: dict[str, Path]) -> None:
    rec = decide(runs["identical"])
    assert rec.outcome == "none_needed" and rec.preset is None
    assert rec.reason.startswith("None needed: no verdict fails and k3_kl is ")


def test_a_mild_run_gets_a_reweighting_preset(runs: dict[str, Path]) -> None:
    """Issue 29: k3_rs drops no sequence (every mean k3 is below 0.01), so it leaves every
    weight at 1: an ESS of 1 by construction (stored clamped, never above 1), which says nothing
    about a correction. Only presets with IS weights are candidates: token TIS wins."""
    metrics = compute_metrics(runs["diffuse"]).flat()
    assert metrics["k3_kl"] > 1e-4 and metrics["outlier_share_top1pct"] < CONCENTRATED
    assert metrics["presets/k3_rs/token_masked_fraction"] == 0.0
    assert metrics["presets/k3_rs/eff_sample_size"] == 1.0  # 1.00000002 before the clamp
    ess = {k: v for k, v in metrics.items() if k.endswith("eff_sample_size")}
    assert len(ess) > 5 and max(ess.values()) <= 1.0
    rec = decide(runs["diffuse"])
    token_ess = metrics["presets/token_is/eff_sample_size"]
    assert 0.9 <= token_ess < 0.999
    assert (rec.outcome, rec.preset, rec.ess, rec.masked_token_fraction) == (
        "preset", "token_is", token_ess, 0.0
    )  # fmt: skip
    assert rec.reason == (
        f"Token TIS at C=2 would truncate 0% of tokens and keep the effective sample size at "
        f"{token_ess:.2f}: use it (preset token_is)."
    )
    # an RS part beside IS weights is a candidate; the simpler token_is wins the tie with
    # k3_rs_token_tis (the same weights, nothing masked)
    assert metrics["presets/k3_rs_token_tis/eff_sample_size"] == token_ess
    # pure rejection presets alone: nothing to choose from
    rs_only = MetricsConfig(presets=("k3_rs", "geo_rs"))
    rec = decide(runs["diffuse"], config=rs_only)
    assert (rec.outcome, rec.preset, rec.closest) == ("no_preset_fits", None, None)
    assert rec.reason == "No preset fits: no preset with IS weights was evaluated."


def test_ties_go_to_the_simplest(runs: dict[str, Path]) -> None:
    """Among the token presets, token_is and token_icepop keep every weight (none beyond 2 or
    below 0.5): the same ESS and no masking; token_is comes first."""
    metrics = compute_metrics(runs["diffuse"]).flat()
    ess = {p: metrics[f"presets/{p}/eff_sample_size"] for p in ("token_is", "token_icepop")}
    assert ess["token_is"] == ess["token_icepop"] >= 0.9
    config = MetricsConfig(presets=("token_icepop", "token_is", "seq_is"))
    rec = decide(runs["diffuse"], config=config)
    assert rec.preset == "token_is" and rec.ess == ess["token_is"]
    assert rec.reason == (
        f"Token TIS at C=2 would truncate 0% of tokens and keep the effective sample size at "
        f"{rec.ess:.2f}: use it (preset token_is)."
    )


def test_no_preset_fits_names_the_closest(runs: dict[str, Path]) -> None:
    metrics = compute_metrics(runs["heavy"]).flat()
    rec = decide(runs["heavy"])
    assert rec.outcome == "no_preset_fits" and rec.preset is None
    assert rec.closest is not None and rec.reason.startswith("No preset fits: the closest, ")
    p = f"presets/{rec.closest}"
    assert (rec.masked_token_fraction, rec.ess) == (
        metrics[f"{p}/token_masked_fraction"],
        metrics[f"{p}/eff_sample_size"],
    )
    assert rec.masked_token_fraction >= 0.01 or rec.ess < 0.9


def test_investigate_first_when_concentrated(runs: dict[str, Path]) -> None:
    share = compute_metrics(runs["concentrated"]).flat()["outlier_share_top1pct"]
    assert share > CONCENTRATED
    rec = decide(runs["concentrated"])
    assert rec.outcome == "investigate_first"
    assert rec.reason == (
        f"Investigate first: {pct(share)} of the mismatch sits in 1% of sequences, see Outliers."
    )


def test_investigate_first_on_an_integrity_error(runs: dict[str, Path]) -> None:
    rec = decide(runs["identical"], ("shifted_by_one",))
    assert rec.outcome == "investigate_first" and "shifted_by_one" in rec.reason


MILD = {"k3_kl": 1e-3, "outlier_share_top1pct": 0.9, "num_sequences": 99.0}


@pytest.mark.parametrize(
    ("extra", "blocking", "reason"),
    [
        ({}, ("trainer_copies_rollout",), "the training side equals the rollout side bit for"),
        ({}, ("trainer_copies_rollout", "positive_logprob"), "the integrity check positive_"),
        ({"k3_kl_overflow": 1.0}, (), "k3_kl_overflow is set"),
        ({"ppl_overflow": 1.0, "k3_kl_overflow": 0.0}, (), "ppl_overflow is set"),
        ({"num_sequences": 100.0}, (), "90% of the mismatch sits in 1% of sequences"),
    ],
)
def test_investigate_first_causes(extra: dict, blocking: tuple[str, ...], reason: str) -> None:
    """Rule 1 on flat metrics: a copy of the rollout side, an error, an overflow flag, the
    mismatch concentrated (from 100 sequences)."""
    rec = recommend({**MILD, **extra}, {"presets": {}}, (), blocking)
    assert rec.outcome == "investigate_first" and reason in rec.reason


def test_concentrated_under_100_sequences_says_nothing() -> None:
    """99 sequences: the top 1% is one sequence, so rule 1 does not apply."""
    rec = recommend(MILD, {"presets": {}})
    assert rec.outcome == "no_preset_fits"


def test_everywhere_it_shows(runs: dict[str, Path], monkeypatch, capsys) -> None:
    run = runs["diffuse"]
    ctx, entries = load_report(run)
    paths = publish(ctx, entries)
    stored = json.loads(paths["metrics"].read_text())["recommendation"]
    assert stored["outcome"] == "preset" and stored["preset"] == "token_is"
    sentence = f"**Recommendation:** {escape(stored['reason'])}"
    lines = paths["report"].read_text().splitlines()
    assert lines[2].startswith("✅ Data integrity: clean")  # integrity first (spec section 8)
    assert lines[4] == sentence
    assert sentence in run_comment(ctx)
    monkeypatch.setattr(sys, "argv", ["probe", "metrics", str(run), "--json"])
    main()
    assert json.loads(capsys.readouterr().out)["recommendation"] == stored
    ctx, _ = load_report(run, integrity_errors=["positive_logprob"])
    assert ctx.json_dict()["recommendation"]["outcome"] == "investigate_first"


def test_every_setting_of_a_matrix(tmp_path: Path) -> None:
    quiet = tokens(log_ratios("identical"), "rollout=fp32 | train=fp32")
    loud = tokens(log_ratios("heavy"), SETTING, first_seq=SEQS)
    run = write_run(tmp_path / "matrix", quiet, loud)
    ctx, entries = load_report(run)
    outcomes = {e.label: e.tables["recommendation"]["outcome"] for e in entries}
    assert outcomes == {"rollout=fp32 | train=fp32": "none_needed", SETTING: "no_preset_fits"}
    text = publish(ctx, entries)["report"].read_text()
    section = text.split("Recommendation per setting:")[1]
    for e in entries:
        assert escape(e.tables["recommendation"]["reason"]) in section
    comment = run_comment(ctx, entries)
    assert "#### Recommendation per setting" in comment
    for e in entries:
        assert escape(e.tables["recommendation"]["reason"]) in comment
    assert (run / "plots" / "settings" / "k3_by_setting.png").stat().st_size > 10_000
    assert "](plots/settings/k3_by_setting.png)" in section
    drawn = {p.stem for p in (run / "plots").iterdir()}
    assert {"threshold_sweep", "seq_weights"} <= drawn
    assert "entropy" not in drawn  # these stores hold no train_entropy: no empty figure
