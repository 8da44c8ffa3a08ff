"""The oracle of the section-6 measures (see ``parity.py``), on dense ``[S, T]``
arrays: every valid token at once, the first token of a sequence found by a full sort."""

from __future__ import annotations

import numpy as np

from mismatch_probe.metrics.accum import capped
from tests.oracle.dense import Dense, clamp_b, mmean


def parity_metrics(d: Dense) -> dict[str, float]:
    m, r = d.m, d.r
    mult = np.exp(clamp_b(np.abs(r)))
    valid = m.sum(-1) > 0
    seq_mult = mmean(mult, m, axis=-1)[valid]
    with np.errstate(over="ignore"):
        k3_rev, over = capped(float(mmean(np.exp(-r) + r - 1.0, m)))
    first = np.zeros(m.shape, dtype=bool)
    for i in np.flatnonzero(valid):
        cols = np.flatnonzero(m[i] > 0)
        first[i, cols[np.argsort(np.asarray(d.positions)[i, cols], kind="stable")[0]]] = True
    rest = (m > 0) & ~first
    abs_r = np.abs(r)
    return {
        "token_mult_prob_error": float(mmean(mult, m)),
        "seq_mult_prob_error_max": float(seq_mult.max()) if len(seq_mult) else 0.0,
        "seq_mult_prob_error_mean": float(seq_mult.mean()) if len(seq_mult) else 0.0,
        "seq_mult_prob_error_min": float(seq_mult.min()) if len(seq_mult) else 0.0,
        "k3_kl_reverse": k3_rev,
        "k3_kl_reverse_overflow": float(over),
        "bitwise_identical_fraction": float(mmean((d.train == d.rollout).astype(float), m)),
        "ratio_tokens_different": float(mmean((abs_r > 1e-6).astype(float), m)),
        "first_token_abs_log_ratio_mean": float(abs_r[first].mean()) if first.any() else 0.0,
        "rest_abs_log_ratio_mean": float(abs_r[rest].mean()) if rest.any() else 0.0,
        **parity_block(d),
    }


def parity_block(d: Dense) -> dict[str, float]:
    """The parity block (spec section 9) over every valid token at once."""
    valid = d.m > 0
    train, rollout = (np.asarray(x)[valid].astype(np.float32) for x in (d.train, d.rollout))
    with np.errstate(over="ignore"):
        k3 = np.expm1(d.r) - d.r
    differ = int((train != rollout).sum())
    return {
        "parity/token_count": float(valid.sum()),
        "parity/torch_equal_fp32": float(differ == 0),
        "parity/mismatch_count": float(differ),
        "parity/max_absdiff_fp32": float(np.abs(train - rollout).max()) if valid.any() else 0.0,
        "parity/k3_mean": capped(float(mmean(k3, d.m)))[0],
        "parity/k3_max": capped(float(k3[valid].max()))[0] if valid.any() else 0.0,
    }
