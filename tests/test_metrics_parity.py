"""Section 6 of the metric spec (NeMo-RL / TorchTitan names, bitwise measures), hand-computed.

Each case runs the dense reference and the streaming engine over a Parquet file in 2-row groups
(sequences straddle row groups); both must agree, then the hand values are checked. Masked means
divide by ``count + 1e-8``: the expected values below include that guard, so the comparison
only needs float64 rounding (``rel=1e-12``).

Batch A (as in ``test_metrics_handcomputed``; ``.`` = padding)::

    seq 0: train [0, -1, -ln2]   rollout [-ln4, -1, 0]   r [ln4, 0, -ln2]
    seq 1: train [-2, ., .]      rollout [-2, ., .]      r [0]
    seq 2: empty
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mismatch_probe.metrics import MetricsConfig, compute_metrics
from mismatch_probe.metrics.accum import FLOAT_MAX
from tests.oracle.reference import Dense, make_dense, reference_metrics, to_table

LN2, LN4 = math.log(2.0), math.log(4.0)
GUARD = 1e-8  # verl's masked-mean denominator guard


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def mmean(total: float, n: int) -> float:
    return total / (n + GUARD)


def both(d: Dense, tmp_path: Path) -> dict[str, float]:
    cfg = MetricsConfig(presets=())
    ref = reference_metrics(d, cfg).flat()
    path = tmp_path / "tokens.parquet"
    pq.write_table(to_table(d), path, row_group_size=2)
    got = compute_metrics(path, cfg).flat()
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    return got


def batch_a() -> Dense:
    train = [[0.0, -1.0, -LN2], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    rollout = [[-LN4, -1.0, 0.0], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    return make_dense(train, rollout, [[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def test_spec_worked_example(tmp_path: Path) -> None:
    """One token, rollout_lp = -5, train_lp = -15 (r = -10): the spec's numbers."""
    m = both(make_dense([[-15.0]], [[-5.0]], [[1]]), tmp_path)
    assert m["k3_kl"] == approx(mmean(math.exp(-10.0) + 10.0 - 1.0, 1))
    assert m["k3_kl_reverse"] == approx(mmean(math.exp(10.0) - 10.0 - 1.0, 1))
    assert round(m["k3_kl"], 5) == 9.00005  # as printed in the spec
    assert round(m["k3_kl_reverse"], 1) == 22015.5
    assert m["token_mult_prob_error"] == approx(mmean(math.exp(10.0), 1))
    assert m["seq_mult_prob_error_max"] == approx(mmean(math.exp(10.0), 1))
    assert m["bitwise_identical_fraction"] == 0.0
    assert m["ratio_tokens_different"] == approx(mmean(1, 1))
    assert m["first_token_abs_log_ratio_mean"] == 10.0
    assert m["rest_abs_log_ratio_mean"] == 0.0  # no other token


def test_batch_a(tmp_path: Path) -> None:
    m = both(batch_a(), tmp_path)
    # exp(|r|) = [4, 1, 2 | 1]
    assert m["token_mult_prob_error"] == approx(mmean(8.0, 4))
    seq0, seq1 = mmean(7.0, 3), mmean(1.0, 1)  # per-sequence masked means
    assert m["seq_mult_prob_error_max"] == approx(seq0)
    assert m["seq_mult_prob_error_mean"] == approx((seq0 + seq1) / 2)  # valid sequences only
    assert m["seq_mult_prob_error_min"] == approx(seq1)
    # exp(-r) + r - 1 = [1/4 + ln4 - 1, 0, 2 - ln2 - 1, 0] -> sum ln2 + 1/4
    assert m["k3_kl_reverse"] == approx(mmean(LN2 + 0.25, 4))
    assert m["k3_kl_reverse_overflow"] == 0.0
    # train == rollout exactly at seq 0 position 1 and seq 1 position 0
    assert m["bitwise_identical_fraction"] == approx(mmean(2, 4))
    assert m["ratio_tokens_different"] == approx(mmean(2, 4))
    assert m["first_token_abs_log_ratio_mean"] == approx((LN4 + 0.0) / 2)
    assert m["rest_abs_log_ratio_mean"] == approx((0.0 + LN2) / 2)


def test_first_token_is_the_first_valid_one(tmp_path: Path) -> None:
    """Position 0 is padding: the first response token is position 1."""
    train = [[0.0, -1.0, -2.0]]
    rollout = [[0.0, -1.5, -2.0]]  # r = [., 0.5, 0]
    m = both(make_dense(train, rollout, [[0, 1, 1]]), tmp_path)
    assert m["first_token_abs_log_ratio_mean"] == 0.5
    assert m["rest_abs_log_ratio_mean"] == 0.0
    assert m["bitwise_identical_fraction"] == approx(mmean(1, 2))


def test_ratio_tokens_different_threshold(tmp_path: Path) -> None:
    """|r| > 1e-6 counts, |r| <= 1e-6 does not (values exactly representable steps apart)."""
    rollout = np.array([[-1.0, -1.0, -1.0]])
    train = rollout + np.array([[0.0, 5e-7, 2e-6]])
    m = both(make_dense(train, rollout, [[1, 1, 1]]), tmp_path)
    assert m["ratio_tokens_different"] == approx(mmean(1, 3))
    assert m["bitwise_identical_fraction"] == approx(mmean(1, 3))


def test_reverse_k3_overflow_is_capped_and_flagged(tmp_path: Path) -> None:
    """r = -800: exp(-r) overflows float64; token_mult_prob_error goes through clampB."""
    m = both(make_dense([[-800.0]], [[0.0]], [[1]]), tmp_path)
    assert m["k3_kl_reverse"] == FLOAT_MAX
    assert m["k3_kl_reverse_overflow"] == 1.0
    assert m["token_mult_prob_error"] == approx(mmean(math.exp(20.0), 1))
    assert m["k3_kl_overflow"] == 0.0  # exp(-800) + 799 is finite


def test_identity_gives_the_physical_limit(tmp_path: Path) -> None:
    lp = [[-0.5, -3.0], [-7.25, -1.0]]
    m = both(make_dense(lp, lp, [[1, 1], [1, 1]]), tmp_path)
    assert m["bitwise_identical_fraction"] == approx(mmean(4, 4))
    assert m["ratio_tokens_different"] == 0.0
    assert m["token_mult_prob_error"] == approx(mmean(4.0, 4))
    assert m["k3_kl_reverse"] == 0.0


def test_nemo_verdict_cites_its_source() -> None:
    from mismatch_probe.metrics.verdicts import FAIL, PASS, evaluate
    from mismatch_probe.report.markdown import verdict_section

    limit = {v.check.metric: v for v in evaluate({"token_mult_prob_error": 1.05})}
    assert limit["token_mult_prob_error"].status == PASS  # the bound is inclusive
    above = {v.check.metric: v for v in evaluate({"token_mult_prob_error": 1.0501})}
    assert above["token_mult_prob_error"].status == FAIL
    text = "\n".join(verdict_section(evaluate({"token_mult_prob_error": 1.01})))
    assert "| NeMo\\-RL |" in text or "| NeMo-RL |" in text
    assert "adding\\-new\\-models.md" in text or "adding-new-models.md" in text
    assert "Expected Error Threshold" in text
