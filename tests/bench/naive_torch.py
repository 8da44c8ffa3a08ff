"""The naive way, for the bench: read the whole store, pad to ``[S, T]`` torch tensors, compute.

This is what a training framework does with one batch (verl's helper works on padded float32
tensors), applied to a whole token store: memory grows with ``S * T``. It covers the configured
IS metrics' core, the off-policy metrics, the main diagnostics and the presets' masked
fractions, enough for the bench to compare time, memory and values with the streaming engine.
torch is imported inside the functions (heavy import).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.parquet as pq

from mismatch_probe.metrics.batch import EPS, LOGPROB_FLOOR, SAFETY_BOUND
from mismatch_probe.metrics.config import ISSpec, MetricsConfig, PresetSpec, RSSpec
from mismatch_probe.metrics.diagnostics import SPEC_TAUS, f_tau_key

if TYPE_CHECKING:
    import torch

COLUMNS = ["seq_id", "position", "rollout_logprob", "train_logprob"]


def load_padded(path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(train, rollout, mask)`` float32 ``[S, T]`` tensors of a whole store (rows in order)."""
    import torch

    table = pq.read_table(path, columns=COLUMNS)
    seq = table.column("seq_id").to_numpy()
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    lengths = np.diff(np.r_[starts, len(seq)])
    rows = np.repeat(np.arange(len(starts)), lengths)
    cols = np.arange(len(seq)) - np.repeat(starts, lengths)
    shape = (len(starts), int(lengths.max()))
    out = []
    for name in ("train_logprob", "rollout_logprob"):
        dense = torch.zeros(shape, dtype=torch.float32)
        values = torch.from_numpy(table.column(name).to_numpy().astype(np.float32))
        dense[torch.from_numpy(rows), torch.from_numpy(cols)] = values.clamp_min(LOGPROB_FLOOR)
        out.append(dense)
    mask = torch.zeros(shape, dtype=torch.float32)
    mask[torch.from_numpy(rows), torch.from_numpy(cols)] = 1.0
    return out[0], out[1], mask


def _mmean(x: torch.Tensor, m: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * m).sum() / (m.sum() + EPS)
    return (x * m).sum(dim) / (m.sum(dim) + EPS)


def _weights(r: torch.Tensor, m: torch.Tensor, spec: ISSpec) -> torch.Tensor:
    import torch

    if spec.level == "token":
        raw = torch.exp(r.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
    else:
        s = (r * m).sum(-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        raw = torch.exp(s) * m
    if spec.lower is None:
        return raw.clamp(max=spec.upper)
    return torch.where((raw >= spec.lower) & (raw <= spec.upper), raw, torch.zeros_like(raw))


def _keep(r: torch.Tensor, m: torch.Tensor, spec: RSSpec) -> torch.Tensor:
    rs = r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    tok = {"k1": -rs, "k2": 0.5 * rs * rs, "k3": rs.exp() - 1 - rs}[spec.estimator]
    reduce = {
        "token": lambda x: x,
        "seq_sum": lambda x: (x * m).sum(-1, keepdim=True),
        "seq_mean": lambda x: _mmean(x, m, -1).unsqueeze(-1),
        "seq_max": lambda x: x.masked_fill(m == 0, 0.0).amax(-1, keepdim=True),
    }
    stat = reduce[spec.aggregation](tok).expand_as(r)
    keep = stat <= spec.hi
    return keep & (stat >= spec.lo) if spec.lo is not None else keep


def _ess(c: torch.Tensor, m: torch.Tensor) -> float:
    if float((c * c * m).sum()) == 0.0:
        return 0.0
    return float(1.0 / _mmean((c / (_mmean(c, m) + EPS)) ** 2, m))


def _preset(r: torch.Tensor, m: torch.Tensor, p: PresetSpec) -> dict[str, float]:
    c = m.clone() if p.is_spec is None else _weights(r, m, p.is_spec).clamp(0, p.is_spec.upper)
    for spec in p.rs_specs:
        c = c * _keep(r, m, spec)
    masked = (c == 0) & (m > 0)
    key = f"presets/{p.name}"
    return {
        f"{key}/token_masked_fraction": float(_mmean(masked.float(), m)),
        f"{key}/seq_masked_fraction": float(masked.any(-1).float().mean()),
        f"{key}/eff_sample_size": _ess(c, m),
    }


def naive_torch_metrics(path: Path, config: MetricsConfig) -> dict[str, float]:
    """A subset of ``compute_metrics(path, config).flat()``, computed densely with torch."""
    import torch

    train, rollout, m = load_padded(path)
    r = train - rollout
    out = {"num_tokens": float(m.sum()), "num_sequences": float(m.shape[0])}
    if config.is_spec is not None:
        w = _weights(r, m, config.is_spec)
        out["rollout_is_mean"] = float(_mmean(w, m))
        out["rollout_is_eff_sample_size"] = _ess(w.clamp(0, config.is_spec.upper), m)
    out["kl"] = float(_mmean(rollout - train, m))
    out["k3_kl"] = float(_mmean(torch.expm1(r) - r, m))
    mean_train = _mmean(train, m, -1)
    out["training_ppl"] = float(torch.exp(-mean_train).mean())
    out["chi2_token"] = float(_mmean(torch.exp(r.clamp(-SAFETY_BOUND, SAFETY_BOUND)) ** 2, m) - 1)
    dp = (train.clamp(max=0).exp() - rollout.clamp(max=0).exp()).abs() * m
    out["prob_abs_diff_mean"] = float(_mmean(dp, m))
    out["prob_abs_diff_max"] = float(dp.max())
    for tau in SPEC_TAUS:
        out[f_tau_key(tau)] = float(_mmean((r.abs() > math.log(tau)).float(), m))
    for preset in config.preset_specs:
        out.update(_preset(r, m, preset))
    return out
