"""Types of the compiled metric loops (``_kernels.c``; its header says what each adds)."""

from typing import Any

def curves(
    r: Any,
    abs_r: Any,
    k3: Any,
    dp: Any,
    p_rollout: Any,
    p_train: Any,
    position: Any,
    hist_bounds: Any,
    hist_scale: float,
    hist_offset: float,
    hist_lo: float,
    hist_step: float,
    pos_edges: Any,
    prob_edges: Any,
    hist2d_bins: int,
    hist: Any,
    hist2d: Any,
    cell_count: Any,
    cell_sums: Any,
) -> None: ...
def thresholds(
    x: Any, center: float, above: Any, below: Any, n_above: Any, n_below: Any
) -> tuple[float, float]: ...
def is_stats(
    raw: Any,
    sequence: bool,
    seg: Any,
    valid: Any,
    upper: float,
    lower: float,
    starts: Any,
    seg_sums: Any,
    seg_zeros: Any,
) -> tuple[float, float, float, float, int, int]: ...
def integrity(
    pos: Any,
    train: Any,
    rollout: Any,
    valid: Any,
    flip: Any,
    starts: Any,
    limits: Any,
    copy_min: int,
    counts: Any,
    sums: Any,
    x: Any,
    y: Any,
    neg: Any,
    pos_abs: Any,
) -> None: ...
