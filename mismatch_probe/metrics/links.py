"""The links of ``probe refit``: two scorings of the same tokens, compared position by position.

A side is, per sequence, ``{token index: log-probability}`` (a scoring through the prefix cache
returns only the positions after the request's cached tokens). A link compares the positions
both sides scored, with the sign convention of the metrics (``r = upper - lower``, the upper
side in the place of the training side): ``k3_kl = mean(expm1(r) - r)``, ``kl = mean(-r)``,
``max_abs = max |r|``, ``bitwise_identical_fraction``, in float64. ``positions`` is the same
per token index (the per-position view: where a stale prefix acts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mismatch_probe.metrics.batch import k3_terms

Side = Sequence[Mapping[int, float]]  # per sequence: token index -> log-probability
FLOAT_MAX = 1.7976931348623157e308


def _capped(value: float) -> float:
    return value if math.isfinite(value) else FLOAT_MAX


def compare(lower: Side, upper: Side) -> dict[str, Any]:
    """The link from ``lower`` to ``upper`` over the positions both scored (see module)."""
    import numpy as np

    rs: list[float] = []
    index: list[int] = []
    for low, up in zip(lower, upper, strict=True):
        for i in sorted(set(low) & set(up)):
            rs.append(float(up[i]) - float(low[i]))
            index.append(i)
    r = np.asarray(rs, dtype=np.float64)
    at = np.asarray(index, dtype=np.int64)
    if r.size == 0:
        return {"tokens": 0, "k3_kl": 0.0, "kl": 0.0, "max_abs": 0.0,
                "bitwise_identical_fraction": 1.0, "positions": []}  # fmt: skip
    k3 = k3_terms(r)
    positions = []
    for p in np.unique(at):
        mask = at == p
        positions.append(
            {
                "position": int(p),
                "tokens": int(mask.sum()),
                "k3_kl": _capped(float(k3[mask].mean())),
                "max_abs": float(np.abs(r[mask]).max()),
            }
        )
    return {
        "tokens": int(r.size),
        "k3_kl": _capped(float(k3.mean())),
        "kl": float((-r).mean()),
        "max_abs": float(np.abs(r).max()),
        "bitwise_identical_fraction": float((r == 0).mean()),
        "positions": positions,
    }
