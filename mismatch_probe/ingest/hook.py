"""The writer half of a framework hook: our own token schema (format ``probe``), step by step.

A training loop calls ``ProbeWriter.write_step`` once per batch with the batch's response
tokens, their mask, the engine's and the trainer's log-probs, each ``[B, T]`` (torch tensors or
numpy arrays); ``write_verl`` and ``write_trl`` take the objects those trainers hold at the
point the README's hooks run. ``probe ingest probe DIR`` reads the result.

Layout: ``DIR/step_<N>/rank_<R>_<K>.parquet``, one file per call (``K`` counts the calls of one
writer), written under a hidden name and renamed when complete, so a reader never sees half a
file. One row per trained token (``PROBE_SCHEMA``): ``step, sequence`` (row of the batch),
``group`` (prompt key, e.g. verl's ``uid``; null when unknown), ``position`` (in the response),
``token_id``, ``rollout_logprob``, ``train_logprob`` (null where non-finite). The file's
key-value metadata names the format and version, and the off-policy bound when given.

This module needs numpy and pyarrow only; torch tensors are converted with ``.detach().cpu()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.errors import ProbeError

FORMAT_NAME = "probe-tokens"
FORMAT_VERSION = "1"
FORMAT_KEY = b"mismatch_probe.format"
VERSION_KEY = b"mismatch_probe.format_version"
OFF_POLICY_KEY = b"mismatch_probe.max_off_policy_steps"

PROBE_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("sequence", pa.int64(), nullable=False),  # row of the batch
        pa.field("group", pa.string()),  # prompt key (verl uid), null when unknown
        pa.field("position", pa.int32(), nullable=False),  # in the response
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("rollout_logprob", pa.float32()),  # engine; null where non-finite
        pa.field("train_logprob", pa.float32()),  # trainer, same token; null where non-finite
    ]
)


def to_numpy(x: Any, dtype: Any) -> np.ndarray:
    """A torch tensor (any device) or array-like -> numpy array of ``dtype``."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        x = x.float() if np.dtype(dtype).kind == "f" else x.long()
        x = x.numpy()
    return np.asarray(x, dtype=dtype)


class ProbeWriter:
    """Writes one Parquet file per ``write_step`` call under ``root``.

    Args:
        root: the directory ``probe ingest probe`` reads.
        rank: this process's rank (several processes may write the same step).
        max_off_policy_steps: how many policy versions a rollout may lag behind the trainer
            (0 for on-policy training), recorded so the report can say whether the ratio
            includes staleness; None when unknown.
    """

    def __init__(
        self, root: Path | str, rank: int = 0, max_off_policy_steps: int | None = None
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        self.calls = 0
        meta = {FORMAT_KEY: FORMAT_NAME.encode(), VERSION_KEY: FORMAT_VERSION.encode()}
        if max_off_policy_steps is not None:
            meta[OFF_POLICY_KEY] = str(int(max_off_policy_steps)).encode()
        self.schema = PROBE_SCHEMA.with_metadata(meta)

    def write_step(
        self,
        step: int,
        responses: Any,
        response_mask: Any,
        rollout_logprobs: Any,
        train_logprobs: Any,
        group: Sequence[Any] | None = None,
    ) -> Path:
        """Write the trained tokens of one batch; returns the file.

        Args:
            step: the training step.
            responses: ``[B, T]`` response token ids (right-padded).
            response_mask: ``[B, T]`` 1/True for a trained token.
            rollout_logprobs: ``[B, T]`` the engine's log-prob of each token.
            train_logprobs: ``[B, T]`` the trainer's log-prob of the same token.
            group: ``[B]`` prompt keys (responses to one prompt share one), or None.
        """
        tokens = to_numpy(responses, np.int64)
        mask = to_numpy(response_mask, np.float64) != 0
        rollout = to_numpy(rollout_logprobs, np.float64)
        train = to_numpy(train_logprobs, np.float64)
        shapes = {a.shape for a in (tokens, mask, rollout, train)}
        if len(shapes) != 1 or tokens.ndim != 2:
            raise ProbeError(f"write_step: expected four [B, T] arrays of one shape, got {shapes}")
        if group is not None and len(group) != tokens.shape[0]:
            raise ProbeError(f"write_step: {len(group)} group keys for {tokens.shape[0]} rows")
        rows, cols = np.nonzero(mask)
        ids = tokens[rows, cols]
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            bad = ids[(ids < 0) | (ids > np.iinfo(np.int32).max)][0]
            raise ProbeError(f"write_step: token id {int(bad)} is outside 0..2147483647")
        keys = None if group is None else [str(group[i]) for i in rows.tolist()]
        table = pa.table(
            {
                "step": np.full(len(rows), int(step), np.int64),
                "sequence": rows.astype(np.int64),
                "group": pa.array(keys if keys is not None else [None] * len(rows), pa.string()),
                "position": cols.astype(np.int32),
                "token_id": ids.astype(np.int32),
                "rollout_logprob": _nullable(rollout[rows, cols]),
                "train_logprob": _nullable(train[rows, cols]),
            },
            schema=self.schema,
        )
        return self._write(int(step), table)

    def write_verl(self, step: int, batch: Any, old_log_prob: Any) -> Path:
        """verl: the ``DataProto`` after ``_compute_old_log_prob`` (``batch``) and its result."""
        tensors: Mapping[str, Any] = batch.batch
        if "rollout_log_probs" not in tensors:
            raise ProbeError("verl batch has no rollout_log_probs: set rollout calculate_log_probs")
        return self.write_step(
            step,
            tensors["responses"],
            tensors["response_mask"],
            tensors["rollout_log_probs"],
            old_log_prob.batch["old_log_probs"],
            group=batch.non_tensor_batch.get("uid"),
        )

    def write_trl(self, step: int, output: Mapping[str, Any]) -> Path:
        """TRL: the dict ``GRPOTrainer._generate_and_score_completions`` returns."""
        if "sampling_per_token_logps" not in output or "old_per_token_logps" not in output:
            raise ProbeError(
                "TRL output lacks sampling_per_token_logps/old_per_token_logps: "
                "use_vllm=True with vllm_importance_sampling_correction=True records both"
            )
        return self.write_step(
            step,
            output["completion_ids"],
            output["completion_mask"],
            output["sampling_per_token_logps"],
            output["old_per_token_logps"],
        )

    def _write(self, step: int, table: pa.Table) -> Path:
        directory = self.root / f"step_{step}"
        directory.mkdir(parents=True, exist_ok=True)
        while True:
            path = directory / f"rank_{self.rank}_{self.calls}.parquet"
            self.calls += 1
            if not path.exists():
                break
        tmp = directory / f".{path.name}.partial-{os.getpid()}"
        try:
            pq.write_table(table, tmp, compression="zstd")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path


def _nullable(values: np.ndarray) -> pa.Array:
    """float32 array with nulls where ``values`` are not finite."""
    return pa.array(values.astype(np.float32), pa.float32(), mask=~np.isfinite(values))
