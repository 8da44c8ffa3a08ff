"""The one reader of a run directory: the view every report, check and comparison is handed.

Public API::

    from mismatch_probe.rundir import RunData, build_report, load_report, load_run, write_data
    ctx, entries = load_report(run_dir)            # probe report: the data files read once
    ctx, entries = build_report(run_dir, RunData(run, metrics={...}))  # a producer, from memory
    paths = write_data(ctx, run_dir)               # metrics.json, integrity.json, ... (before
                                                   # any report is rendered)
    ctx = load_run(run_dir, setting=None)          # one setting's view (None: the whole store)

``ctx`` is a ``RunContext`` (one setting: metrics, curves, worst tokens and outliers in context,
integrity findings, routing, attribution, trend); ``entries`` one ``Entry`` per setting of a
precision-matrix run, in the one order of ``order.setting_key`` (failing first, then least
``k3_kl``). The scan's finishing step and ``probe ingest`` build
the view from what they computed (``RunData``); ``probe report`` reads it back (``read_data``,
every file through the NaN-refusing ``store.read_json``). Either way the store itself is read
only for what no data file holds: the worst tokens' text, their causes, a small run's token
probabilities, the integrity checks.

Module map: ``context`` (the view: ``RunContext``, ``WorstToken``, ``OutlierToken``, ``Entry``;
``build_run``, ``load_run``: one setting), ``loader`` (``build_report``, ``load_report``,
``select_settings``, ``setting_entries``), ``data`` (``RunData``: the data files, ``read_data``),
``files`` (``write_data``), ``integrity`` (the data-integrity findings, recomputed from the
store), ``routing`` (``routing.json`` checked), ``attribution`` (``attribution.json``),
``trend`` (an ingested run's steps: ``steps.json``, the ``Trend``), ``causes`` (why a worst token
mismatches: routing, attribution, tail), ``rescan`` (the command that re-scans one outlier's
prompt). Records and numbers only: ``report/`` renders what this package builds, and ``gate/``
checks it.
"""

from mismatch_probe.rundir.context import Entry, OutlierToken, RunContext, WorstToken, load_run
from mismatch_probe.rundir.data import RunData, read_data
from mismatch_probe.rundir.files import write_data
from mismatch_probe.rundir.loader import (
    build_report,
    load_report,
    select_settings,
    setting_entries,
)
from mismatch_probe.rundir.order import in_setting_order, setting_key

__all__ = [
    "Entry",
    "OutlierToken",
    "RunContext",
    "RunData",
    "WorstToken",
    "build_report",
    "in_setting_order",
    "load_report",
    "load_run",
    "read_data",
    "select_settings",
    "setting_entries",
    "setting_key",
    "write_data",
]
