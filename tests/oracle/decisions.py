"""The oracle of spec section 7 on dense ``[S, T]`` arrays: clip fractions, the threshold sweep,
outliers, the sequence-weight histogram (written from the spec, not from the engine's code;
the constants are shared). Entropy is absent here: a ``Dense`` batch has no ``train_entropy``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mismatch_probe.metrics.decisions import (
    CLIP_EPS,
    K3_THRESHOLDS,
    RATIO_THRESHOLDS,
    SEQ_WEIGHT_BINS,
    SEQ_WEIGHT_RANGE,
)
from mismatch_probe.metrics.outliers import TOP_OUTLIERS
from tests.oracle.dense import Dense, clamp_b, mmean, msum


def _k3(d: Dense) -> np.ndarray:
    rs = clamp_b(d.r)
    return np.expm1(rs) - rs  # exp(rs) - 1 - rs without the cancellation near 0


def _masks(d: Dense) -> dict[str, list[tuple[float, np.ndarray]]]:
    """family -> [(threshold, [S, T] bool masked)]."""
    rho = np.exp(clamp_b(d.r))
    q_raw = mmean(np.exp(clamp_b(msum(d.r, d.m, -1)))[:, None] * d.m, d.m, -1)
    k3_mean = mmean(_k3(d), d.m, -1)
    return {
        "token_tis": [(c, rho > c) for c in RATIO_THRESHOLDS],
        "token_icepop": [(c, (rho > c) | (rho < 1 / c)) for c in RATIO_THRESHOLDS],
        "seq_is": [(c, np.broadcast_to((q_raw > c)[:, None], d.r.shape)) for c in RATIO_THRESHOLDS],
        "seq_mean_k3": [
            (u, np.broadcast_to((k3_mean > u)[:, None], d.r.shape)) for u in K3_THRESHOLDS
        ],
    }


def threshold_sweep(d: Dense) -> list[dict[str, Any]]:
    rows = []
    for family, cases in _masks(d).items():
        for threshold, masked in cases:
            masked = masked & d.mb
            rows.append(
                {
                    "family": family,
                    "threshold": threshold,
                    "token_fraction": float(mmean(masked * 1.0, d.m)),
                    "seq_fraction": float(masked.any(-1).mean()),
                }
            )
    return rows


def decision_metrics(d: Dense) -> dict[str, float]:
    rho = np.exp(clamp_b(d.r))
    out = {f"clip_fraction_{e:g}": float(mmean((np.abs(rho - 1) > e) * 1.0, d.m)) for e in CLIP_EPS}
    sums = msum(_k3(d), d.m, -1)[d.m.sum(-1) > 0]
    k = max(1, math.ceil(0.01 * d.m.shape[0]))
    total = sums.sum()
    out["outlier_share_top1pct"] = float(np.sort(sums)[::-1][:k].sum() / total) if total else 0.0
    return out


def outliers(d: Dense) -> list[dict[str, Any]]:
    sums = msum(_k3(d), d.m, -1)
    total = float(sums.sum())
    valid = np.flatnonzero(d.m.sum(-1) > 0)
    order = valid[np.lexsort((d.seq_ids[valid], -sums[valid]))][:TOP_OUTLIERS]
    out = []
    for i in order:
        cols = np.flatnonzero(d.mb[i])
        abs_r = np.abs(d.r[i, cols])
        worst = cols[np.lexsort((d.positions[i, cols], -abs_r))[0]]
        out.append(
            {
                "setting": None,
                "seq_id": int(d.seq_ids[i]),
                "prompt_id": None,
                "sample_id": None,
                "tokens": int(d.m[i].sum()),
                "seq_k3_sum": float(sums[i]),
                "worst_position": int(d.positions[i, worst]),
                "worst_abs_log_ratio": float(abs(d.r[i, worst])),
                "share": float(sums[i]) / total if total > 0 else 0.0,
            }
        )
    return out


def decision_curves(d: Dense) -> dict[str, Any]:
    s = msum(d.r, d.m, -1)[d.m.sum(-1) > 0]
    lo, hi = SEQ_WEIGHT_RANGE
    return {
        "seq_weight_hist": {
            "lo": lo,
            "hi": hi,
            "counts": np.histogram(s, SEQ_WEIGHT_BINS, SEQ_WEIGHT_RANGE)[0].tolist(),
            "underflow": int((s < lo).sum()),
            "overflow": int((s > hi).sum()),
        },
        "entropy": {"available": False, "tokens": 0, "bins": []},
    }
