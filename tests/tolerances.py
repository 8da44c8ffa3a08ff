"""Numeric tolerances derived from floating-point spacing, not from the machine a test ran on.

Two computations of the same float values that differ only in the order of their sums (another
batch layout, a replayed route, another GEMM blocking: AVX-512, AVX-512-BF16 or AMX kernels all
block differently) agree to a few units in the last place (ulps) of the values involved, scaled
by the largest magnitude that enters the result. A log-probability ``logit - logsumexp`` carries
the rounding of both terms, so the scale is the largest |log-prob| compared (at least 1).
"""

from __future__ import annotations

import numpy as np

# ulps allowed for a network output whose sums were reordered: each of the few layers of a tiny
# model adds a few ulps of rounding difference, and log-softmax adds its own; 16 covers that with
# room (the largest seen, on an AVX-512-BF16 machine, was under 3).
REORDER_ULPS = 16

EPS = {
    "float32": float(np.finfo(np.float32).eps),
    "float16": float(np.finfo(np.float16).eps),
    "bfloat16": 2.0**-7,  # 8 significand bits (7 stored)
}


def ulp_bound(*values: np.ndarray, dtype: str = "float32", ulps: int = REORDER_ULPS) -> float:
    """``ulps`` units in the last place of ``dtype`` at the largest finite magnitude in
    ``values`` (at least 1): the most two reorderings of the same computation may differ by."""
    finite = [np.abs(v[np.isfinite(v)]) for v in map(np.asarray, values)]
    scale = max([1.0, *(float(f.max()) for f in finite if f.size)])
    return ulps * EPS[dtype] * scale
