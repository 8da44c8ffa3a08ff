"""The attribution numbers on hand-made token stores (no engine): links, shares, p99, nulls.

Store X (one setting, one sequence of three tokens; rungs L0..L4)::

    L0 rollout        [-1.0, -2.0, -3.0]
    L1 prefill        [-1.0, -2.5, -3.0]    decode_vs_prefill [0, -0.5, 0]
    L2 single         [-1.0, -2.5, -3.0]    batch             [0, 0, 0]
    L3 train@rollout  [-1.5, -2.5, -3.0]    kernels           [-0.5, 0, 0]
    L4 train          [-1.5, -2.5, -2.0]    precision         [0, 0, 1.0]

mmean(r^2): decode 0.25/3, batch 0, kernels 0.25/3, precision 1/3 -> total 1.5/3;
shares 1/6, 0, 1/6, 2/3; dominant precision.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.metrics.attribution import (
    MISMATCH_LINKS,
    P99_RELATIVE_RESOLUTION,
    compute_attribution,
    link_ratios,
)

GUARD = 1e-8  # masked-mean guard


def write(path: Path, columns: dict[str, list]) -> Path:
    n = len(columns["rollout_logprob"])
    base = {"setting": ["s"] * n, "seq_id": [0] * n, "position": list(range(n))}
    table = pa.table({**base, **columns})
    table = table.cast(
        pa.schema(
            [
                pa.field(f.name, pa.float32() if f.name.endswith("logprob") else f.type)
                for f in table.schema
            ]
        )
    )
    pq.write_table(table, path, row_group_size=2)
    return path


STORE_X = {
    "rollout_logprob": [-1.0, -2.0, -3.0],
    "engine_prefill_logprob": [-1.0, -2.5, -3.0],
    "engine_prefill_single_logprob": [-1.0, -2.5, -3.0],
    "train_rollout_dtype_logprob": [-1.5, -2.5, -3.0],
    "train_logprob": [-1.5, -2.5, -2.0],
}


def test_links_and_shares_by_hand(tmp_path: Path) -> None:
    result = compute_attribution(write(tmp_path / "t.parquet", STORE_X))["s"]
    links = result["links"]
    assert list(links) == list(MISMATCH_LINKS[:4])  # routing/staleness do not apply
    mm = lambda total: pytest.approx(total / (3 + GUARD), rel=1e-12)  # noqa: E731
    assert links["decode_vs_prefill"]["mean_abs"] == mm(0.5)
    assert links["decode_vs_prefill"]["k3"] == mm(math.exp(-0.5) - 1 + 0.5)
    assert links["decode_vs_prefill"]["max_abs"] == 0.5
    assert links["decode_vs_prefill"]["bitwise_identical_fraction"] == mm(2)
    assert links["batch"]["bitwise_identical_fraction"] == mm(3)
    assert links["batch"]["p99_abs"] == 0.0 and links["batch"]["share"] == 0.0
    assert links["precision"]["k3"] == mm(math.e - 2.0)
    shares = {k: v["share"] for k, v in links.items()}
    assert shares == pytest.approx({"decode_vs_prefill": 1 / 6, "batch": 0.0,
                                    "kernels": 1 / 6, "precision": 2 / 3}, rel=1e-12)  # fmt: skip
    assert result["dominant"] == "precision"
    # nearest rank: ceil(0.99 * 3) = 3rd smallest |r| = the max, and p99 never exceeds max
    assert links["precision"]["p99_abs"] == 1.0


def test_links_telescope_to_the_total(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 500
    rungs = np.cumsum(rng.normal(0, 0.01, (5, n)), axis=0) - 2.0
    names = list(STORE_X)
    path = write(tmp_path / "t.parquet", {k: rungs[i].tolist() for i, k in enumerate(names)})
    table = pq.read_table(path)
    ratios = link_ratios(table)
    total = sum(ratios[k][0] for k in MISMATCH_LINKS if k in ratios)
    stored = {k: table.column(k).to_numpy().astype(np.float64) for k in names}
    np.testing.assert_allclose(
        total, stored["train_logprob"] - stored["rollout_logprob"], rtol=0, atol=1e-6
    )


def test_p99_matches_numpy_within_the_histogram_resolution(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    n = 1000
    base = rng.normal(-3, 1, n).astype(np.float32)
    noise = (rng.lognormal(-6, 2, n) * rng.choice([-1, 1], n)).astype(np.float32)
    cols = {k: base.tolist() for k in STORE_X}
    cols["train_logprob"] = (base + noise).tolist()
    links = compute_attribution(write(tmp_path / "t.parquet", cols))["s"]["links"]
    r = np.abs(np.float64(np.float32(base + noise)) - np.float64(base))
    exact = np.sort(r)[math.ceil(0.99 * n) - 1]  # nearest rank
    got = links["precision"]["p99_abs"]
    assert exact <= got <= exact * (1 + P99_RELATIVE_RESOLUTION)
    assert links["precision"]["max_abs"] == r.max()


def test_null_rungs_are_left_out_and_old_stores_give_nothing(tmp_path: Path) -> None:
    cols = dict(STORE_X)
    cols["engine_prefill_single_logprob"] = [-1.0, None, -3.0]
    links = compute_attribution(write(tmp_path / "t.parquet", cols))["s"]["links"]
    # batch and kernels lose the middle token; decode_vs_prefill keeps all three
    assert links["batch"]["bitwise_identical_fraction"] == pytest.approx(2 / (2 + GUARD))
    assert links["decode_vs_prefill"]["mean_abs"] == pytest.approx(0.5 / (3 + GUARD))
    old = {k: STORE_X[k] for k in ("rollout_logprob", "train_logprob")}
    assert compute_attribution(write(tmp_path / "old.parquet", old)) == {}


def test_routing_link_uses_the_own_routes_rescoring_as_l4(tmp_path: Path) -> None:
    cols = dict(STORE_X)
    cols["train_no_replay_logprob"] = STORE_X["train_logprob"]
    cols["train_logprob"] = [-1.5, -2.5, -1.0]  # replay moves the last token by +1
    cols["stale_logprob"] = [-1.5, -2.5, -2.0]  # the later checkpoint equals L4
    links = compute_attribution(write(tmp_path / "t.parquet", cols))["s"]["links"]
    assert links["precision"]["max_abs"] == 1.0  # L4 = own routes, as without replay
    assert links["routing"]["max_abs"] == 1.0
    assert links["staleness"]["max_abs"] == 0.0
    assert list(links) == [*MISMATCH_LINKS, "staleness"]
