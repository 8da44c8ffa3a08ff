"""The compiled curves loop (``_kernels.curves``) gives the numpy calls' bits.

Every count and every sum of ``curves.token_tables`` is compared with the numpy path, on
tokens drawn like a model's and on values placed on and around every bin edge (the histogram's
``linspace`` edges, the probability edges, the position edges), beyond the ranges, and at the
log-prob floor.
"""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_probe.metrics import curves
from mismatch_probe.metrics.compiled import COMPILED


def test_built() -> None:
    assert COMPILED, "the metric loops were not built (make install needs a C compiler)"


def _columns(r: np.ndarray, rollout: np.ndarray, position: np.ndarray) -> curves.TokenColumns:
    train = rollout + r
    p_train, p_rollout = np.exp(np.minimum(train, 0.0)), np.exp(np.minimum(rollout, 0.0))
    return curves.TokenColumns(
        r=r, abs_r=np.abs(r), k3=np.expm1(np.clip(r, -20, 20)) - np.clip(r, -20, 20),
        dp=np.abs(p_train - p_rollout), p_rollout=p_rollout, p_train=p_train,
        position=position.astype(np.int64),
    )  # fmt: skip


def _assert_same(t: curves.TokenColumns) -> None:
    got, want = curves.token_tables(t), curves.token_tables(t, compiled=False)
    for name in ("slots", "hist2d", "tokens"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    for name, table in want.sums.items():  # bit for bit: the same additions in the same order
        assert got.sums[name].tobytes() == table.tobytes(), name


def test_drawn_like_a_model() -> None:
    rng = np.random.default_rng(7)
    n = 200_000
    rollout = -rng.exponential(1.5, n)
    r = rng.normal(0.0, 0.02, n) + (rng.random(n) < 1e-3) * rng.normal(0.0, 2.0, n)
    _assert_same(_columns(r, rollout, rng.integers(0, 40_000, n)))


def test_on_and_around_every_edge() -> None:
    hist_edges = np.linspace(*curves.LOG_RATIO_RANGE, curves.LOG_RATIO_BINS + 1)
    near = lambda e: np.concatenate([e, np.nextafter(e, -np.inf), np.nextafter(e, np.inf)])  # noqa: E731
    r = np.concatenate([near(hist_edges), [-1e300, 1e300, -9999.0, 9999.0, 0.0, -0.0]])
    prob_edges = np.array(curves.PROB_EDGES[1:])
    probs = np.concatenate([near(prob_edges), near(np.arange(0, 1001) / 1000), [1e-300, 1.0]])
    rollout = np.log(probs[probs > 0])  # a probability above 1 is 1 (prob(lp): min(lp, 0))
    n = max(len(r), len(rollout))
    positions = np.array([*curves.POSITION_EDGES, *(np.array(curves.POSITION_EDGES) - 1), 10**9])
    rng = np.random.default_rng(0)
    _assert_same(_columns(np.resize(r, n), np.resize(rollout, n), np.resize(positions, n)))
    _assert_same(_columns(rng.permutation(np.resize(r, n)), np.resize(rollout, n),
                          rng.permutation(np.resize(positions, n))))  # fmt: skip


def test_no_tokens() -> None:
    empty = np.zeros(0)
    got = curves.token_tables(_columns(empty, empty, np.zeros(0, np.int64)))
    assert got.slots.sum() == got.hist2d.sum() == got.tokens.sum() == 0


def test_a_wrong_size_is_refused() -> None:
    from mismatch_probe.metrics.compiled import kernels

    assert kernels is not None
    x = np.zeros(4)
    with pytest.raises(ValueError, match="position"):
        kernels.curves(x, x, x, x, x, x, np.zeros(3, np.int64), *curves._HIST,
                       curves._POSITION_BIN, curves._PROB_GUESS, curves._PROB_BOUNDS, 50,
                       np.zeros(124, np.int64), np.zeros(2500, np.int64),
                       np.zeros(182, np.int64), np.zeros(728))  # fmt: skip
