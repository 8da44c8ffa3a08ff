"""``probe selftest``: every detector seen to fire on a real scan (``run``), fault by fault
(``faults.FAULTS``, one entry per row)."""

from mismatch_probe.selftest.faults import FAULTS, Fault
from mismatch_probe.selftest.run import Row, SelftestResult, run_selftest, work_dir

__all__ = ["FAULTS", "Fault", "Row", "SelftestResult", "run_selftest", "work_dir"]
