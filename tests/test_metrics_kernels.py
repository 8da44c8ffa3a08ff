"""The metric engine's fast kernels give exactly what the plain numpy calls they replace give:
the same bin for every value (boundaries and their neighbours included), the same counts."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_probe.metrics.accum import uniform_hist
from mismatch_probe.metrics.curves import (
    POSITION_EDGES,
    PROB_EDGES,
    bin_index,
    position_bin,
    prob_bin,
)


def _around(edges: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Every edge and its two float64 neighbours."""
    return np.concatenate([edges, np.nextafter(edges, lo), np.nextafter(edges, hi)])


def test_prob_bin_equals_searchsorted_bins() -> None:
    rng = np.random.default_rng(0)
    edges = np.array(PROB_EDGES)
    p = np.concatenate([rng.random(100_000), rng.random(10_000) ** 12, _around(edges, 0, 2)])
    p = np.clip(p, 0.0, 1.0)
    assert np.array_equal(prob_bin(p), bin_index(p, PROB_EDGES, open_last=False))


def test_position_bin_equals_searchsorted_bins() -> None:
    pos = np.concatenate([np.arange(70_000), [0, 7, 8, 32_767, 32_768, 10**9]])
    assert np.array_equal(position_bin(pos), bin_index(pos, POSITION_EDGES, open_last=True))


@pytest.mark.parametrize("scale", [0.02, 1.0, 3.0, 30.0])
def test_uniform_hist_equals_numpy_histogram(scale: float) -> None:
    rng = np.random.default_rng(1)
    edges = np.linspace(-3.0, 3.0, 122)
    x = np.concatenate([rng.normal(0.0, scale, 50_000), _around(edges, -9, 9)])
    counts, under, over = uniform_hist(x, 121, -3.0, 3.0)
    assert np.array_equal(counts, np.histogram(x, bins=121, range=(-3.0, 3.0))[0])
    assert (under, over) == (int((x < -3.0).sum()), int((x > 3.0).sum()))
    assert counts.sum() + under + over == len(x)


def test_uniform_hist_of_nothing() -> None:
    counts, under, over = uniform_hist(np.zeros(0), 5, 0.0, 1.0)
    assert counts.tolist() == [0] * 5 and (under, over) == (0, 0)
