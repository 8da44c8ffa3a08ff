"""The metric engine's fast kernels give exactly what the plain numpy calls they replace give:
the same bin for every value (boundaries and their neighbours included), the same counts; the
per-token arrays shared between the clamped and unclamped formulas are each formula's bits."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from mismatch_probe.metrics.accum import uniform_hist
from mismatch_probe.metrics.batch import (
    SAFETY_BOUND,
    batch_from_table,
    batch_k3,
    clamped_k3,
    clamped_r,
    k3_terms,
    within_bound,
)
from mismatch_probe.metrics.curves import (
    POSITION_EDGES,
    PROB_EDGES,
    PROB_HIST_BINS,
    BinnedStats,
    TokenColumns,
    bin_index,
    position_bin,
    prob_bin,
    prob_hist2d,
    token_tables,
)
from mismatch_probe.metrics.diagnostics import TAU_GRID, DiagnosticsAccumulator, ratio_spread
from mismatch_probe.metrics.parity import batch_mult, mult_prob_error


def _around(edges: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Every edge and its two float64 neighbours."""
    return np.concatenate([edges, np.nextafter(edges, lo), np.nextafter(edges, hi)])


def test_prob_bin_equals_searchsorted_bins() -> None:
    rng = np.random.default_rng(0)
    edges = np.array(PROB_EDGES)
    p = np.concatenate([rng.random(100_000), rng.random(10_000) ** 12, _around(edges, -1, 2)])
    p = np.concatenate([p, [-np.inf, -3.0, -0.0, 1.5, 7.0, np.inf]])  # outside [0, 1]: clipped
    assert np.array_equal(prob_bin(p), bin_index(p, PROB_EDGES, open_last=False))


def test_position_bin_equals_searchsorted_bins() -> None:
    pos = np.concatenate([np.arange(70_000), [0, 7, 8, 32_767, 32_768, 10**9]])
    assert np.array_equal(position_bin(pos), bin_index(pos, POSITION_EDGES, open_last=True))


@pytest.mark.parametrize("scale", [0.02, 1.0, 3.0, 30.0])
def test_uniform_hist_equals_numpy_histogram(scale: float) -> None:
    rng = np.random.default_rng(1)
    edges = np.linspace(-3.0, 3.0, 122)
    x = np.concatenate([rng.normal(0.0, scale, 50_000), _around(edges, -9, 9),
                        [1e308, -1e308, 5e-324, -5e-324, -0.0]])  # fmt: skip
    counts, under, over = uniform_hist(x, 121, -3.0, 3.0)
    assert np.array_equal(counts, np.histogram(x, bins=121, range=(-3.0, 3.0))[0])
    assert (under, over) == (int((x < -3.0).sum()), int((x > 3.0).sum()))
    assert counts.sum() + under + over == len(x)


def test_uniform_hist_of_nothing() -> None:
    counts, under, over = uniform_hist(np.zeros(0), 5, 0.0, 1.0)
    assert counts.tolist() == [0] * 5 and (under, over) == (0, 0)


def test_prob_hist2d_equals_the_clip_then_floor_bins() -> None:
    rng = np.random.default_rng(2)
    nb = PROB_HIST_BINS
    grid = np.arange(nb + 1) / nb
    x = np.concatenate([rng.random(50_000), _around(grid, -1, 2), [-0.5, 1.5]])
    y = rng.permutation(x)
    ix = np.minimum((np.clip(x, 0.0, 1.0) * nb).astype(np.int64), nb - 1)
    iy = np.minimum((np.clip(y, 0.0, 1.0) * nb).astype(np.int64), nb - 1)
    expected = np.zeros((nb, nb), np.int64)
    np.add.at(expected, (ix, iy), 1)
    assert np.array_equal(prob_hist2d(x, y), expected)


@pytest.mark.parametrize("compiled", [True, False])
def test_crossed_bins_give_each_binning_alone(compiled: bool) -> None:
    """The table over crossed bins (``token_tables``, compiled or numpy) fills both margins as
    two separate ``bincount`` passes would: the same counts, the same sums up to their order of
    addition."""
    rng = np.random.default_rng(3)
    pos = rng.integers(0, 40_000, 30_000)
    p = rng.random(30_000)
    values = {name: rng.normal(size=30_000) for name in
              ("log_ratio", "abs_log_ratio", "k3", "prob_abs_diff")}  # fmt: skip
    columns = TokenColumns(*values.values(), p_rollout=p, p_train=p, position=pos)
    tables = token_tables(columns, compiled=compiled)
    by_pos, by_prob = BinnedStats(POSITION_EDGES, True), BinnedStats(PROB_EDGES, False)
    BinnedStats.add_crossed(by_pos, by_prob, tables.tokens, tables.sums)
    for stats, idx in ((by_pos, position_bin(pos)), (by_prob, prob_bin(p))):
        assert np.array_equal(stats.count, np.bincount(idx, minlength=stats.nbins))
        for name, w in values.items():
            alone = np.bincount(idx, weights=w, minlength=stats.nbins)
            # any order of summing a bin's n terms: within n * eps * (sum of their |w|)
            bound = len(w) * np.finfo(np.float64).eps * np.bincount(idx, np.abs(w), stats.nbins)
            assert np.all(np.abs(stats.sums[name] - alone) <= bound)


@pytest.mark.parametrize("beyond", [0.0, 20.0, 20.5, 700.5])
def test_shared_per_token_arrays_equal_their_formulas(beyond: float) -> None:
    """Where no ``|r|`` exceeds B the clamped arrays are the unclamped ones (computed once);
    with one token beyond B (or exactly at it) each is still its own formula, bit for bit."""
    rng = np.random.default_rng(1)
    n = 5_000
    rollout = -rng.exponential(1.0, n)
    train = rollout + rng.normal(0.0, 0.3, n)
    rollout[17], train[17] = 0.0, -beyond  # r = -beyond exactly at one token
    seq, pos = np.repeat(np.arange(50), 100), np.tile(np.arange(100), 50)
    table = pa.table({"seq_id": seq, "position": pos, "train_logprob": train,
                      "rollout_logprob": rollout})  # fmt: skip
    b = batch_from_table(table)
    r = b.r
    assert within_bound(b, None) == (beyond <= SAFETY_BOUND)
    rs = np.clip(r, -SAFETY_BOUND, SAFETY_BOUND)
    assert np.array_equal(clamped_r(b, None), rs)
    assert np.array_equal(clamped_k3(b, None), np.expm1(rs) - rs)
    assert np.array_equal(batch_k3(b, None), k3_terms(r))
    assert np.array_equal(batch_mult(b, None), mult_prob_error(r))
    spread = DiagnosticsAccumulator(has_flip=False)
    spread.update(b)
    expected = [np.count_nonzero(ratio_spread(r) > tau) for tau in TAU_GRID]
    assert spread.n_tau.tolist() == expected
