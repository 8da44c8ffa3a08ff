"""``attribution.json`` (``--attribute``): each setting's links, read back, checked, ordered.

The numbers are computed once from the token store (``metrics.attribution.compute_attribution``)
by the scan's finishing step (``pipeline.attribution.finish``) and written with the run's other
data files (``files.write_data``); ``read_attribution`` takes them back for ``probe report``
and ``probe compare``, through the NaN-refusing reader, and returns None for a file that is
missing or not what the scan writes (the loader then computes them from the store again). A
run scanned without ``--attribute`` has no rung columns: ``{}``, and no file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.metrics.attribution import LINKS

ATTRIBUTION_FILE = "attribution.json"
STATS = ("k3", "mean_abs", "p99_abs", "max_abs", "bitwise_identical_fraction", "share")
Attribution = dict[str, dict[str, Any]]  # setting -> {"links": {link: stats}, "dominant": link}


def read_attribution(run_dir: Path) -> Attribution | None:
    """``attribution.json`` as the scan wrote it, or None (missing, corrupt, another shape)."""
    try:
        data = store.read_json(Path(run_dir) / ATTRIBUTION_FILE)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and all(map(_well_formed, data.values())) else None


def _well_formed(result: Any) -> bool:
    """``{"links": {name: {stat: number}}, "dominant": name | None}``."""
    if not isinstance(result, dict) or not isinstance(result.get("links"), dict):
        return False
    links = result["links"]
    numbers = all(
        isinstance(stats, dict)
        and all(
            isinstance(stats.get(s), int | float) and not isinstance(stats[s], bool) for s in STATS
        )
        for stats in links.values()
    )
    return numbers and (result.get("dominant") is None or result["dominant"] in links)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def order_attribution(data: Attribution, order: Sequence[str]) -> Attribution:
    """Settings in the scan's ``order`` (the file's keys are sorted), links in path order."""
    settings = sorted(data, key=lambda s: order.index(s) if s in order else len(order))
    return {s: _in_path_order(data[s]) for s in settings}


def _in_path_order(result: dict[str, Any]) -> dict[str, Any]:
    links = result.get("links", {})
    return {
        **result,
        "links": {link.name: links[link.name] for link in LINKS if link.name in links},
    }


def write_attribution(out_dir: Path, data: Attribution) -> dict[str, Path]:
    """``attribution.json``; a stale one is removed when the run has no attribution (an earlier
    ``--attribute`` scan into the same directory)."""
    path = Path(out_dir) / ATTRIBUTION_FILE
    if not data:
        path.unlink(missing_ok=True)
        return {}
    store.write_json(path, data)
    return {"attribution": path}
