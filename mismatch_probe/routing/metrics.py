"""How much the two sides' routing disagrees, and how much of the mismatch that explains.

Inputs are arrays over response tokens: the engine's and the training router's expert ids
``[N, L, K]`` (compared as sets per (token, layer)) and the log-ratio
``r = train_logprob - rollout_logprob`` ``[N]`` of the same tokens. Mismatch per group is
``k3_kl = mmean(exp(r) - 1 - r)`` (the k3 estimator of KL(rollout || train)) and ``mmean |r|``,
computed by the metric engine's functions with its rules (log-probs below -9999, ``-inf``
included, read as -9999; an overflowing k3 capped), so every number here is finite.

``compare_replay`` lines up several rescorings of the same tokens (``none``: the training
router routes; ``rollout``: R3, the engine's routes forced) and reports what replay removes,
also by the number of layers whose routing differs. The *baseline* mode is ``none`` when it was
run, else the first mode: its training routes define the disagreement (under R3 they are the
router's own choices before they were overridden).

This module knows nothing about vLLM or transformers; ``analyze_run`` reads a run's files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.accum import capped, mmean
from mismatch_probe.metrics.batch import k3_terms, normalize_logprobs
from mismatch_probe.routing.store import RoutingData, read_routing


@dataclass(frozen=True)
class MismatchStats:
    """Mismatch of a group of tokens (``None`` when the group is empty)."""

    tokens: int
    k3_kl: float | None
    mean_abs_log_ratio: float | None


def mismatch_stats(log_ratio: np.ndarray) -> MismatchStats:
    """``MismatchStats`` of ``r = train - rollout`` ``[n]``, with the metric engine's own k3
    terms, masked mean and overflow cap (``r`` comes from ``normalize_logprobs``, so it is
    finite; a k3 that overflows float64 is reported as the largest float)."""
    r = np.asarray(log_ratio, np.float64)
    if r.size == 0:
        return MismatchStats(0, None, None)
    k3_kl, _ = capped(mmean(float(k3_terms(r).sum()), r.size))
    return MismatchStats(int(r.size), k3_kl, mmean(float(np.abs(r).sum()), r.size))


@dataclass(frozen=True)
class RoutingMetrics:
    """Routing disagreement between engine and trainer, and the mismatch split by it."""

    tokens: int
    moe_layers: tuple[int, ...]  # decoder-layer index of each MoE layer
    layer_disagreement: tuple[float, ...]  # [L] fraction of tokens whose expert set differs
    layer_jaccard: tuple[float, ...]  # [L] mean Jaccard overlap of the expert sets
    mean_jaccard: float  # over tokens and layers
    any_layer_differs: float  # fraction of tokens with >= 1 differing layer
    mean_differing_layers: float  # differing layers per token
    agree: MismatchStats  # tokens routed identically in every layer
    differ: MismatchStats  # tokens with >= 1 differing layer
    by_differing_layers: tuple[MismatchStats, ...]  # index d: tokens with d differing layers

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def differing(rollout: np.ndarray, train: np.ndarray) -> np.ndarray:
    """``[N, L]`` True where the expert sets differ (``rollout``, ``train``: ``[N, L, K]``)."""
    return (np.sort(rollout, axis=-1) != np.sort(train, axis=-1)).any(axis=-1)


def jaccard(rollout: np.ndarray, train: np.ndarray) -> np.ndarray:
    """``[N, L]`` ``|A & B| / |A | B|`` of the expert sets (each has ``K`` distinct ids)."""
    k = rollout.shape[-1]
    shared = (rollout[..., :, None] == train[..., None, :]).any(axis=-1).sum(axis=-1)
    return shared / (2 * k - shared)


def routing_metrics(
    rollout: np.ndarray, train: np.ndarray, log_ratio: np.ndarray, moe_layers: tuple[int, ...]
) -> RoutingMetrics:
    """Disagreement metrics over ``N`` response tokens.

    Args:
        rollout: ``[N, L, K]`` engine expert ids.
        train: ``[N, L, K]`` training-router expert ids (without replay).
        log_ratio: ``[N]`` ``r = train_logprob - rollout_logprob`` of the same tokens.
        moe_layers: ``[L]`` decoder-layer index of each MoE layer (labels).
    """
    diff = differing(rollout, train)  # [N, L]
    jac = jaccard(rollout, train)  # [N, L]
    count = diff.sum(axis=1)  # [N]
    n, layers = diff.shape
    if n == 0:  # no response tokens: nothing differs
        diff, jac, count = np.zeros((1, layers)), np.ones((1, layers)), np.zeros(1, int)
    return RoutingMetrics(
        tokens=n,
        moe_layers=tuple(moe_layers),
        layer_disagreement=tuple(float(x) for x in diff.mean(axis=0)),
        layer_jaccard=tuple(float(x) for x in jac.mean(axis=0)),
        mean_jaccard=float(jac.mean()),
        any_layer_differs=float((count > 0).mean()),
        mean_differing_layers=float(count.mean()),
        agree=mismatch_stats(log_ratio[count[:n] == 0]),
        differ=mismatch_stats(log_ratio[count[:n] > 0]),
        by_differing_layers=by_count(count[:n], log_ratio, layers),
    )


def by_count(count: np.ndarray, log_ratio: np.ndarray, layers: int) -> tuple[MismatchStats, ...]:
    """``MismatchStats`` of the tokens with ``d = 0 .. layers`` differing layers."""
    return tuple(mismatch_stats(log_ratio[count == d]) for d in range(layers + 1))


@dataclass(frozen=True)
class ReplayComparison:
    """The same tokens rescored under each routing-replay mode (``none``, ``rollout``)."""

    modes: dict[str, MismatchStats]
    k3_removed: dict[str, float | None]  # 1 - k3(mode) / k3(none); None without ``none``
    by_differing_layers: dict[str, tuple[MismatchStats, ...]]  # d from the baseline routes

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_replay(
    log_ratios: Mapping[str, np.ndarray], differing_layers: np.ndarray, layers: int
) -> ReplayComparison:
    """Compare replay modes on the same tokens.

    Args:
        log_ratios: mode -> ``[N]`` log-ratios of the same tokens.
        differing_layers: ``[N]`` number of layers whose routing differs (baseline routes).
        layers: number of MoE layers.
    """
    modes = {m: mismatch_stats(r) for m, r in log_ratios.items()}
    base = modes["none"].k3_kl if "none" in modes else None
    removed = {m: _share_removed(s.k3_kl, base) for m, s in modes.items()}
    by = {m: by_count(differing_layers, r, layers) for m, r in log_ratios.items()}
    return ReplayComparison(modes, removed, by)


def _share_removed(k3: float | None, base: float | None) -> float | None:
    """``1 - k3 / base`` (None without a positive finite baseline), capped to a finite value."""
    if k3 is None or not base:
        return None
    return capped(1.0 - k3 / base)[0]


def analyze_run(
    tokens_path: Path, routing_path: Path, settings: Mapping[str, str]
) -> tuple[RoutingMetrics, ReplayComparison]:
    """Routing metrics of a run and the comparison of its replay modes.

    Args:
        tokens_path: ``tokens.parquet`` (or its run directory).
        routing_path: ``routing.parquet`` (or its run directory).
        settings: replay mode -> the ``setting`` name its rows carry in both files, e.g.
            ``{"none": "rollout=bf16 | train=fp32", "rollout": "... | replay=rollout"}``; every
            mode rescored the same sequences in the same order.

    Returns:
        ``(metrics, comparison)``; the metrics' split uses the baseline mode's log-ratios.
    """
    if not settings:
        raise ProbeError("analyze_run needs at least one replay mode")
    baseline = "none" if "none" in settings else next(iter(settings))
    routes = _response_rows(read_routing(routing_path, settings[baseline]))
    path = store.resolve_tokens_path(tokens_path)
    tokens = {mode: _read_tokens(path, name) for mode, name in settings.items()}
    base = tokens[baseline]
    for mode, t in tokens.items():
        if not np.array_equal(t["token_id"], base["token_id"]):
            raise ProbeError(f"replay mode {mode!r} did not rescore the tokens of {baseline!r}")
    order = _align(base["seq_id"], base["position"], routes)
    rollout, train = routes.rollout[order], routes.train[order]
    ratios = {m: t["train_logprob"] - t["rollout_logprob"] for m, t in tokens.items()}
    moe_layers = tuple(routes.meta.get("moe_layers", range(rollout.shape[1])))
    metrics = routing_metrics(rollout, train, ratios[baseline], moe_layers)
    count = differing(rollout, train).sum(axis=1)
    return metrics, compare_replay(ratios, count, rollout.shape[1])


def _response_rows(routes: RoutingData) -> RoutingData:
    return routes.select(routes.position >= 0)


def _read_tokens(path: Path, setting: str) -> dict[str, np.ndarray]:
    """One setting's tokens in file order (sequences contiguous, positions ascending)."""
    cols = ["seq_id", "position", "token_id", "rollout_logprob", "train_logprob"]
    store.open_parquet(path, required=[*cols, "setting"])
    table = pq.read_table(path, columns=cols, filters=[("setting", "=", setting)])
    if table.num_rows == 0:
        raise ProbeError(f"{path} has no tokens of setting {setting!r}")
    out = {c: table.column(c).to_numpy() for c in cols}
    valid = np.ones(table.num_rows, dtype=bool)  # the store's log-prob columns are not null
    for c in ("rollout_logprob", "train_logprob"):
        out[c] = normalize_logprobs(out[c], valid, c)  # the metric engine's floor for -inf
    return out


def _align(seq_id: np.ndarray, position: np.ndarray, routes: RoutingData) -> np.ndarray:
    """Index into ``routes`` of each token's ``(seq_id, position)``; every token needs one."""
    keys = routes.seq_id.astype(np.int64) * (1 << 32) + routes.position
    wanted = seq_id.astype(np.int64) * (1 << 32) + position
    order = np.argsort(keys, kind="stable")
    at = np.clip(np.searchsorted(keys[order], wanted), 0, max(len(keys) - 1, 0))
    found = order[at] if len(keys) else at
    if len(keys) == 0 or not np.array_equal(keys[found], wanted):
        raise ProbeError("routing.parquet lacks the routes of some tokens of tokens.parquet")
    return found
