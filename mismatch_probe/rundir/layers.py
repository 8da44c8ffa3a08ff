"""``layers.json`` (``probe scan --layers``): where in the network the two sides part.

Written by the scan (``pipeline.layers.finish``: the per-layer curves cannot be recomputed from
the token store, which holds no hidden states) and read back here, checked, for ``probe report``
and ``probe layers``. ``read_layers`` returns {} for a run without the file and refuses one that
is not what the scan writes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError

LAYERS_FILE = "layers.json"
Layers = dict[str, Any]  # {"floor_source": str, "settings": {setting: curve}, "views": {...}}
_CURVE_KEYS = ("layers", "floor", "first_divergent_layer", "largest_growth_layer", "tokens")


def write_layers(out_dir: Path, data: Layers) -> dict[str, Path]:
    """``layers.json``; a stale one is removed when the run has none."""
    path = Path(out_dir) / LAYERS_FILE
    if not data:
        path.unlink(missing_ok=True)
        return {}
    store.write_json(path, data)
    return {"layers": path}


def read_layers(run_dir: Path) -> Layers:
    """``layers.json`` as the scan wrote it; {} when the run has none.

    Raises:
        ProbeError: a file that is not valid JSON of finite numbers, or not of the scan's shape.
    """
    path = Path(run_dir) / LAYERS_FILE
    if not path.exists():
        return {}
    try:
        data = store.read_json(path)
    except (OSError, ValueError):
        raise ProbeError(f"{path} is not valid JSON of finite numbers") from None
    settings = data.get("settings") if isinstance(data, dict) else None
    if not isinstance(settings, dict) or not all(map(_well_formed, settings.values())):
        raise ProbeError(f"{path} is not a layers.json of probe scan --layers")
    return dict(data)


def _well_formed(entry: Any) -> bool:
    return isinstance(entry, dict) and all(k in entry for k in _CURVE_KEYS)


def first_divergent(path: Path, setting: str | None) -> dict[str, Any]:
    """``{"first_divergent_layer": ...}`` of ``setting`` for ``probe metrics --json`` on a run
    directory scanned with ``--layers`` (without ``setting``: the store's one setting); {} when
    the run has no ``layers.json`` or the store holds several settings and none was chosen."""
    if not Path(path).is_dir():
        return {}
    found = read_layers(Path(path)).get("settings", {})
    if setting is None and len(found) == 1:
        setting = next(iter(found))
    entry = found.get(setting) if setting is not None else None
    return {"first_divergent_layer": entry["first_divergent_layer"]} if entry else {}


def gated(path: Path, setting: str | None) -> dict[str, float]:
    """The layer keys ``probe check`` gates, as numbers: ``first_divergent_layer`` of
    ``setting`` (as ``first_divergent``), ``inf`` when no layer diverges (``null`` in
    ``layers.json``: a later first divergence is better, so no divergence passes any
    ``--min``); {} without ``layers.json``."""
    found = first_divergent(path, setting)
    if not found:
        return {}
    layer = found["first_divergent_layer"]
    return {"first_divergent_layer": math.inf if layer is None else float(layer)}
