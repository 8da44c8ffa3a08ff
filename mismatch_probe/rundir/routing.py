"""``routing.json`` (``store.ROUTING_METRICS_FILE``) read back and checked: the MoE routing
numbers of a run, per rollout/training pair (written by the routing stage, ``routes.finish``).

``{label: {"settings": {mode: setting}, "metrics": RoutingMetrics, "replay":
ReplayComparison}}`` (``routing/metrics.py``). ``load_routing`` reads it through the NaN-refusing
reader and checks every field the routing section and plots use (its type, and one value per MoE
layer or per differing-layer count), so a file that is not what the scan writes is one clear
error, not a traceback halfway through a report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError

STATS = ("k3_kl", "mean_abs_log_ratio")  # a group's numbers (None where it has no token)


def load_routing(run_dir: Path) -> dict[str, Any]:
    """``routing.json`` of ``run_dir`` ({} for a dense model's run).

    Raises:
        ProbeError: the file is not a routing.json written by probe scan.
    """
    path = Path(run_dir) / store.ROUTING_METRICS_FILE
    if not path.is_file():
        return {}
    try:
        data = store.read_json(path)
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        data = None
    if not well_formed(data):
        raise ProbeError(f"{path} is not a routing.json written by probe scan")
    return dict(data)


def well_formed(data: Any) -> bool:
    """Every rollout/training pair has the fields the report shows, of their type."""
    return isinstance(data, dict) and all(_pair(entry) for entry in data.values())


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _numbers(values: Any, n: int | None = None) -> bool:
    ok = isinstance(values, list) and all(_number(v) for v in values)
    return ok and (n is None or len(values) == n)


def _group(stats: Any, keys: tuple[str, ...] = STATS) -> bool:
    """``{"tokens": n, "k3_kl": x | None, "mean_abs_log_ratio": x | None}``."""
    return (
        isinstance(stats, dict)
        and _number(stats.get("tokens"))
        and all(k in stats and (stats[k] is None or _number(stats[k])) for k in keys)
    )


def _groups(values: Any, n: int | None = None) -> bool:
    """A list of ``_group``s of differing-layer counts (``n`` of them when given)."""
    keys = ("mean_abs_log_ratio",)
    ok = isinstance(values, list) and all(_group(v, keys) for v in values)
    return ok and (n is None or len(values) == n)


def _pair(entry: Any) -> bool:
    """One rollout/training pair: per-layer lists of one value per MoE layer, the token split,
    the groups by differing-layer count, the replay modes."""
    m = entry.get("metrics") if isinstance(entry, dict) else None
    replay = entry.get("replay") if isinstance(entry, dict) else None
    if not isinstance(m, dict) or not isinstance(replay, dict) or not _numbers(m.get("moe_layers")):
        return False
    layers = len(m["moe_layers"])
    shaped = (
        all(_numbers(m.get(k), layers) for k in ("layer_disagreement", "layer_jaccard"))
        and all(_number(m.get(k)) for k in ("tokens", "any_layer_differs", "mean_jaccard"))
        and _group(m.get("agree"))
        and _group(m.get("differ"))
        and _groups(m.get("by_differing_layers"))
    )
    return shaped and _replay(replay, len(m["by_differing_layers"]))


def _replay(replay: dict[str, Any], counts: int) -> bool:
    """Each replay mode's group, the share of k3 it removes, its groups by differing layers."""
    modes, removed = replay.get("modes"), replay.get("k3_removed")
    if not isinstance(modes, dict) or not all(_group(s) for s in modes.values()):
        return False
    if not isinstance(removed, dict) or not all(v is None or _number(v) for v in removed.values()):
        return False
    by = replay.get("by_differing_layers") or {}
    return isinstance(by, dict) and all(_groups(v, counts) for v in by.values())
