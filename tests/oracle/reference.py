"""The test oracle: the spec's formulas on dense padded ``[S, T]`` arrays.

A line-by-line numpy port of verl's ``rollout_corr_helper`` (same masked means, same order of
operations), written independently of the streaming engine so that the tests and the bench can
check one against the other. It holds every token in memory: use it on small batches only.

Shared with the engine (definitions, not computations): the input rules of
``batch.normalize_logprobs``, the constants (B, 1e-8, bins, taus) and the config records.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from mismatch_probe.metrics.accum import capped, exp_capped
from mismatch_probe.metrics.batch import EPS, SAFETY_BOUND
from mismatch_probe.metrics.config import ISSpec, MetricsConfig, PresetSpec, RSSpec
from mismatch_probe.metrics.stream import MetricsResult
from tests.oracle.decisions import decision_curves, decision_metrics, outliers, threshold_sweep
from tests.oracle.dense import Dense, clamp_b, make_dense, mmean, msum, std1
from tests.oracle.diagnostics import diagnostic_curves, diagnostic_metrics
from tests.oracle.parity import parity_metrics

__all__ = ["Dense", "make_dense", "reference_metrics", "to_table"]


def is_weights(d: Dense, spec: ISSpec) -> tuple[np.ndarray, np.ndarray]:
    """``(raw_w, w)`` ``[S, T]``: verl's ``compute_rollout_correction_weights``."""
    if spec.level == "token":
        raw = np.exp(clamp_b(d.r)) * d.m
    else:
        raw = np.exp(clamp_b(msum(d.r, d.m, -1)))[:, None] * d.m
    if spec.lower is None:
        return raw, np.minimum(raw, spec.upper)
    return raw, np.where((raw >= spec.lower) & (raw <= spec.upper), raw, 0.0)


def is_metrics(d: Dense, spec: ISSpec, batch_normalize: bool) -> dict[str, float]:
    raw, w = is_weights(d, spec)
    m, mb, upper, low = d.m, d.mb, spec.upper, spec.low
    out = {"rollout_is_mean": float(mmean(w, m))}
    if spec.level == "sequence":
        s = msum(d.r, m, -1)
        out["rollout_is_max"] = math.exp(min(s.max(), SAFETY_BOUND))
        out["rollout_is_min"] = exp_capped(float(s.min()))
        out["rollout_is_ratio_fraction_high"] = float((s > math.log(upper)).mean())
        out["rollout_is_ratio_fraction_low"] = float((s < math.log(low)).mean())
    else:
        out["rollout_is_max"] = float(w[mb].max())
        out["rollout_is_min"] = float(w[mb].min())
        out["rollout_is_ratio_fraction_high"] = float(mmean((raw > upper) * 1.0, m))
        out["rollout_is_ratio_fraction_low"] = float(mmean((raw < low) * 1.0, m))
    c = np.clip(w, 0.0, upper)
    var = mmean(c**2, m) - mmean(c, m) ** 2
    out["rollout_is_std"] = math.sqrt(max(0.0, var)) if m.sum() > 1 else 0.0
    zero = msum(c**2, m) == 0
    out["rollout_is_eff_sample_size"] = (
        0.0 if zero else min(1.0, float(1.0 / mmean((c / (mmean(c, m) + EPS)) ** 2, m)))
    )
    q, q_raw = mmean(w, m, -1), mmean(raw, m, -1)
    out["rollout_is_seq_mean"] = float(q.mean())
    out["rollout_is_seq_std"] = std1(q)
    out["rollout_is_seq_max"] = float(q.max())
    out["rollout_is_seq_min"] = float(q.min())
    out["rollout_is_seq_max_deviation"] = float(np.abs(q - 1.0).max())
    out["rollout_is_seq_fraction_high"] = float((q_raw > upper).mean())
    out["rollout_is_seq_fraction_low"] = float((q_raw < low).mean())
    if spec.icepop:
        out["rollout_is_oob_ratio"] = float(mmean(((raw < low) | (raw > upper)) * 1.0, m))
    if batch_normalize:
        valid = m.sum(-1) > 0
        level_mean = (
            mmean(w, m) if spec.level == "token" else q[valid].sum() / max(valid.sum(), EPS)
        )
        out["rollout_is_batch_norm_factor"] = float(level_mean) if level_mean > EPS else 1.0
    return out


def _seq_max(x: np.ndarray, d: Dense) -> np.ndarray:
    return np.where(d.m.sum(-1) > 0, np.where(d.mb, x, -np.inf).max(-1), 0.0)


SEQ_REDUCTIONS = {
    "seq_sum": lambda x, d: msum(x, d.m, -1),
    "seq_mean": lambda x, d: mmean(x, d.m, -1),
    "seq_max": _seq_max,
}


def rs_option(d: Dense, spec: RSSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(token_stat [S, T], v [S], keep [S, T])`` of one option."""
    rs = clamp_b(d.r)
    tok = {"k1": -rs, "k2": 0.5 * rs**2, "k3": np.expm1(rs) - rs}[spec.estimator]
    if spec.aggregation == "token":
        stat, v = tok, mmean(tok, d.m, -1)
    else:
        v = SEQ_REDUCTIONS[spec.aggregation](tok, d)
        stat = np.broadcast_to(v[:, None], d.r.shape)
    keep = stat <= spec.hi
    if spec.lo is not None:
        keep = keep & (stat >= spec.lo)
    return stat, v, keep


def rs_option_metrics(d: Dense, spec: RSSpec, keep: np.ndarray, stat, v) -> dict[str, float]:
    """verl's ``compute_rs_metrics`` plus the per-option masked fractions."""
    p, m, mb = f"rollout_rs_{spec.option}", d.m, d.mb
    valid = m.sum(-1) > 0
    vv = v[valid]
    hi, k1 = spec.hi, spec.lo is not None
    lo = spec.lo if k1 else 0.0
    out = {f"{p}_mean": float(mmean(stat, m))}
    if spec.aggregation != "token":
        out[f"{p}_max"], out[f"{p}_min"] = float(vv.max()), float(vv.min())
        out[f"{p}_fraction_high"] = float((vv > hi).mean())
        out[f"{p}_fraction_low"] = float((vv < lo).mean()) if k1 else 0.0
    else:
        out[f"{p}_max"], out[f"{p}_min"] = float(stat[mb].max()), float(stat[mb].min())
        out[f"{p}_fraction_high"] = float(mmean((stat > hi) * 1.0, m))
        out[f"{p}_fraction_low"] = float(mmean((stat < lo) * 1.0, m)) if k1 else 0.0
    c = np.clip(stat, lo, hi)
    var = mmean(c**2, m) - mmean(c, m) ** 2
    out[f"{p}_std"] = math.sqrt(max(0.0, var)) if m.sum() > 1 else 0.0
    out[f"{p}_seq_mean"] = float(vv.mean())
    out[f"{p}_seq_std"] = std1(vv)
    out[f"{p}_seq_max"] = float(vv.max())
    out[f"{p}_seq_min"] = float(vv.min())
    out[f"{p}_seq_max_deviation"] = float(np.abs(vv).max())
    out[f"{p}_seq_fraction_high"] = float((vv > hi).mean())
    if k1:
        out[f"{p}_seq_fraction_low"] = float((vv < lo).mean())
    out[f"{p}_masked_fraction"] = float(mmean(1.0 - keep, m))
    dropped = ((~keep) & mb).any(-1)
    out[f"{p}_seq_masked_fraction"] = float(dropped[valid].sum() / valid.sum())
    return out


def rs_metrics(d: Dense, specs: tuple[RSSpec, ...]) -> tuple[dict[str, float], np.ndarray]:
    """All options' metrics, the overall fractions and the combined ``keep`` ``[S, T]``."""
    out: dict[str, float] = {}
    combined = np.ones(d.r.shape, dtype=bool)
    for spec in specs:
        stat, v, keep = rs_option(d, spec)
        out.update(rs_option_metrics(d, spec, keep, stat, v))
        combined &= keep
    out["rollout_rs_masked_fraction"] = float(mmean(1.0 - combined, d.m))
    out["rollout_rs_seq_masked_fraction"] = float(((~combined) & d.mb).any(-1).mean())
    return out, combined


def offpolicy_metrics(d: Dense) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics`` (k3 via ``expm1``; overflow capped and flagged)."""
    m = d.m
    mean_train, mean_rollout = mmean(d.train, m, -1), mmean(d.rollout, m, -1)
    diff = mean_rollout - mean_train
    with np.errstate(over="ignore"):
        k3_kl, k3_over = capped(float(mmean(np.expm1(d.r) - d.r, m)))
        ppl = {
            "training_ppl": capped(float(np.exp(-mean_train).mean())),
            "rollout_ppl": capped(float(np.exp(-mean_rollout).mean())),
            "ppl_ratio": capped(float(np.exp(diff).mean())),
        }
    return {
        "training_ppl": ppl["training_ppl"][0],
        "training_log_ppl": float((-mean_train).mean()),
        "kl": float(mmean(d.rollout - d.train, m)),
        "k3_kl": k3_kl,
        "rollout_ppl": ppl["rollout_ppl"][0],
        "rollout_log_ppl": float((-mean_rollout).mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(np.abs(diff).mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": ppl["ppl_ratio"][0],
        "chi2_token": float(mmean(np.exp(clamp_b(d.r)) ** 2, m) - 1.0),
        "chi2_seq": float(np.exp(2.0 * clamp_b(msum(d.r, m, -1))).mean() - 1.0),
        "k3_kl_overflow": float(k3_over),
        "ppl_overflow": float(any(over for _, over in ppl.values())),
    }


def preset_metrics(d: Dense, preset: PresetSpec) -> dict[str, float]:
    """Masked fractions and ESS of one preset's ``w_eff = w * keep``."""
    m = d.m
    if preset.is_spec is None:
        c = m.copy()
    else:
        c = np.clip(is_weights(d, preset.is_spec)[1], 0.0, preset.is_spec.upper)
    if preset.rs_specs:
        c = c * rs_metrics(d, preset.rs_specs)[1]
    masked = (c == 0) & d.mb
    zero = msum(c**2, m) == 0
    p = f"presets/{preset.name}"
    return {
        f"{p}/token_masked_fraction": float(mmean(masked * 1.0, m)),
        f"{p}/seq_masked_fraction": float(masked.any(-1).mean()),
        f"{p}/eff_sample_size": 0.0
        if zero
        else min(1.0, float(1 / mmean((c / (mmean(c, m) + EPS)) ** 2, m))),  # at most 1
    }


def to_table(d: Dense) -> pa.Table:
    """The batch as token-store rows: one row per ``[i, t]``, padding rows with null log-probs.

    Columns ``seq_id, position, rollout_logprob, train_logprob`` (float64), plus
    ``support_flip`` / ``token_id`` when ``d`` has them.
    """
    t = d.r.shape[1]
    valid = d.mb.ravel()
    cols = {
        "seq_id": np.repeat(d.seq_ids, t),
        "position": np.asarray(d.positions).ravel(),
        "rollout_logprob": pa.array(d.rollout.ravel(), mask=~valid),
        "train_logprob": pa.array(d.train.ravel(), mask=~valid),
    }
    if d.flip is not None:
        cols["support_flip"] = d.flip.ravel()
    if d.token_ids is not None:
        cols["token_id"] = np.asarray(d.token_ids).ravel()
    return pa.table(cols)


def reference_metrics(d: Dense, config: MetricsConfig) -> MetricsResult:
    """Every metric of ``config`` on the dense batch ``d`` (same keys as ``compute_metrics``)."""
    valid = d.m.sum(-1) > 0
    out = {
        "num_tokens": float(d.m.sum()),
        "num_sequences": float(len(valid)),
        "num_valid_sequences": float(valid.sum()),
    }
    if config.is_spec is not None:
        out.update(is_metrics(d, config.is_spec, config.batch_normalize))
    if config.rs_specs:
        out.update(rs_metrics(d, config.rs_specs)[0])
    out.update(offpolicy_metrics(d))
    out.update(parity_metrics(d))
    out.update(diagnostic_metrics(d))
    out.update(decision_metrics(d))
    for preset in config.preset_specs:
        out.update(preset_metrics(d, preset))
    tables = {"threshold_sweep": threshold_sweep(d), "outliers": outliers(d)}
    return MetricsResult(config, out, {**diagnostic_curves(d), **decision_curves(d)}, tables)
