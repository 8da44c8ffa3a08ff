"""Spec section 7 on a small hand-made store: clip fractions, the threshold sweep, outliers and
entropy, expected values derived by hand below.

The store (file order; ``rho = p_train / p_rollout`` per valid token, ``.`` = padding)::

    seq_id 10  prompt 0 sample 0   rho [1.25, 1, 4]
    seq_id  7  prompt 0 sample 1   rho [0.9, 1.1]
    seq_id  3  prompt 1 sample 0   rho [1, 0.6, 1, 1]
    seq_id 12  prompt 2 sample 0   [.]                  (empty)
    seq_id  5  prompt 1 sample 1   rho [0.9, 1.1]       (same as seq 7)

N = 11 valid tokens, S = 5 sequences. Written in 3-row groups, so sequences straddle groups.
Masked means divide by ``N + 1e-8``, hence ``approx(rel=1e-7)``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.metrics import MetricsConfig, compute_metrics
from mismatch_probe.metrics.entropy import GRID

SEQS = (  # (seq_id, prompt_id, sample_id, rho per token or None for one padding row)
    (10, 0, 0, (1.25, 1.0, 4.0)),
    (7, 0, 1, (0.9, 1.1)),
    (3, 1, 0, (1.0, 0.6, 1.0, 1.0)),
    (12, 2, 0, None),
    (5, 1, 1, (0.9, 1.1)),
)
N, S = 11, 5


def k3(rho: float) -> float:
    return rho - 1.0 - math.log(rho)


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-7, abs=1e-12)


def write_store(path: Path, entropy: list[float | None] | None = None) -> Path:
    cols: dict[str, list] = {k: [] for k in ("seq_id", "prompt_id", "sample_id", "position")}
    cols.update(rollout_logprob=[], train_logprob=[], setting=[])
    for seq_id, prompt_id, sample_id, rhos in SEQS:
        for pos, rho in enumerate(rhos or (None,)):
            cols["seq_id"].append(seq_id)
            cols["prompt_id"].append(prompt_id)
            cols["sample_id"].append(sample_id)
            cols["position"].append(pos)
            cols["setting"].append("rollout=fp32 | train=fp32")
            cols["rollout_logprob"].append(None if rho is None else -1.0)
            cols["train_logprob"].append(None if rho is None else -1.0 + math.log(rho))
    table = pa.table(cols)
    if entropy is not None:
        table = table.append_column("train_entropy", pa.array(entropy, pa.float32()))
    pq.write_table(table, path, row_group_size=3)
    return path


@pytest.fixture
def result(tmp_path: Path):
    return compute_metrics(write_store(tmp_path / "tokens.parquet"), MetricsConfig())


def test_clip_fractions(result) -> None:
    m = result.flat()
    # |rho - 1|: 0.25, 3 and 0.4 exceed 0.2; only 3 and 0.4 exceed 0.28
    assert m["clip_fraction_0.2"] == approx(3 / N)
    assert m["clip_fraction_0.28"] == approx(2 / N)


def test_threshold_sweep_rows(result) -> None:
    rows = {(r["family"], r["threshold"]): r for r in result.tables["threshold_sweep"]}
    expected = {  # (tokens, sequences) masked or truncated
        # rho > C: {1.25, 4} at 1.2, {4} at 1.5..3, none from 5 (all in seq 10)
        ("token_tis", 1.2): (2, 1), ("token_tis", 1.5): (1, 1), ("token_tis", 2.0): (1, 1),
        ("token_tis", 3.0): (1, 1), ("token_tis", 5.0): (0, 0), ("token_tis", 10.0): (0, 0),
        # outside [1/C, C]: 1.25, 4, 0.6 at 1.2; 4, 0.6 at 1.5; 4 at 2 and 3 (0.6 > 1/2)
        ("token_icepop", 1.2): (3, 2), ("token_icepop", 1.5): (2, 2),
        ("token_icepop", 2.0): (1, 1), ("token_icepop", 3.0): (1, 1),
        ("token_icepop", 5.0): (0, 0), ("token_icepop", 10.0): (0, 0),
        # q' of seq 10 is 5 * 3 / (3 + 1e-8) < 5; the others are 0.99 and 0.6
        ("seq_is", 1.2): (3, 1), ("seq_is", 1.5): (3, 1), ("seq_is", 2.0): (3, 1),
        ("seq_is", 3.0): (3, 1), ("seq_is", 5.0): (0, 0), ("seq_is", 10.0): (0, 0),
        # mmean_i(k3): seq 10 0.547, seq 3 0.0277, seqs 7 and 5 0.00503, seq 12 empty
        ("seq_mean_k3", 1e-4): (11, 4), ("seq_mean_k3", 1e-3): (11, 4),
        ("seq_mean_k3", 1e-2): (7, 2), ("seq_mean_k3", 0.1): (3, 1),
    }  # fmt: skip
    assert rows.keys() == expected.keys()
    families = list(dict.fromkeys(r["family"] for r in result.tables["threshold_sweep"]))
    assert families == ["token_tis", "token_icepop", "seq_is", "seq_mean_k3"]
    for key, (tokens, seqs) in expected.items():
        assert rows[key]["token_fraction"] == approx(tokens / N), key
        assert rows[key]["seq_fraction"] == seqs / S, key


def test_outlier_ranking_and_fields(result) -> None:
    seq = {10: k3(1.25) + k3(4.0), 7: k3(0.9) + k3(1.1), 3: k3(0.6)}
    total = seq[10] + 2 * seq[7] + seq[3]
    out = result.tables["outliers"]
    assert [o["seq_id"] for o in out] == [10, 3, 5, 7]  # 5 and 7 tie: smaller seq_id first
    first = out[0]
    assert first["setting"] == "rollout=fp32 | train=fp32"
    assert (first["prompt_id"], first["sample_id"], first["tokens"]) == (0, 0, 3)
    assert first["seq_k3_sum"] == pytest.approx(seq[10], rel=1e-6)
    assert first["share"] == pytest.approx(seq[10] / total, rel=1e-6)
    assert (first["worst_position"], first["worst_abs_log_ratio"]) == (2, approx(math.log(4)))
    assert (out[1]["worst_position"], out[1]["worst_abs_log_ratio"]) == (1, approx(-math.log(0.6)))
    assert out[2]["worst_position"] == 0  # |log 0.9| > |log 1.1|
    assert (out[2]["prompt_id"], out[2]["sample_id"]) == (1, 1)
    assert sum(o["share"] for o in out) == pytest.approx(1.0)
    # the top 1% of 5 sequences is one sequence: seq 10
    assert result.flat()["outlier_share_top1pct"] == pytest.approx(seq[10] / total, rel=1e-6)
    assert "threshold_sweep" in result.to_json_dict() and "outliers" in result.to_json_dict()


def test_entropy_mean_and_deciles(tmp_path: Path) -> None:
    #        seq 10        seq 7       seq 3                 pad   seq 5
    values = [0.0, 0.5, 2.0, 1.0, None, 3.0, 3.0, 3.0, 3.0, None, 0.25, 4.0]
    got = compute_metrics(write_store(tmp_path / "t.parquet", values))
    present = [v for v in values if v is not None]
    assert got.flat()["entropy_mean"] == approx(sum(present) / len(present))
    curve = got.curves["entropy"]
    assert curve["available"] and curve["tokens"] == len(present) == 10
    bins = curve["bins"]
    assert sum(b["count"] for b in bins) == 10
    assert [b["q_hi"] for b in bins][-1] == 1.0
    # the four tokens at 3.0 share one grid bin: one merged bin holds them all
    three = [b for b in bins if b["lo"] <= 3.0 < b["hi"]]
    assert len(three) == 1 and three[0]["count"] == 4
    assert three[0]["mean_k3"] == approx(k3(0.6) / 4)  # seq 3's tokens, rho 1, 0.6, 1, 1
    assert bins[0]["lo"] == GRID[0] == 0.0 and bins[0]["mean_entropy"] == 0.0


def test_entropy_absent_or_null_is_not_made_up(tmp_path: Path) -> None:
    for values in (None, [None] * 12):
        got = compute_metrics(write_store(tmp_path / "t.parquet", values))
        assert "entropy_mean" not in got.flat()
        assert got.curves["entropy"] == {"available": False, "tokens": 0, "bins": []}


def test_top1pct_over_many_sequences(tmp_path: Path) -> None:
    """200 sequences: the top 1% is the two of largest k3 sum, whatever the row groups."""
    rng = np.random.default_rng(0)
    r = rng.normal(0, 0.05, (200, 4))
    r[17, 0], r[150, 2] = 2.0, -1.5
    rows = {
        "seq_id": np.repeat(np.arange(200), 4),
        "position": np.tile(np.arange(4), 200),
        "rollout_logprob": np.full(800, -2.0),
        "train_logprob": -2.0 + r.ravel(),
    }
    path = tmp_path / "many.parquet"
    pq.write_table(pa.table(rows), path, row_group_size=37)
    got = compute_metrics(path)
    sums = (np.exp(r) - 1 - r).sum(-1)
    top = np.sort(sums)[::-1]
    assert got.flat()["outlier_share_top1pct"] == pytest.approx(top[:2].sum() / sums.sum())
    assert [o["seq_id"] for o in got.tables["outliers"][:2]] == [17, 150]
    assert len(got.tables["outliers"]) == 20


def test_entropy_deciles_of_distinct_values(tmp_path: Path) -> None:
    """11 valid tokens with distinct entropies 0.5, 1.0, ..., 5.5: deciles of 1.1 tokens each
    on a 0.005-nat grid: every bin holds whole tokens, in order, and the k3 of each is its own."""
    values = [0.5 * (i + 1) for i in range(12)]
    values[9] = None  # the padding row of the empty seq 12 (no entropy there)
    got = compute_metrics(write_store(tmp_path / "t.parquet", values)).curves["entropy"]
    bins = got["bins"]
    assert [b["count"] for b in bins] == [2, 1, 1, 1, 1, 1, 1, 1, 1, 1]  # 11 tokens, 10 bins
    assert [b["q_hi"] for b in bins] == pytest.approx([(2 + i) / 11 for i in range(10)])
    assert all(b["lo"] <= b["mean_entropy"] < b["hi"] for b in bins)
    assert bins[0]["mean_entropy"] == pytest.approx(0.75)  # tokens of entropy 0.5 and 1.0
    rho = [r for _, _, _, rhos in SEQS if rhos for r in rhos]  # file order = entropy order
    assert bins[-1]["mean_k3"] == pytest.approx(k3(rho[-1]), abs=1e-12)
