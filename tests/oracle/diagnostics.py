"""The oracle of our diagnostics and curves (``metrics/diagnostics.py``, ``metrics/curves.py``).

Dense ``[S, T]`` arrays, every valid token at once: histograms over the whole list, worst tokens
by one full sort, the sequence sample by sorting every hash. Bins are computed here, by their
definitions (not with the engine's helpers); shared with the engine are the constants only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mismatch_probe.metrics.accum import DEGENERATE_VAR
from mismatch_probe.metrics.batch import prob
from mismatch_probe.metrics.curves import (
    LOG_RATIO_BINS,
    LOG_RATIO_RANGE,
    POSITION_EDGES,
    PROB_EDGES,
    PROB_HIST_BINS,
    SEQ_SAMPLE,
    WORST_TOKENS,
)
from mismatch_probe.metrics.diagnostics import IPO_EPS, SEQ_DP_LIMIT, SPEC_TAUS, TAU_GRID, f_tau_key
from tests.oracle.dense import Dense, clamp_b, mmean, msum


def bin_index(values: np.ndarray, edges: tuple[float, ...], open_last: bool) -> np.ndarray:
    """Bin ``i`` holds ``edges[i] <= x < edges[i + 1]``; values below the first edge go to bin
    0, the rest past the last bin to the last one (``open_last``: one more bin from the last
    edge on). Counted edge by edge: the number of inner edges each value has reached."""
    nbins = len(edges) if open_last else len(edges) - 1
    reached = sum((values >= edge).astype(np.int64) for edge in edges[1:])
    return np.minimum(reached, nbins - 1)


def prob_hist2d(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``[B, B]`` counts over ``[0, 1]^2`` in ``B`` equal cells per axis, 1.0 in the last."""
    nb = PROB_HIST_BINS
    out = np.zeros((nb, nb), dtype=np.int64)
    for a, b in zip(np.clip(x, 0.0, 1.0), np.clip(y, 0.0, 1.0), strict=True):
        out[min(int(a * nb), nb - 1), min(int(b * nb), nb - 1)] += 1
    return out


def seq_hash(seq_id: np.ndarray) -> np.ndarray:
    """splitmix64 (Steele et al.) of each id: the documented sampling key, written out."""
    mask = (1 << 64) - 1
    out = []
    for value in seq_id.tolist():
        z = (value + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return np.array(out, dtype=np.uint64)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if min(np.var(x), np.var(y)) <= DEGENERATE_VAR:
        return 1.0 if np.array_equal(x, y) else 0.0
    return float(np.clip(np.corrcoef(x, y)[0, 1], -1.0, 1.0))


def _slope(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)``; slope 0 when every x is the same."""
    if len(x) == 0:
        return 0.0, 0.0
    dx = x - x.mean()
    sxx = float(dx @ dx)
    slope = 0.0 if sxx <= DEGENERATE_VAR * len(x) else float(dx @ (y - y.mean())) / sxx
    return slope, float(y.mean() - slope * x.mean())


def _spread(r: np.ndarray) -> np.ndarray:
    return np.exp(np.minimum(np.abs(r), 700.0))


def diagnostic_metrics(d: Dense) -> dict[str, float]:
    m, mb = d.m, d.mb
    dp = np.abs(prob(d.train) - prob(d.rollout))
    seq_dp_max = np.where(mb, dp, 0.0).max(-1)
    out = {
        "log_ratio_abs_mean": float(mmean(np.abs(d.r), m)),
        "log_ratio_abs_max": float(np.abs(d.r[mb]).max()),
        "prob_abs_diff_mean": float(mmean(dp, m)),
        "prob_abs_diff_max": float(dp[mb].max()),
        "seq_prob_abs_diff_max_mean": float(seq_dp_max.mean()),
        f"seq_prob_abs_diff_max_gt_{SEQ_DP_LIMIT:g}": float((seq_dp_max > SEQ_DP_LIMIT).mean()),
        "prob_pearson": _pearson(prob(d.train[mb]), prob(d.rollout[mb])),
    }
    for tau in SPEC_TAUS:
        out[f_tau_key(tau)] = float(mmean((_spread(d.r) > tau) * 1.0, m))
    for eps in IPO_EPS:
        out[f"ipo_masked_fraction_{eps:g}"] = float(mmean((dp > eps) * 1.0, m))
    if d.flip is not None:
        flip = d.flip & mb
        abs_r, k3 = np.abs(d.r), np.expm1(clamp_b(d.r)) - clamp_b(d.r)
        total_abs, total_k3 = float(msum(abs_r, m)), float(msum(k3, m))
        out["support_flip_fraction"] = float(mmean(flip * 1.0, m))
        out["support_flip_abs_log_ratio_share"] = (
            float(abs_r[flip].sum()) / total_abs if total_abs > 0 else 0.0
        )
        out["support_flip_k3_share"] = float(k3[flip].sum()) / total_k3 if total_k3 > 0 else 0.0
    valid = m.sum(-1) > 0
    x, y = m.sum(-1)[valid] / 1000.0, msum(d.r, m, -1)[valid]
    out["seq_log_ratio_slope_per_1k"] = _slope(x, y)[0]
    return out


def _bins(keys: np.ndarray, edges: tuple[float, ...], open_last: bool, d: Dense) -> list[dict]:
    mb = d.mb
    r = d.r[mb]
    values = {
        "log_ratio": r,
        "abs_log_ratio": np.abs(r),
        "k3": np.expm1(clamp_b(r)) - clamp_b(r),
        "prob_abs_diff": np.abs(prob(d.train[mb]) - prob(d.rollout[mb])),
    }
    idx = bin_index(keys, edges, open_last)
    total = float(np.abs(r).sum())
    rows = []
    for i in range(len(edges) if open_last else len(edges) - 1):
        sel = idx == i
        k = int(sel.sum())
        row: dict[str, Any] = {
            "lo": edges[i],
            "hi": edges[i + 1] if i + 1 < len(edges) else None,
            "count": k,
        }
        row.update({f"mean_{n}": float(v[sel].sum()) / k if k else 0.0 for n, v in values.items()})
        row["abs_log_ratio_share"] = float(np.abs(r[sel]).sum()) / total if total else 0.0
        rows.append(row)
    return rows


def _worst(d: Dense) -> list[dict[str, Any]]:
    rows, cols = np.nonzero(d.mb)
    abs_r = np.abs(d.r[rows, cols])
    seq_ids, positions = d.seq_ids[rows], d.positions[rows, cols]
    order = np.lexsort((positions, seq_ids, -abs_r))[:WORST_TOKENS]
    return [
        {
            "seq_id": int(seq_ids[k]),
            "position": int(positions[k]),
            "token_id": None if d.token_ids is None else int(d.token_ids[rows[k], cols[k]]),
            "log_ratio": float(d.r[rows[k], cols[k]]),
            "train_logprob": float(d.train[rows[k], cols[k]]),
            "rollout_logprob": float(d.rollout[rows[k], cols[k]]),
            "support_flip": None if d.flip is None else bool(d.flip[rows[k], cols[k]]),
        }
        for k in order
    ]


def _seq_sample(d: Dense) -> dict[str, Any]:
    valid = d.m.sum(-1) > 0
    ids, lengths = d.seq_ids[valid], d.m.sum(-1)[valid]
    sums = msum(d.r, d.m, -1)[valid]
    slope, intercept = _slope(lengths / 1000.0, sums)
    pick = np.argsort(seq_hash(ids), kind="stable")[:SEQ_SAMPLE]
    pick = pick[np.argsort(ids[pick], kind="stable")]
    return {
        "slope_per_1k": slope,
        "intercept": intercept,
        "seq_id": ids[pick].tolist(),
        "length": lengths[pick].astype(int).tolist(),
        "log_ratio_sum": sums[pick].tolist(),
    }


def diagnostic_curves(d: Dense) -> dict[str, Any]:
    mb = d.mb
    r = d.r[mb]
    p_rollout, p_train = prob(d.rollout[mb]), prob(d.train[mb])
    n = d.m.sum()
    return {
        "f_tau": [
            {"tau": tau, "fraction": float((_spread(r) > tau).sum() / (n + 1e-8))}
            for tau in TAU_GRID
        ],
        "log_ratio_hist": {
            "lo": LOG_RATIO_RANGE[0],
            "hi": LOG_RATIO_RANGE[1],
            "counts": np.histogram(r, LOG_RATIO_BINS, LOG_RATIO_RANGE)[0].tolist(),
            "underflow": int((r < LOG_RATIO_RANGE[0]).sum()),
            "overflow": int((r > LOG_RATIO_RANGE[1]).sum()),
        },
        "prob_hist2d": {
            "x": "rollout_prob",
            "y": "train_prob",
            "counts": prob_hist2d(p_rollout, p_train).tolist(),
        },
        "position_bins": _bins(d.positions[mb], POSITION_EDGES, True, d),
        "rollout_prob_bins": _bins(p_rollout, PROB_EDGES, False, d),
        "worst_tokens": _worst(d),
        "seq_log_ratio_vs_length": _seq_sample(d),
    }
