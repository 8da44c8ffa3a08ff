"""A run directory's data files: what its producer holds in memory, or ``read_data`` reads back.

``RunData`` is everything a report needs besides the token store: ``run.json``, the metrics of
each setting (``metrics.json`` holds the first), each setting's throughput (``settings.json``),
``routing.json``, ``attribution.json`` and the per-step metrics (``steps.json``). The scan's
finishing step and ``probe ingest`` build it from what they computed; ``probe report`` reads it
(``read_data``, every file through the NaN-refusing ``store.read_json``). Either way
``loader.build_report`` makes the view from it, and ``files.write_data`` writes the view's data
files before any report is rendered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.attribution import Attribution, read_attribution
from mismatch_probe.rundir.layers import Layers, read_layers
from mismatch_probe.rundir.routing import load_routing
from mismatch_probe.rundir.trend import Steps, read_steps

if TYPE_CHECKING:
    from mismatch_probe.metrics.integrity import Integrity


@dataclass(frozen=True)
class RunData:
    """The data files of a run, as their producer holds them or as read back.

    Attributes:
        run: ``run.json`` (or the metadata stored in ``tokens.parquet``; ``{}`` if none).
        order: the settings in the scan's order when the producer knows it (None: the store's
            run metadata, then ``run.json``, then sorted).
        metrics: setting -> ``MetricsResult.to_json_dict()`` already computed (None: the whole
            store; ``metrics.json``'s when read back); a setting missing, or computed with
            another config, is computed from the store.
        throughput: setting -> rollout tokens/s (``settings.json``).
        routing: ``routing.json`` ({} for a dense model).
        attribution: setting -> links (None: computed from the store).
        steps: the per-step metrics (``steps.json``) of an ingested run, None when unknown.
        integrity: the integrity findings when the producer computed them from this store in
            the same pass as its metrics (``probe ingest``); None: computed from the store.
        layers: ``layers.json`` (``--layers``; {} without).
    """

    run: dict[str, Any]
    order: list[str] | None = None
    metrics: Mapping[str | None, dict[str, Any]] = field(default_factory=dict)
    throughput: Mapping[str, float] = field(default_factory=dict)
    routing: dict[str, Any] = field(default_factory=dict)
    attribution: Attribution | None = None
    steps: Steps | None = None
    integrity: Integrity | None = None
    layers: Layers = field(default_factory=dict)


def read_data(run_dir: Path, report: bool = True) -> RunData:
    """The data files of ``run_dir`` (each through the NaN-refusing reader): ``run.json``
    (``read_run``) and ``attribution.json``; with ``report`` also ``settings.json``'s
    throughput, ``routing.json`` and ``steps.json`` (what ``probe report`` shows beside the
    metrics). ``metrics.json`` is read where its metrics are wanted (``context.build_run``).

    Raises:
        ProbeError: an invalid ``run.json`` or ``routing.json``.
    """
    run_dir = Path(run_dir)
    run, found, layers = read_run(run_dir), read_attribution(run_dir), read_layers(run_dir)
    if not report:
        return RunData(run, attribution=found, layers=layers)
    return RunData(
        run,
        throughput=throughput(run_dir),
        routing=load_routing(run_dir),
        attribution=found,
        steps=read_steps(run_dir),
        layers=layers,
    )


def read_run(run_dir: Path) -> dict[str, Any]:
    """``run.json``, else the run metadata stored in the token store.

    Raises:
        ProbeError: a ``run.json`` that is not valid JSON of finite numbers, not an object
            (``[]``), or of another ``schema_version`` than this version writes.
    """
    path = Path(run_dir) / store.RUN_FILE
    if path.exists():
        try:
            data = store.read_json(path)
        except (OSError, TypeError, ValueError):
            raise ProbeError(f"{path} is not valid JSON of finite numbers") from None
        if not isinstance(data, dict):
            kind = type(data).__name__
            raise ProbeError(f"{path} is not a run's metadata (a JSON {kind}, not an object)")
        version = data.get("schema_version", store.SCHEMA_VERSION)
        if str(version) != store.SCHEMA_VERSION:
            raise ProbeError(
                f"{path}: schema_version {version!r}, this mismatch_probe reads "
                f"{store.SCHEMA_VERSION!r} (re-run the scan or ingest with this version)"
            )
        return data
    return store.read_run_metadata(store.resolve_tokens_path(Path(run_dir)))


def throughput(run_dir: Path) -> dict[str, float]:
    """Each setting's rollout tokens/s from ``settings.json``; a missing, corrupt or
    non-finite value is left out (never copied into a report)."""
    try:
        data = store.read_json(Path(run_dir) / store.SETTINGS_FILE)
    except (OSError, ValueError):
        return {}
    settings = data.get("settings") if isinstance(data, dict) else None
    if not isinstance(settings, dict):
        return {}
    speeds = {
        name: m.get("rollout_tokens_per_s") for name, m in settings.items() if isinstance(m, dict)
    }
    return {
        name: float(v)
        for name, v in speeds.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
