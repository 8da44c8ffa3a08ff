"""The one reader of a run directory: what every report, check and comparison shows of a run.

Public API::

    from mismatch_probe.rundir import load_report, load_run, RunContext, Entry
    ctx, entries = load_report(run_dir)        # the reference setting's view, one Entry per setting
    ctx = load_run(run_dir, setting=None)      # one setting's view (None: the whole store)

Module map: ``context`` (the view: ``RunContext``, ``WorstToken``, ``OutlierToken``, ``Entry``;
reading one setting: run.json, metrics.json reused or recomputed, the worst tokens' text),
``loader`` (``load_report``, ``select_settings``, ``setting_entries``, the settings' throughput),
``integrity`` (the data-integrity findings, recomputed from the store, and ``integrity.json``),
``causes`` (why a worst token mismatches: routing, attribution, tail), ``rescan`` (the command that
re-scans one outlier's prompt), ``trend`` (an ingested run's metrics per training step,
``steps.json``). Numbers and records only: ``report/`` renders what this package loads, and
``gate/`` checks it.
"""

from mismatch_probe.rundir.context import Entry, OutlierToken, RunContext, WorstToken, load_run
from mismatch_probe.rundir.loader import load_report, select_settings, setting_entries

__all__ = [
    "Entry",
    "OutlierToken",
    "RunContext",
    "WorstToken",
    "load_report",
    "load_run",
    "select_settings",
    "setting_entries",
]
