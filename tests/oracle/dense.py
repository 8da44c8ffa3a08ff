"""The oracle's dense batch: padded ``[S, T]`` arrays of every token, and verl's masked
reductions on them. Shared by ``reference`` (verl's metrics) and ``diagnostics`` (ours)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.batch import EPS, SAFETY_BOUND, normalize_logprobs


@dataclass(frozen=True)
class Dense:
    """A padded batch. ``[S, T]`` arrays unless noted; ``r = train - rollout``."""

    train: np.ndarray
    rollout: np.ndarray
    r: np.ndarray
    m: np.ndarray  # float64 0/1
    seq_ids: np.ndarray  # [S]
    positions: np.ndarray
    flip: np.ndarray | None
    token_ids: np.ndarray | None

    @property
    def mb(self) -> np.ndarray:
        return self.m > 0


def msum(x: np.ndarray, m: np.ndarray, axis: int | None = None) -> np.ndarray:
    return np.where(m > 0, x, 0.0).sum(axis=axis)


def mmean(x: np.ndarray, m: np.ndarray, axis: int | None = None) -> np.ndarray:
    """verl's ``masked_mean``: ``sum(x * m) / (sum(m) + 1e-8)``."""
    return msum(x, m, axis) / (m.sum(axis=axis) + EPS)


def clamp_b(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -SAFETY_BOUND, SAFETY_BOUND)


def std1(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def make_dense(
    train: np.ndarray,
    rollout: np.ndarray,
    mask: np.ndarray,
    seq_ids: np.ndarray | None = None,
    positions: np.ndarray | None = None,
    flip: np.ndarray | None = None,
    token_ids: np.ndarray | None = None,
) -> Dense:
    """Validate shapes and apply the input rules (floor, NaN check) to ``[S, T]`` arrays."""
    train, rollout, mask = np.asarray(train), np.asarray(rollout), np.asarray(mask)
    for name, arr in (("rollout_lp", rollout), ("mask", mask)):
        if arr.shape != train.shape:
            raise ProbeError(f"train_lp shape {train.shape} differs from {name} shape {arr.shape}")
    mb = mask.astype(bool)
    if not mb.any():
        raise ProbeError("no valid response token")
    tr = normalize_logprobs(train, mb, "train_logprob")
    ro = normalize_logprobs(rollout, mb, "rollout_logprob")
    s, t = train.shape
    return Dense(
        train=tr,
        rollout=ro,
        r=tr - ro,
        m=mb.astype(np.float64),
        seq_ids=np.arange(s) if seq_ids is None else np.asarray(seq_ids),
        positions=np.broadcast_to(np.arange(t), (s, t)) if positions is None else positions,
        flip=None if flip is None else np.asarray(flip, dtype=bool),
        token_ids=token_ids,
    )
