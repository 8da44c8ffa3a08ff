"""Metrics on small hand-made batches, expected values derived by hand in each test.

Every case runs twice: the dense reference and the streaming engine over a Parquet file written
in 2-row groups (so sequences straddle row groups); both must agree before the hand values are
checked. Masked means divide by ``count + 1e-8``, hence ``approx(rel=1e-7)``.

Batch A (``r = train - rollout``; ``.`` = padding)::

    seq 0: train [0, -1, -ln2]   rollout [-ln4, -1, 0]   r [ln4, 0, -ln2]   rho [4, 1, 0.5]
    seq 1: train [-2, ., .]      rollout [-2, ., .]      r [0]              rho [1]
    seq 2: empty (all padding)

N = 4 valid tokens, S = 3 sequences, 2 valid; support_flip only on seq 0 position 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics import MetricsConfig, compute_metrics
from mismatch_probe.metrics.accum import FLOAT_MAX
from tests.oracle.reference import Dense, make_dense, reference_metrics, to_table

LN2, LN4 = math.log(2.0), math.log(4.0)
NO_PRESETS = {"presets": ()}


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-7, abs=1e-12)


def batch_a() -> Dense:
    train = [[0.0, -1.0, -LN2], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    rollout = [[-LN4, -1.0, 0.0], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    mask = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    flip = [[True, False, False], [False] * 3, [False] * 3]
    return make_dense(train, rollout, mask, flip=flip, token_ids=np.arange(9).reshape(3, 3))


def both(d: Dense, cfg: MetricsConfig, tmp_path: Path) -> dict:
    """Streaming result (checked equal to the reference); ``_curves`` holds the curves."""
    ref = reference_metrics(d, cfg)
    path = tmp_path / "tokens.parquet"
    pq.write_table(to_table(d), path, row_group_size=2)
    got = compute_metrics(path, cfg)
    assert got.flat().keys() == ref.flat().keys()
    for key, value in ref.flat().items():
        assert got.flat()[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    return {**got.flat(), "_curves": got.curves}


def test_token_tis(tmp_path: Path) -> None:
    # raw_w = [4, 1, 0.5, 1]; w = min(raw_w, 2) = [2, 1, 0.5, 1]
    m = both(batch_a(), MetricsConfig(**NO_PRESETS), tmp_path)
    assert m["rollout_is_mean"] == approx(4.5 / 4)
    assert (m["rollout_is_max"], m["rollout_is_min"]) == (2.0, 0.5)
    assert m["rollout_is_ratio_fraction_high"] == approx(1 / 4)  # raw 4 > 2
    assert m["rollout_is_ratio_fraction_low"] == 0.0  # raw 0.5 is not < 1/2: exactly at L
    # mmean(w^2) = 6.25/4, mmean(w)^2 = 1.125^2
    assert m["rollout_is_std"] == approx(math.sqrt(6.25 / 4 - 1.125**2))
    assert m["rollout_is_eff_sample_size"] == approx(1.125**2 / (6.25 / 4))  # 0.81
    # q = [3.5/3, 1, 0] over all three sequences (the empty one gives 0)
    q = [3.5 / 3, 1.0, 0.0]
    assert m["rollout_is_seq_mean"] == approx(sum(q) / 3)
    assert m["rollout_is_seq_std"] == approx(float(np.std(q, ddof=1)))
    assert (m["rollout_is_seq_max"], m["rollout_is_seq_min"]) == (approx(3.5 / 3), 0.0)
    assert m["rollout_is_seq_max_deviation"] == approx(1.0)  # |0 - 1| of the empty sequence
    # q' = [5.5/3, 1, 0]: none above 2, the empty one below 1/2
    assert m["rollout_is_seq_fraction_high"] == 0.0
    assert m["rollout_is_seq_fraction_low"] == approx(1 / 3)
    assert "rollout_is_oob_ratio" not in m and "rollout_is_batch_norm_factor" not in m


def test_sequence_tis(tmp_path: Path) -> None:
    # s = [ln4 + 0 - ln2, 0, 0] = [ln2, 0, 0]; raw_w = 2 on seq 0's tokens, 1 on seq 1's
    cfg = MetricsConfig(rollout_is="sequence", batch_normalize=True, **NO_PRESETS)
    m = both(batch_a(), cfg, tmp_path)
    assert m["rollout_is_mean"] == approx(7 / 4)
    assert m["rollout_is_max"] == 2.0 and m["rollout_is_min"] == 1.0  # exp(max s), exp(min s)
    assert m["rollout_is_ratio_fraction_high"] == 0.0  # s = ln 2 is not > ln 2
    assert m["rollout_is_std"] == approx(math.sqrt(13 / 4 - 1.75**2))
    assert m["rollout_is_eff_sample_size"] == approx(1.75**2 / (13 / 4))
    assert m["rollout_is_seq_mean"] == approx(1.0)  # q = [2, 1, 0]
    assert m["rollout_is_seq_std"] == approx(1.0)
    assert m["rollout_is_seq_fraction_low"] == approx(1 / 3)
    # batch norm: mean of q over the two valid sequences
    assert m["rollout_is_batch_norm_factor"] == approx(1.5)


def test_icepop_keeps_weights_at_the_bounds(tmp_path: Path) -> None:
    # [0.5, 2]: raw 4 -> 0; raw 0.5 (exactly L) and 1 are kept
    cfg = MetricsConfig(rollout_is_threshold="0.5_2.0", batch_normalize=True, **NO_PRESETS)
    m = both(batch_a(), cfg, tmp_path)
    assert m["rollout_is_mean"] == approx(2.5 / 4)
    assert (m["rollout_is_max"], m["rollout_is_min"]) == (1.0, 0.0)
    assert m["rollout_is_oob_ratio"] == approx(1 / 4)
    assert m["rollout_is_batch_norm_factor"] == approx(2.5 / 4)


def test_icepop_dropping_everything_gives_zero_ess(tmp_path: Path) -> None:
    m = both(batch_a(), MetricsConfig(rollout_is_threshold="5_6", **NO_PRESETS), tmp_path)
    assert m["rollout_is_mean"] == 0.0 and m["rollout_is_eff_sample_size"] == 0.0
    assert m["rollout_is_oob_ratio"] == approx(1.0)


def test_rs_token_k1_drops_only_the_outside_token(tmp_path: Path) -> None:
    # k1 = -r = [-ln4, 0, ln2, 0]; keep ln(0.5) <= k1 <= ln 2: drops seq 0 position 0 only
    cfg = MetricsConfig(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0", **NO_PRESETS)
    m = both(batch_a(), cfg, tmp_path)
    p = "rollout_rs_token_k1"
    assert m[f"{p}_masked_fraction"] == approx(1 / 4)
    assert m[f"{p}_seq_masked_fraction"] == approx(1 / 2)  # among the 2 valid sequences
    assert m["rollout_rs_seq_masked_fraction"] == approx(1 / 3)  # among all 3
    assert m[f"{p}_mean"] == approx(-LN2 / 4)
    assert (m[f"{p}_max"], m[f"{p}_min"]) == (approx(LN2), approx(-LN4))
    assert m[f"{p}_fraction_high"] == 0.0  # ln 2 is at the bound
    assert m[f"{p}_fraction_low"] == approx(1 / 4)
    # clamp to [-ln2, ln2] -> [-ln2, 0, ln2, 0]: mean 0, mean square ln2^2 / 2
    assert m[f"{p}_std"] == approx(LN2 / math.sqrt(2))
    # v = mmean_i(k1) over valid sequences = [-ln2/3, 0]
    assert m[f"{p}_seq_mean"] == approx(-LN2 / 6)
    assert m[f"{p}_seq_std"] == approx(LN2 / 3 / math.sqrt(2))
    assert m[f"{p}_seq_max_deviation"] == approx(LN2 / 3)
    assert m[f"{p}_seq_fraction_low"] == 0.0


def test_rs_single_number_for_k1_means_reciprocal_bounds(tmp_path: Path) -> None:
    a = both(batch_a(), MetricsConfig(rollout_rs="token_k1", rollout_rs_threshold="2"), tmp_path)
    b = both(
        batch_a(), MetricsConfig(rollout_rs="token_k1", rollout_rs_threshold="0.5_2"), tmp_path
    )
    assert a == b


def test_rs_chained_options_and_sequence_max(tmp_path: Path) -> None:
    # seq_max_k3: k3 = exp(r) - 1 - r = [3 - ln4, 0, ln2 - 0.5 | 0]; v = [3 - ln4, 0]
    cfg = MetricsConfig(
        rollout_rs="token_k1,seq_max_k3,token_k1",  # the duplicate is ignored
        rollout_rs_threshold="0.5_2.0,0.5",
        **NO_PRESETS,
    )
    m = both(batch_a(), cfg, tmp_path)
    p = "rollout_rs_seq_max_k3"
    assert (m[f"{p}_max"], m[f"{p}_min"]) == (approx(3 - LN4), 0.0)
    assert m[f"{p}_masked_fraction"] == approx(3 / 4)  # all of seq 0
    assert m[f"{p}_seq_masked_fraction"] == approx(1 / 2)
    assert m[f"{p}_fraction_low"] == 0.0 and f"{p}_seq_fraction_low" not in m
    # token-weighted mean of the broadcast sequence value: (3 * (3 - ln4) + 0) / 4
    assert m[f"{p}_mean"] == approx(3 * (3 - LN4) / 4)
    assert m["rollout_rs_masked_fraction"] == approx(3 / 4)
    assert m["rollout_rs_seq_masked_fraction"] == approx(1 / 3)


def test_offpolicy(tmp_path: Path) -> None:
    m = both(batch_a(), MetricsConfig(rollout_is=None, **NO_PRESETS), tmp_path)
    assert m["kl"] == approx(-(LN4 - LN2) / 4)  # mmean(rollout - train) = mmean(-r)
    assert m["k3_kl"] == approx(((3 - LN4) + (LN2 - 0.5)) / 4)
    # per-sequence mean log-probs: train [-(1+ln2)/3, -2, 0], rollout [-(1+2ln2)/3, -2, 0]
    assert m["training_ppl"] == approx((math.exp((1 + LN2) / 3) + math.exp(2) + 1) / 3)
    assert m["training_log_ppl"] == approx(((1 + LN2) / 3 + 2) / 3)
    assert m["rollout_ppl"] == approx((math.exp((1 + 2 * LN2) / 3) + math.exp(2) + 1) / 3)
    # d = rollout mean - train mean = [-ln2/3, 0, 0]
    assert m["log_ppl_diff"] == approx(-LN2 / 9)
    assert m["log_ppl_abs_diff"] == approx(LN2 / 9)
    assert (m["log_ppl_diff_max"], m["log_ppl_diff_min"]) == (0.0, approx(-LN2 / 3))
    assert m["ppl_ratio"] == approx((2 ** (-1 / 3) + 2) / 3)
    assert m["chi2_token"] == approx((16 + 1 + 0.25 + 1) / 4 - 1)
    assert m["chi2_seq"] == approx((4 + 1 + 1) / 3 - 1)  # exp(2 s) with s = [ln2, 0, 0]
    assert m["k3_kl_overflow"] == 0.0 and m["ppl_overflow"] == 0.0
    assert "rollout_is_mean" not in m


def test_diagnostics(tmp_path: Path) -> None:
    m = both(batch_a(), MetricsConfig(**NO_PRESETS), tmp_path)
    # dp = |p_train - p_rollout| = [0.75, 0, 0.5 | 0]
    assert m["prob_abs_diff_mean"] == approx(1.25 / 4)
    assert m["prob_abs_diff_max"] == 0.75
    assert m["seq_prob_abs_diff_max_mean"] == approx(0.75 / 3)
    assert m["seq_prob_abs_diff_max_gt_0.5"] == approx(1 / 3)
    assert m["ipo_masked_fraction_0.1"] == approx(2 / 4)
    assert m["ipo_masked_fraction_0.3"] == approx(2 / 4)
    # max(rho, 1/rho) = [4, 1, 2, 1]: 2 is not > 2
    assert m["f_tau_1.01"] == approx(2 / 4) and m["f_tau_1.5"] == approx(2 / 4)
    assert m["f_tau_2"] == approx(1 / 4)
    assert m["f_tau_5"] == 0.0
    assert m["log_ratio_abs_mean"] == approx(3 * LN2 / 4) and m["log_ratio_abs_max"] == LN4
    p_train = [1.0, math.exp(-1), 0.5, math.exp(-2)]
    p_rollout = [0.25, math.exp(-1), 1.0, math.exp(-2)]
    assert m["prob_pearson"] == pytest.approx(_pearson(p_train, p_rollout), rel=1e-12)
    # (length, s): (3, ln2), (1, 0) -> slope ln2 / (2 / 1000)
    assert m["seq_log_ratio_slope_per_1k"] == approx(500 * LN2)
    # the flip token carries |r| = ln4 of 3 ln2, and k3 (3 - ln4) of (3 - ln4) + (ln2 - 0.5)
    assert m["support_flip_fraction"] == approx(1 / 4)
    assert m["support_flip_abs_log_ratio_share"] == approx(2 / 3)
    assert m["support_flip_k3_share"] == approx((3 - LN4) / (2.5 - LN2))


def _pearson(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy)


def test_curves(tmp_path: Path) -> None:
    c = both(batch_a(), MetricsConfig(**NO_PRESETS), tmp_path)["_curves"]
    worst = [(w["seq_id"], w["position"], w["log_ratio"]) for w in c["worst_tokens"]]
    assert worst == [(0, 0, LN4), (0, 2, -LN2), (0, 1, 0.0), (1, 0, 0.0)]
    assert c["worst_tokens"][0]["token_id"] == 0 and c["worst_tokens"][0]["support_flip"]
    hist = c["log_ratio_hist"]
    assert sum(hist["counts"]) == 4 and hist["underflow"] == hist["overflow"] == 0
    assert hist["counts"][int((LN4 + 3) / (6 / 121))] == 1 and hist["counts"][60] == 2
    first = c["position_bins"][0]
    assert (first["lo"], first["hi"], first["count"]) == (0, 8, 4)
    assert first["mean_abs_log_ratio"] == approx(3 * LN2 / 4)
    assert first["abs_log_ratio_share"] == approx(1.0)
    # p_rollout = [0.25, e^-1, 1, e^-2] -> bins [0.2,0.3), [0.3,0.4), [0.99,1], [0.1,0.2)
    counts = [row["count"] for row in c["rollout_prob_bins"]]
    assert counts == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    assert c["rollout_prob_bins"][-1]["mean_abs_log_ratio"] == approx(LN2)
    sample = c["seq_log_ratio_vs_length"]
    assert (sample["seq_id"], sample["length"]) == ([0, 1], [3, 1])
    assert sample["log_ratio_sum"] == [approx(LN2), 0.0]
    f_tau = {row["tau"]: row["fraction"] for row in c["f_tau"]}
    assert f_tau[2.0] == approx(1 / 4) and f_tau[3.0] == approx(1 / 4)
    assert sum(map(sum, c["prob_hist2d"]["counts"])) == 4


def test_presets(tmp_path: Path) -> None:
    names = ("token_is", "token_icepop", "seq_is_rs", "geo_rs", "k3_rs")
    m = both(batch_a(), MetricsConfig(presets=names), tmp_path)
    assert m["presets/token_is/token_masked_fraction"] == 0.0
    assert m["presets/token_is/eff_sample_size"] == m["rollout_is_eff_sample_size"]
    # IcePop [0.5, 5]: every raw weight [4, 1, 0.5, 1] survives
    assert m["presets/token_icepop/token_masked_fraction"] == 0.0
    assert m["presets/token_icepop/eff_sample_size"] == approx(1.625**2 / (18.25 / 4))
    # seq_sum_k1 [0.5, 2]: v = -s = [-ln2, 0] is inside, so only sequence TIS remains
    assert m["presets/seq_is_rs/token_masked_fraction"] == 0.0
    assert m["presets/seq_is_rs/eff_sample_size"] == approx(1.75**2 / (13 / 4))
    # geo_rs keeps |mmean_i(r)| <= ~0.001 and k3_rs mmean_i(k3) <= 0.01: both drop seq 0
    for name in ("geo_rs", "k3_rs"):
        assert m[f"presets/{name}/token_masked_fraction"] == approx(3 / 4)
        assert m[f"presets/{name}/seq_masked_fraction"] == approx(1 / 3)
        assert m[f"presets/{name}/eff_sample_size"] == approx(1 / 4)  # = kept share


def test_single_token(tmp_path: Path) -> None:
    d = make_dense([[0.0]], [[-LN2]], [[1]])
    m = both(d, MetricsConfig(), tmp_path)
    assert m["rollout_is_mean"] == approx(2.0) and m["rollout_is_ratio_fraction_high"] == 0.0
    assert m["rollout_is_std"] == 0.0 and m["rollout_is_seq_std"] == 0.0  # fewer than 2
    assert m["rollout_is_eff_sample_size"] == approx(1.0)
    assert m["seq_log_ratio_slope_per_1k"] == 0.0 and m["prob_pearson"] == 0.0
    assert (m["num_tokens"], m["num_sequences"]) == (1.0, 1.0)


def test_extreme_log_ratios_stay_finite(tmp_path: Path) -> None:
    # r = +1000, -inf (train floored at -9999, so r = -9998.5) and -1000
    d = make_dense([[0.0], [-math.inf], [-1000.0]], [[-1000.0], [-0.5], [0.0]], [[1], [1], [1]])
    cfg = MetricsConfig(rollout_is="sequence", rollout_rs="seq_sum_k3", rollout_rs_threshold="1")
    m = both(d, cfg, tmp_path)
    assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
    assert m["k3_kl"] == FLOAT_MAX and m["k3_kl_overflow"] == 1.0
    assert m["training_ppl"] == FLOAT_MAX and m["ppl_overflow"] == 1.0  # exp(1000)
    assert m["kl"] == approx(-(1000.0 - 9998.5 - 1000.0) / 3)
    assert m["rollout_is_max"] == approx(math.exp(20.0)) and m["rollout_is_min"] == 0.0
    assert m["chi2_token"] == approx((math.exp(40.0) + 2 * math.exp(-40.0)) / 3 - 1)
    assert m["log_ratio_abs_max"] == 9998.5
    assert m["f_tau_10"] == approx(1.0)


def test_no_valid_token_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="no valid response token"):
        make_dense([[0.0, 0.0]], [[0.0, 0.0]], [[0, 0]])
    path = tmp_path / "empty.parquet"
    d = make_dense([[0.0, 0.0]], [[0.0, 0.0]], [[1, 0]])
    table = to_table(d)
    pq.write_table(table.slice(1), path)  # only the padding row
    with pytest.raises(ProbeError, match="no valid response token"):
        compute_metrics(path)


def test_shape_mismatch_names_both_shapes() -> None:
    with pytest.raises(ProbeError, match=r"\(2, 3\).*\(2, 2\)"):
        make_dense(np.zeros((2, 3)), np.zeros((2, 2)), np.ones((2, 3)))


def test_nan_log_prob_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="train_logprob holds NaN"):
        make_dense([[math.nan]], [[0.0]], [[1]])
