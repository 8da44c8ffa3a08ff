"""Property tests (hypothesis) on random padded batches and random row-group splits."""

from __future__ import annotations

import itertools
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mismatch_probe.metrics import MetricsConfig, compute_metrics
from mismatch_probe.metrics.batch import batch_from_table
from mismatch_probe.metrics.weights import is_weights as stream_is_weights
from tests.oracle.reference import (
    Dense,
    is_weights,
    make_dense,
    reference_metrics,
    to_table,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IS_CHOICES = [
    ("token", "2.0"),
    ("sequence", "2.0"),
    ("token", "0.5_5.0"),
    ("sequence", "0.8_1.25"),
    ("token", "1.5"),
    (None, "2.0"),
]
RS_CHOICES = [
    (None, None),
    ("token_k1", "0.5_2.0"),
    ("seq_sum_k1,seq_max_k2", "2.0,0.3"),
    ("token_k2,token_k3,seq_mean_k2,seq_mean_k3,seq_sum_k2,seq_sum_k3,seq_max_k3", "0.05"),
    ("seq_mean_k1,token_k1", "0.999_1.001,1.5"),
]


@st.composite
def batches(draw: Any, zero: bool = False) -> Dense:
    """Random ``[S, T]`` batches: empty sequences, padding, tiny to +-1000 log-ratios, -inf."""
    s, t = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rollout = -rng.exponential(1.0, (s, t))
    scale = 0.0 if zero else draw(st.sampled_from([0.0, 1e-4, 0.3, 3.0, 1000.0]))
    train = rollout + rng.normal(0.0, scale, (s, t))
    if not zero and draw(st.booleans()):
        train[rng.random((s, t)) < 0.15] = -np.inf
    lengths = rng.integers(0, t + 1, s)
    lengths[rng.integers(0, s)] = max(1, lengths.max())
    mask = np.arange(t)[None, :] < lengths[:, None]
    ids = rng.choice(10_000, s, replace=False)
    return make_dense(train, rollout, mask, seq_ids=ids, flip=rng.random((s, t)) < 0.2)


@st.composite
def configs(draw: Any) -> MetricsConfig:
    level, threshold = draw(st.sampled_from(IS_CHOICES))
    rs, rs_threshold = draw(st.sampled_from(RS_CHOICES))
    return MetricsConfig(level, threshold, rs, rs_threshold, batch_normalize=draw(st.booleans()))


def _stream(d: Dense, cfg: MetricsConfig, cuts: list[int]) -> Any:
    """``compute_metrics`` on ``d`` written as row groups split at ``cuts`` (any row)."""
    table = to_table(d)
    bounds = sorted({0, table.num_rows, *(c % (table.num_rows + 1) for c in cuts)})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.parquet"
        with pq.ParquetWriter(path, table.schema) as writer:
            for lo, hi in itertools.pairwise(bounds):
                writer.write_table(table.slice(lo, hi - lo))
        return compute_metrics(path, cfg)


def assert_close(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_close(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_close(a, b, f"{where}[{i}]")
    elif isinstance(want, float) and where.endswith("_std"):
        # sqrt(max(0, E[x^2] - E[x]^2)): the two sums' rounding (a few ulps of E[x^2]) is
        # amplified by the square root near 0, so the variances are what must agree
        assert got**2 == pytest.approx(want**2, rel=1e-9, abs=1e-12), where
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-9), where
    else:
        assert got == want, where


@SETTINGS
@given(batches(), configs(), st.lists(st.integers(0, 60), max_size=6))
def test_streaming_equals_in_memory(d: Dense, cfg: MetricsConfig, cuts: list[int]) -> None:
    got, want = _stream(d, cfg, cuts), reference_metrics(d, cfg)
    assert_close(got.flat(), want.flat())
    assert_close(got.curves, want.curves)
    assert_close(got.tables, want.tables)


@SETTINGS
@given(batches(), st.sampled_from([s for s in IS_CHOICES if s[0]]))
def test_is_weights_stay_in_bounds(d: Dense, choice: tuple[str, str]) -> None:
    spec = MetricsConfig(*choice).is_spec
    assert spec is not None
    stream_w = stream_is_weights(batch_from_table(to_table(d)), spec)[1]
    for w in (is_weights(d, spec)[1].ravel(), stream_w):
        assert np.all(w >= 0)
        if spec.lower is None:
            assert np.all(w <= spec.upper)
        else:
            assert np.all((w == 0) | ((w >= spec.lower) & (w <= spec.upper)))


@SETTINGS
@given(batches(), configs())
def test_fractions_in_unit_interval_and_everything_finite(d: Dense, cfg: MetricsConfig) -> None:
    flat = reference_metrics(d, cfg).flat()
    assert all(math.isfinite(v) for v in flat.values())
    fractions = {k: v for k, v in flat.items() if "fraction" in k or k.startswith("f_tau")}
    assert fractions and all(0.0 <= v <= 1.0 for v in fractions.values()), fractions


@SETTINGS
@given(batches(zero=True), configs())
def test_zero_log_ratio_means_no_mismatch(d: Dense, cfg: MetricsConfig) -> None:
    flat = reference_metrics(d, cfg).flat()
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "f_tau_1.01"):
        assert flat[key] == pytest.approx(0.0, abs=1e-7), key
    masked = {k: v for k, v in flat.items() if k.endswith("masked_fraction")}
    assert all(v == 0.0 for v in masked.values()), masked
    ess = {k: v for k, v in flat.items() if k.endswith("eff_sample_size")}
    assert ess and all(v == pytest.approx(1.0, rel=1e-6) for v in ess.values()), ess
