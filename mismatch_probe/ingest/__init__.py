"""``probe ingest``: bring your own rollouts. An RL framework's logs of engine and trainer
log-probabilities, step by step, become a ``probe`` run (the layout of a scan plus a ``step``
column), so every metric, preset, report, comparison and CI check works on them, with a trend
over training steps.

Public API::

    from mismatch_probe.ingest import FORMATS, IngestConfig, run_ingest, ProbeWriter
    result = run_ingest(IngestConfig("prime-rl", Path("outputs"), Path("runs/prime")))

Module map: ``records`` (the common ``SeqRecord``, config, shared checks), one reader per
format (``prime_rl``, ``nemo_rl``, ``slime``, ``miles``, ``verl_dp``, ``skyrl``,
``probe_format``) behind the table in ``formats``, ``pickles`` (the restricted unpickler of the
pickle-based dumps), ``hook`` (``ProbeWriter``, the writer half of the verl/TRL hooks) and
``frameworks`` (what the hooks know of TRL and verl: bounds, config checks, V1 fields), ``writer``
(streaming token store), ``rescoring`` (the training side of rollout-only formats), ``run``
(the pipeline). Readers know nothing about metrics or reports.
"""

from mismatch_probe.ingest.formats import FORMATS, Format
from mismatch_probe.ingest.hook import ProbeWriter
from mismatch_probe.ingest.records import IngestConfig, SeqRecord, StepRange, parse_steps
from mismatch_probe.ingest.run import IngestResult, run_ingest

__all__ = [
    "FORMATS",
    "Format",
    "IngestConfig",
    "IngestResult",
    "ProbeWriter",
    "SeqRecord",
    "StepRange",
    "parse_steps",
    "run_ingest",
]
