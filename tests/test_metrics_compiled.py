"""The compiled loops (``_kernels``) give the numpy calls' bits.

* ``curves``: every count and every sum of ``curves.token_tables`` is compared with the numpy
  path, on tokens drawn like a model's and on values placed on and around every bin edge (the
  histogram's ``linspace`` edges, computed in the loop or looked up, the probability edges,
  the position edges), beyond the ranges, and at the log-prob floor;
* ``thresholds`` and ``is_stats``: every count, extreme and sum against numpy's, at lengths
  around the loops' lanes and blocks, with padding, at both IS levels, TIS and IcePop;
* the whole metric engine, every number of ``metrics.json``, with the loops and without them
  (``compiled.kernels`` None), on stores with padding, empty sequences, log-ratios beyond the
  safety bound, ``-inf`` and positive log-probs, ``-0.0`` and unsorted positions.
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
                       *curves._HIST_LINE, *curves._INNER_EDGES, 50,
                       np.zeros(124, np.int64), np.zeros(2500, np.int64),
                       np.zeros(182, np.int64), np.zeros(728))  # fmt: skip


def test_the_looked_up_bounds_give_the_computed_ones_bins() -> None:
    """A step that does not give the bounds handed makes the loop look them up: same slots."""
    from mismatch_probe.metrics.compiled import kernels

    assert kernels is not None
    rng = np.random.default_rng(3)
    n = 50_000
    edges = np.linspace(*curves.LOG_RATIO_RANGE, curves.LOG_RATIO_BINS + 1)
    r = np.concatenate([rng.normal(0.0, 1.0, n), edges, np.nextafter(edges, np.inf)])
    p = rng.random(len(r))
    position = rng.integers(0, 40_000, len(r))
    slots = []
    for lo, step in (curves._HIST_LINE, (curves._HIST_LINE[0], curves._HIST_LINE[1] * 1.001)):
        out = [np.zeros(124, np.int64), np.zeros(2500, np.int64), np.zeros(182, np.int64),
               np.zeros(728)]  # fmt: skip
        kernels.curves(r, r, r, r, p, p, position, *curves._HIST, lo, step,
                       *curves._INNER_EDGES, 50, *out)  # fmt: skip
        slots.append(out[0])
    np.testing.assert_array_equal(slots[0], slots[1])
    want = curves.uniform_slots(r, curves.LOG_RATIO_BINS, *curves.LOG_RATIO_RANGE)
    np.testing.assert_array_equal(slots[0], want)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 2047, 2048, 2049, 20_001])
def test_thresholds_count_as_numpy(size: int) -> None:
    from mismatch_probe.metrics.accum import thresholds

    rng = np.random.default_rng(size)
    x = np.concatenate([rng.normal(1.0, 0.5, size), [0.5, 1.0, 1.5, 2.0, -0.0][: size // 4]])
    above, below = (0.5, 1.0, 1.5, 2.0), (0.2, 0.5, 0.9)
    for center in (None, 1.0):
        got = thresholds(x, above, below, center=center)
        want = thresholds(x, above, below, center=center, compiled=False)
        np.testing.assert_array_equal(got.above, want.above)
        np.testing.assert_array_equal(got.below, want.below)
        assert (got.max, got.min) == (want.max, want.min)


def _store(path, seed: int, pad: float = 0.0, wild: float = 0.0, shuffled: bool = False,
           zeros: bool = False):  # fmt: skip
    """A token store of a few hundred sequences of 1..700 tokens: ``pad`` of the log-probs null
    (and five sequences all padding), ``wild`` of the log-ratios far beyond the safety bound and
    of the rollout log-probs -inf or positive, positions out of order, -0.0 and equal pairs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 700, 300)
    n = int(lengths.sum())
    seq = np.repeat(np.arange(300) * 3 + 7, lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    position = np.arange(n) - starts + (rng.integers(-3, 3, n) if shuffled else 0)
    rollout = -rng.exponential(1.5, n)
    r = rng.normal(0, 0.05, n) + (rng.random(n) < 0.01) * rng.normal(0, 2, n)
    if wild:
        far = rng.random(n) < wild
        r[far] = rng.normal(0, 30, far.sum())
        rollout[rng.random(n) < wild] = -np.inf
        rollout[rng.random(n) < wild] = 0.3
    train = rollout + r
    if zeros:
        train[rng.random(n) < 0.05] = -0.0
        rollout[rng.random(n) < 0.05] = -0.0
        same = rng.random(n) < 0.1
        train[same] = rollout[same]
    empty = np.isin(seq, seq[starts[:: max(1, n // 50)]][:5]) if pad else np.zeros(n, bool)
    table = pa.table({
        "seq_id": seq, "position": position.astype(np.int32),
        "token_id": rng.integers(0, 1000, n).astype(np.int32),
        "rollout_logprob": pa.array(rollout.astype(np.float32), mask=rng.random(n) < pad),
        "train_logprob": pa.array(train.astype(np.float32), mask=(rng.random(n) < pad) | empty),
        "support_flip": rng.random(n) < 0.01,
    })  # fmt: skip
    pq.write_table(table, path, row_group_size=int(rng.integers(5000, 60_000)))
    return path


STORES = {"plain": {}, "padding": {"pad": 0.05}, "beyond_the_bound": {"wild": 0.02},
          "unsorted_positions": {"shuffled": True}, "signed_zeros": {"zeros": True},
          "all_of_them": {"pad": 0.03, "wild": 0.01, "shuffled": True, "zeros": True}}  # fmt: skip


@pytest.mark.parametrize("name", list(STORES))
def test_the_engine_gives_the_same_bits_without_the_loops(
    name: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from mismatch_probe.metrics import MetricsConfig, compiled, compute_metrics

    path = _store(tmp_path / "tokens.parquet", len(name), **STORES[name])
    rs = {"rollout_rs": "token_k1,seq_max_k3", "rollout_rs_threshold": "0.5_2.0,0.01"}
    configs = [MetricsConfig(),
               MetricsConfig(rollout_is="sequence", rollout_is_threshold="0.5_2",
                             batch_normalize=True, **rs)]  # fmt: skip

    def exact(config: MetricsConfig) -> str:
        result = compute_metrics(path, config, workers=2).to_json_dict()
        return json.dumps(result, sort_keys=True, default=str)

    with_loops = [exact(config) for config in configs]
    monkeypatch.setattr(compiled, "kernels", None)
    assert [exact(config) for config in configs] == with_loops


# --- the integrity checks (``_kernels.integrity``) ---------------------------------------------


def _faulty_rows(seed: int, n_seqs: int = 400) -> tuple[np.ndarray, ...]:
    """Sequences of 1..300 tokens with every fault the checks look for, in runs and alone:
    padding (null: NaN), NaN and +-inf, -inf on a support flip, positive and implausible
    log-probs, placeholder 0.0s, sequences copied throughout, sequences shifted by one, gaps
    and repeats in the positions, positions near int64's end, -0.0, and equal sides."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, n_seqs)
    lengths[:6] = [1, 2, 3, 8, 9, 4]
    n = int(lengths.sum())
    first = np.cumsum(lengths) - lengths
    seq = np.repeat(np.arange(n_seqs) * 5 + 3, lengths)
    pos = (np.arange(n) - np.repeat(first, lengths)).astype(np.int64)
    rollout = -rng.exponential(1.5, n)
    train = rollout + rng.normal(0, 0.02, n)
    kind = np.repeat(rng.integers(0, 6, n_seqs), lengths)  # a fault per sequence, or none
    shifted = kind == 1
    train[shifted] = np.roll(rollout, 1)[shifted] + rng.normal(0, 1e-3, int(shifted.sum()))
    train[kind == 2] = rollout[kind == 2]  # copied throughout
    sharp = kind == 3  # a temperature gap: r moves with the log-prob
    train[sharp] = rollout[sharp] * 1.3
    trunc = kind == 4  # a truncated support: r < 0
    train[trunc] = rollout[trunc] - rng.exponential(0.05, int(trunc.sum()))
    rare = lambda p: rng.random(n) < p  # noqa: E731
    train[rare(0.01)] = 0.0
    rollout[rare(0.01)] = -0.0
    rollout[rare(0.005)] = 0.0
    hit = rare(0.003)
    train[hit] = rng.uniform(0.0, 0.5, int(hit.sum()))
    hit = rare(0.003)
    rollout[hit] = rng.uniform(0.0, 0.5, int(hit.sum()))
    hit = rare(0.003)
    rollout[hit] = -rng.uniform(1e4, 1e9, int(hit.sum()))
    hit = rare(0.003)
    train[hit] = -rng.uniform(1e4, 1e9, int(hit.sum()))
    train[rare(0.002)] = -np.inf
    rollout[rare(0.002)] = np.inf
    train[rare(0.002)] = np.nan
    train[rare(0.002)] = -10_000.0
    same = rare(0.05)
    train[same] = rollout[same]
    valid = ~rare(0.02)
    valid[np.isin(seq, seq[first[10:14]])] = False  # sequences all padding
    flip = rare(0.01)
    pos[rare(0.01)] += rng.integers(1, 3)  # gaps and repeats
    pos[np.isin(seq, seq[first[20]])] += np.iinfo(np.int64).max - 300  # wrapping at +1
    return seq, pos, train, rollout, valid, flip


def _integrity_state(acc) -> str:
    """Every number an ``IntegrityAccumulator`` holds, floats and histograms by their bytes."""

    def exact(v):
        if isinstance(v, dict):
            return {k: exact(x) for k, x in v.items()}
        if isinstance(v, np.ndarray):
            return v.tobytes()
        return float(v).hex() if isinstance(v, float) else v

    sampling = {k: exact(v) for k, v in vars(acc.sampling).items()}
    return repr({**{k: exact(v) for k, v in vars(acc).items() if k != "sampling"}, **sampling})


@pytest.mark.parametrize("seed", range(6))
def test_integrity_counts_and_sums_as_numpy(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from mismatch_probe.metrics import compiled
    from mismatch_probe.metrics.integrity import IntegrityAccumulator

    rows = _faulty_rows(seed)
    rng = np.random.default_rng(seed)
    if seed % 2:  # unsorted rows: the sort before the loop
        order = rng.permutation(len(rows[0]))
        rows = tuple(a[order] for a in rows)
    cuts = np.sort(rng.choice(np.arange(1, len(rows[0])), 3, replace=False))
    states = []
    for kernels in (compiled.kernels, None):
        monkeypatch.setattr(compiled, "kernels", kernels)
        acc = IntegrityAccumulator()
        for part in zip(*(np.split(a, cuts) if seed % 2 == 0 else [a] for a in rows), strict=True):
            acc.update(*part)
        states.append(_integrity_state(acc))
    assert states[0] == states[1]
    for check in ("nonfinite", "positive", "implausible", "placeholder", "shifted", "copied"):
        assert acc.seqs[check] > 0, check  # every fault was there to count


def test_integrity_of_one_row_and_of_one_padding_row(monkeypatch: pytest.MonkeyPatch) -> None:
    from mismatch_probe.metrics import compiled
    from mismatch_probe.metrics.integrity import IntegrityAccumulator

    one = [np.array([7]), np.array([0]), np.array([-1.0]), np.array([-1.0]),
           np.array([True]), np.array([False])]  # fmt: skip
    padding = [*one[:4], np.array([False]), one[5]]
    states = []
    for kernels in (compiled.kernels, None):
        monkeypatch.setattr(compiled, "kernels", kernels)
        acc = IntegrityAccumulator()
        acc.update(*one)
        acc.update(*padding)
        states.append(_integrity_state(acc))
    assert states[0] == states[1]


@pytest.mark.parametrize("name", ["padding", "all_of_them"])
def test_integrity_findings_without_the_loops(
    name: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compute_integrity`` of a store, per step too, with the loops and without them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mismatch_probe.metrics import compiled
    from mismatch_probe.metrics.integrity import compute_integrity

    path = _store(tmp_path / "tokens.parquet", len(name), **STORES[name])
    table = pq.read_table(path)
    steps = np.repeat(np.arange(3), -(-table.num_rows // 3))[: table.num_rows]
    pq.write_table(table.append_column("step", pa.array(steps)), path, row_group_size=20_000)
    found = compute_integrity(path, {"kind": "ingest"}).to_json_dict()
    monkeypatch.setattr(compiled, "kernels", None)
    assert compute_integrity(path, {"kind": "ingest"}).to_json_dict() == found
    assert found["findings"] and found["steps"]


def test_integrity_refuses_what_is_not_sequence_starts() -> None:
    from mismatch_probe.metrics.compiled import kernels
    from mismatch_probe.metrics.integrity import _COUNTED, _LIMITS, _SUMMED

    assert kernels is not None
    n = 4
    f, b = np.zeros(n), np.ones(n, bool)
    outs = (np.zeros(len(_COUNTED), np.int64), np.zeros(_SUMMED), *(np.zeros(n) for _ in range(4)))
    for starts in ([1, 2], [0, 2, 2], [0, 5], []):
        with pytest.raises(ValueError, match="starts"):
            kernels.integrity(np.arange(n), f, f, b, b, np.array(starts, np.int64), _LIMITS, 8,
                              *outs)  # fmt: skip
    with pytest.raises(ValueError, match="train"):
        kernels.integrity(np.arange(n), f[:3], f, b, b, np.array([0]), _LIMITS, 8, *outs)
