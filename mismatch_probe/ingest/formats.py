"""The formats ``probe ingest`` reads: one table keyed by the name on the command line.

Each ``Format`` says how to read records, where the off-policy bound comes from, which log-prob
fields it maps to our two sides, and whether the training side must come from rescoring. Adding
a format is one module with ``read`` and ``off_policy``, and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest import miles, nemo_rl, prime_rl, probe_format, skyrl, slime, verl_dp
from mismatch_probe.ingest.batches import SeqBatch, from_records
from mismatch_probe.ingest.records import IngestConfig, SeqRecord, StepRange


@dataclass(frozen=True)
class Format:
    """How to read one framework's logs.

    Attributes:
        read: ``IngestConfig -> records`` (streaming, steps ascending).
        off_policy: ``path -> {"max_off_policy_steps", "source", "staleness"}``.
        version: the format version we read, as the source names it.
        rollout_field: the framework's name of the engine's log-probs.
        train_field: its name of the trainer's log-probs (None: rescored with ``--model``).
        checked: the source file the reader was checked against.
        batches: ``IngestConfig -> SeqBatch`` s, the same responses as ``read`` in columns
            (a vectorised reader); None: ``read``'s records gathered into batches.
        rewrites: ``(path, steps) -> [{"step", ...}]``: the steps a later attempt wrote again
            (a restarted trainer), whose earlier attempt the reader left out; none by default
            (a format whose files a restarted trainer overwrites in place).
    """

    read: Callable[[IngestConfig], Iterator[SeqRecord]]
    off_policy: Callable[[Path], dict[str, Any]]
    version: str
    rollout_field: str
    train_field: str | None
    checked: str
    batches: Callable[[IngestConfig], Iterator[SeqBatch]] | None = None
    rewrites: Callable[[Path, StepRange], list[dict[str, Any]]] = field(default=lambda p, s: [])

    def read_batches(self, cfg: IngestConfig) -> Iterator[SeqBatch]:
        """The responses of ``cfg``'s steps as ``SeqBatch`` es, steps ascending."""
        return self.batches(cfg) if self.batches is not None else from_records(self.read(cfg))

    @property
    def needs_model(self) -> bool:
        return self.train_field is None


FORMATS: dict[str, Format] = {
    "prime-rl": Format(
        lambda c: prime_rl.read(c.path, c.steps),
        prime_rl.off_policy,
        "token export schema_version 1",
        "inference_logprobs",
        "trainer_logprobs",
        "PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/token_export.py",
        lambda c: prime_rl.read_batches(c.path, c.steps),
    ),
    "nemo-rl": Format(
        lambda c: nemo_rl.read(c.path, c.steps),
        nemo_rl.off_policy,
        "GRPO train_data_step<N>.jsonl",
        "generation_logprobs",
        "prev_logprobs",
        "NVIDIA-NeMo/RL nemo_rl/algorithms/grpo.py, nemo_rl/utils/logger.py",
        lambda c: nemo_rl.read_batches(c.path, c.steps),
    ),
    "slime": Format(
        lambda c: slime.read(c.path, c.steps, c.trust_pickle),
        slime.off_policy,
        "train dump format_version 2",
        "rollout_log_probs",
        "log_probs",
        "THUDM/slime slime/observability/train_data_utils.py",
    ),
    "miles-parquet": Format(
        lambda c: miles.read(c.path, c.steps),
        miles.off_policy,
        "dashboard_columns rollout_<id>.parquet",
        "rollout_log_probs",
        None,
        "radixark/miles miles/ray/rollout/debug_data.py",
    ),
    "verl-dp": Format(
        lambda c: verl_dp.read(c.path, c.steps, c.trust_pickle),
        verl_dp.off_policy,
        "DataProto pickle step_<N>.dp (consolidated TensorDict)",
        "rollout_log_probs",
        "old_log_probs",
        "volcengine/verl verl/protocol.py, verl/trainer/ppo/ray_trainer.py",
        lambda c: verl_dp.read_batches(c.path, c.steps, c.trust_pickle),
    ),
    "skyrl": Format(
        lambda c: skyrl.read(c.path, c.steps, c.trust_pickle),
        skyrl.off_policy,
        "TrainingInputBatch pickle global_step_<N>_training_input.pkl",
        "rollout_logprobs",
        "action_log_probs",
        "NovaSky-AI/SkyRL skyrl/train/trainer.py, skyrl/backends/skyrl_train/training_batch.py",
        lambda c: skyrl.read_batches(c.path, c.steps, c.trust_pickle),
    ),
    "probe": Format(
        lambda c: probe_format.read(c.path, c.steps),
        probe_format.off_policy,
        "probe-tokens 1",
        "rollout_logprob",
        "train_logprob",
        "mismatch_probe/ingest/hook.py (ProbeWriter)",
        lambda c: probe_format.read_batches(c.path, c.steps),
        rewrites=probe_format.rewrites,
    ),
}


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ProbeError(f"unknown format {name!r}; choose from {', '.join(FORMATS)}")
    return FORMATS[name]
