"""``probe ingest``: bring your own rollouts. An RL framework's logs of engine and trainer
log-probabilities, step by step, become a ``probe`` run (the layout of a scan plus a ``step``
column), so every metric, preset, report, comparison and CI check works on them, with a trend
over training steps.

Public API::

    from mismatch_probe.ingest import FORMATS, IngestConfig, run_ingest, ProbeWriter
    result = run_ingest(IngestConfig("prime-rl", Path("outputs"), Path("runs/prime")))

Reading, per format (what ``probe watch`` builds on): ``FORMATS[name].read_batches(cfg)``
yields ``SeqBatch`` es (``batches``: the responses of one step as flat arrays, ``[S]`` per
response, ``[T]`` per trained token), steps ascending, ``cfg.steps`` choosing the steps; every
format has it (a vectorised reader where the bytes allow: prime-rl's and NeMo-RL's JSONL
through ``jsonl``/pyarrow, one file per batch, files parsed on every core; verl's and SkyRL's
dumps and probe's own Parquet by columns; the others' records gathered into batches by
``batches.from_records``). One file of one step: ``prime_rl.fast_batch(file, step)`` and
``nemo_rl.fast_batch(file, step) -> SeqBatch | None`` (None: the reference reader reads that
file); ``FORMATS[name].read(cfg)`` is the same
responses one ``SeqRecord`` at a time (the reference readers, which the fast ones fall back on
for anything they do not read themselves, so errors read the same). ``RunStoreWriter.add_batch``
writes batches into a run's store.

Module map: ``records`` (the common ``SeqRecord``, config, shared checks), one reader per
format (``prime_rl``, ``nemo_rl``, ``slime``, ``miles``, ``verl_dp``, ``skyrl``,
``probe_format``) behind the table in ``formats``, ``pickles`` (the restricted unpickler of the
pickle-based dumps), ``hook`` (``ProbeWriter``, the writer half of the verl/TRL hooks) and
``frameworks`` (what the hooks know of TRL and verl: bounds, config checks, V1 fields),
``verl_wiring`` (``wire_verl_legacy``: verl's legacy task runner builds the probe trainer),
``writer`` (streaming token store), ``batches`` (``SeqBatch``), ``jsonl`` (vectorised JSONL),
``rescoring`` (the training side of rollout-only formats), ``run`` (the pipeline: the store,
then the metrics of the run and of every step with the integrity checks in one pass). Readers
know nothing about metrics or reports.
"""

from mismatch_probe.ingest.batches import SeqBatch
from mismatch_probe.ingest.formats import FORMATS, Format
from mismatch_probe.ingest.hook import ProbeWriter
from mismatch_probe.ingest.records import IngestConfig, SeqRecord, StepRange, parse_steps
from mismatch_probe.ingest.run import IngestResult, run_ingest
from mismatch_probe.ingest.verl_wiring import wire_verl_legacy

__all__ = [
    "FORMATS",
    "Format",
    "IngestConfig",
    "IngestResult",
    "ProbeWriter",
    "SeqBatch",
    "SeqRecord",
    "StepRange",
    "parse_steps",
    "run_ingest",
    "wire_verl_legacy",
]
