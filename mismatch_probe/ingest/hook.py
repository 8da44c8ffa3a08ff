"""The writer half of a framework hook: our own token schema (format ``probe``), step by step.

A training loop calls ``ProbeWriter.write_step`` once per batch with the batch's response
tokens, their mask, the engine's and the trainer's log-probs, each ``[B, T]`` (torch tensors or
numpy arrays). ``write_trl`` and ``write_verl`` / ``write_verl_v1`` take the objects those
trainers hold where the README's hooks run; ``ProbeWriter.for_trl`` / ``for_verl`` build a
writer from the trainer itself (rank, off-policy bound, the checks that would otherwise make a
hook write nothing, or the wrong thing, silently). ``probe ingest probe DIR`` reads the result.

Layout: ``DIR/step_<N>/rank_<R>_<K>.parquet``, one file per call (``K`` counts the calls of one
writer), written under a hidden name and renamed when complete, so a reader never sees half a
file; a batch without any trained token still gets its (empty) file, and each file records
its batch's row count, so the ingest can report responses and steps without a trained token.

Steps, attempts and manifests: each writer is one *attempt* (``ATTEMPT_KEY``: its start time in
nanoseconds, pid and a random tag, so a later attempt sorts after an earlier one), recorded in
every file with the rank. A trainer restarted on the same directory writes a step again beside
the dead run's files; the reader keeps, per step and rank, the files of the latest attempt only,
and says which steps were rewritten (``probe_format.rewrites``). When a writer moves on to
another step (or ``end_step``/``close``, also run at exit) it writes the step's manifest
``step_<N>/_rank_<R>.manifest.json`` (files, rows, tokens, attempt, ``world_size``): ``probe
watch`` reads a step once the manifests of every rank are there, so it never reads a step still
being written. verl's hooks write one batch per step and close it at once.

Audits (``audit_every=N``, for runs that skip the training-side recompute): the rollouts of the
steps whose policy version (the weights that sampled them; the step when not given) is a
multiple of N are kept whole under ``step_<N>/audit/rank_<R>_<K>.parquet`` (``AUDIT_SCHEMA``:
prompt ids, response ids, mask, rollout log-probs, policy version, one row per response), so that
``probe watch --model 'ckpts/global_step_{step}/actor'`` rescores them with the checkpoint that
sampled them. A batch without training log-probs (``train_logprobs=None``) writes its token file
with null training log-probs on audited steps, and nothing on the others.
One row per trained token (``PROBE_SCHEMA``): ``step``, ``sequence`` (row of the batch),
``group`` (prompt key: verl's ``uid``, a hash of TRL's prompt ids; null when unknown),
``position`` (in the response, counting every token: tool output between two turns keeps its
positions, so runs of trained positions are the turns), ``token_id``, ``rollout_logprob``,
``train_logprob`` (null where non-finite). The file's key-value metadata names the format and
version and, when known, the off-policy bound, whether rollouts can be stale, and where that
came from.

This module needs numpy and pyarrow only (``write_verl_v1`` imports ``transfer_queue``, which
verl's V1 trainer runs on, when it is not given the data); torch tensors are converted with
``.detach().cpu()``. It never imports TRL or verl: it reads the attributes and keys named below
(checked against TRL 1.16.0 ``trl/trainer/grpo_trainer.py`` and verl 0.9.1
``verl/trainer/ppo/ray_trainer.py``, ``verl/trainer/ppo/v1/trainer_base.py``,
``verl/trainer/ppo/v1/agent_loop_tq.py``, ``verl/trainer/ppo/padding_utils.py``).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import time
import weakref
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest import frameworks

FORMAT_NAME = "probe-tokens"
FORMAT_VERSION = "1"
FORMAT_KEY = b"mismatch_probe.format"
VERSION_KEY = b"mismatch_probe.format_version"
OFF_POLICY_KEY = b"mismatch_probe.max_off_policy_steps"
STALENESS_KEY = b"mismatch_probe.staleness"  # "true"/"false": rollouts may lag the trainer
OFF_POLICY_SOURCE_KEY = b"mismatch_probe.off_policy_source"  # where the two above came from
ROWS_KEY = b"mismatch_probe.rows"  # rows of the batch, trained or not (B of the [B, T] arrays)
ATTEMPT_KEY = b"mismatch_probe.attempt"  # the writer's attempt: a later one sorts after
RANK_KEY = b"mismatch_probe.rank"
POLICY_KEY = b"mismatch_probe.policy_versions"  # JSON [B]: the weights that sampled each row
TRAINER_VERSION_KEY = b"mismatch_probe.trainer_version"  # the weights of the training side
AUDIT_DIR = "audit"
MANIFEST_GLOB = "_rank_*.manifest.json"

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

# One row per response of an audited step: what rescoring needs (``probe watch --model``).
AUDIT_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("sequence", pa.int64(), nullable=False),
        pa.field("group", pa.string()),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),  # prompt, padding removed
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),  # [T] whole response
        pa.field("response_mask", pa.list_(pa.bool_()), nullable=False),  # [T] trained tokens
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),  # [T] engine
        pa.field("policy_version", pa.int64()),  # the weights that sampled it, when known
    ]
)


def manifest_name(rank: int) -> str:
    """``_rank_<R>.manifest.json``: hidden from Parquet dataset readers (leading ``_``)."""
    return f"_rank_{rank}.manifest.json"


def new_attempt() -> str:
    """A writer's attempt id: ``<start time ns, 20 digits>-<pid>-<random>``, so sorting the ids
    orders the attempts in time."""
    return f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(3)}"


# verl V1: what ``_compute_old_log_prob`` leaves in TransferQueue for each sample.
VERL_V1_FIELDS = ("responses", "response_mask", "rollout_log_probs", "old_log_probs", "uid")


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
        max_off_policy_steps: how many policy versions a rollout may lag behind the trainer's
            log-probs (0: both sides come from the same weights), recorded so the report can
            say whether the ratio includes staleness; None when unknown.
        staleness: whether rollouts can be older than the trainer's weights (None: derived
            from ``max_off_policy_steps``; True with an unknown bound for asynchronous
            trainers that set none).
        off_policy_source: where the bound comes from, for the report.
        world_size: how many ranks write each step (each writes its own manifest; ``probe
            watch`` waits for all of them).
        audit_every: keep the rollouts of every N-th policy version for rescoring (see the
            module docstring); None keeps none.
    """

    def __init__(
        self,
        root: Path | str,
        rank: int = 0,
        max_off_policy_steps: int | None = None,
        staleness: bool | None = None,
        off_policy_source: str | None = None,
        world_size: int = 1,
        audit_every: int | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ProbeError(f"ProbeWriter: rank {rank} is not within a world of {world_size}")
        if audit_every is not None and audit_every < 1:
            raise ProbeError(f"ProbeWriter: audit_every {audit_every} is not a positive integer")
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.audit_every = audit_every
        self.calls = 0
        self.attempt = new_attempt()
        self._open: dict[str, Any] | None = None  # the step being written: files, rows, tokens
        atexit.register(_close_at_exit, weakref.ref(self))
        meta = {FORMAT_KEY: FORMAT_NAME.encode(), VERSION_KEY: FORMAT_VERSION.encode()}
        meta[ATTEMPT_KEY] = self.attempt.encode()
        meta[RANK_KEY] = str(rank).encode()
        if max_off_policy_steps is not None:
            meta[OFF_POLICY_KEY] = str(int(max_off_policy_steps)).encode()
            staleness = max_off_policy_steps > 0 if staleness is None else staleness
        if staleness is not None:
            meta[STALENESS_KEY] = b"true" if staleness else b"false"
        if off_policy_source:
            meta[OFF_POLICY_SOURCE_KEY] = off_policy_source.encode()
        self.schema = PROBE_SCHEMA.with_metadata(meta)

    # --- building a writer from a trainer --------------------------------------------------

    @classmethod
    def for_trl(cls, trainer: Any, root: Path | str) -> ProbeWriter:
        """The writer of a TRL ``GRPOTrainer``: its process rank, and bound 0 (TRL computes
        ``old_per_token_logps`` right after generation, with the weights that sampled)."""
        accelerator = trainer.accelerator
        return cls(
            root,
            rank=int(accelerator.process_index),
            world_size=int(getattr(accelerator, "num_processes", 1)),
            **frameworks.TRL_BOUND,
        )

    @classmethod
    def for_verl(cls, trainer: Any, root: Path | str) -> ProbeWriter:
        """The writer of a verl trainer (legacy ``RayPPOTrainer`` or a V1 ``PPOTrainer``),
        built in its ``__init__``: refuses a configuration under which the hook would write
        nothing or compare the rollout log-probs with themselves, and takes the off-policy bound
        from the trainer class and config (``frameworks.verl_off_policy``).

        Raises:
            ProbeError: ``root`` is relative (verl runs the trainer in a Ray actor whose working
                directory is not yours), rollout log-probs are off, or bypass mode is on.
        """
        if not Path(root).is_absolute():
            raise ProbeError(
                f"ProbeWriter.for_verl: {root} is relative; verl runs the trainer in a Ray actor "
                "with another working directory, so give an absolute directory"
            )
        frameworks.check_verl_config(trainer.config)
        return cls(root, rank=0, **frameworks.verl_off_policy(trainer))

    # --- the framework hooks ---------------------------------------------------------------

    def write_trl(self, trainer: Any, output: Mapping[str, Any]) -> Path | None:
        """TRL: the dict ``GRPOTrainer._generate_and_score_completions`` returns.

        Trained tokens are TRL's loss mask, ``completion_mask * tool_mask`` (tool results carry
        a sampling log-prob of 0.0 and are not trained on; their positions stay as context).
        Evaluation batches (the same method, with ``trainer.model.training`` False) are not
        written: returns None. The step is ``trainer.state.global_step`` at generation; the
        group is a hash of each row's prompt ids.

        Raises:
            ProbeError: the dict lacks either log-prob tensor (see the message for the config).
        """
        if not trainer.model.training:
            return None
        if "sampling_per_token_logps" not in output or "old_per_token_logps" not in output:
            raise ProbeError(
                "TRL output lacks sampling_per_token_logps/old_per_token_logps: "
                "use_vllm=True with vllm_importance_sampling_correction=True records both"
            )
        mask = to_numpy(output["completion_mask"], np.float64)
        if output.get("tool_mask") is not None:
            mask = mask * to_numpy(output["tool_mask"], np.float64)
        group = None
        if output.get("prompt_ids") is not None:
            group = prompt_groups(output["prompt_ids"], output.get("prompt_mask"))
        return self.write_step(
            int(trainer.state.global_step),
            output["completion_ids"],
            mask,
            output["sampling_per_token_logps"],
            output["old_per_token_logps"],
            group=group,
        )

    def write_verl(self, step: int, batch: Any, old_log_prob: Any) -> Path | None:
        """verl legacy trainer (``trainer.use_v1=False``): the ``DataProto`` given to
        ``RayPPOTrainer._compute_old_log_prob`` and the ``DataProto`` it returns."""
        tensors: Mapping[str, Any] = batch.batch
        if "rollout_log_probs" not in tensors:
            raise ProbeError(frameworks.VERL_NO_ROLLOUT_LOGPROBS)
        return self.write_step(
            step,
            tensors["responses"],
            tensors["response_mask"],
            tensors["rollout_log_probs"],
            old_log_prob.batch["old_log_probs"],
            group=batch.non_tensor_batch.get("uid"),
            complete=True,  # verl computes the old log-probs once per step
        )

    def write_verl_v1(self, step: int, batch: Any, data: Any = None) -> Path | None:
        """verl V1 trainer (``trainer.use_v1=True``, the default): the ``KVBatchMeta`` that
        ``PPOTrainer._compute_old_log_prob`` returns. The samples' fields are read from
        TransferQueue (``VERL_V1_FIELDS``), or taken from ``data``: the ``TensorDict`` that
        ``transfer_queue.kv_batch_get`` returns (jagged ``[B, R_i]`` fields, ``uid`` non-tensor).
        Rows verl added to make the batch divisible (tag ``is_padding``) are left out.
        """
        if data is None:
            import transfer_queue as tq

            data = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=list(VERL_V1_FIELDS)
            )
        (responses, mask, rollout, old), uids = frameworks.verl_v1_rows(data, batch.tags)
        return self.write_step(step, responses, mask, rollout, old, group=uids, complete=True)

    # --- the writer --------------------------------------------------------------------------

    def write_step(
        self,
        step: int,
        responses: Any,
        response_mask: Any,
        rollout_logprobs: Any,
        train_logprobs: Any,
        group: Sequence[Any] | None = None,
        *,
        prompt_ids: Any = None,
        prompt_mask: Any = None,
        policy_version: Any = None,
        trainer_version: int | None = None,
        complete: bool = False,
    ) -> Path | None:
        """Write the trained tokens of one batch; returns the file (None: nothing to write, a
        batch without training log-probs on a step that is not audited).

        Args:
            step: the training step.
            responses: ``[B, T]`` response token ids (right-padded).
            response_mask: ``[B, T]`` 1/True for a trained token.
            rollout_logprobs: ``[B, T]`` the engine's log-prob of each token.
            train_logprobs: ``[B, T]`` the trainer's log-prob of the same token, or None when
                the trainer skipped that forward (the step can only be audited).
            group: ``[B]`` prompt keys (responses to one prompt share one), or None.
            prompt_ids: ``[B, P]`` left-padded prompt ids (``prompt_mask`` 1 on real tokens):
                kept on audited steps, for rescoring.
            policy_version: the version of the weights that sampled each row (an int or
                ``[B]``), or None (unknown); decides the audited steps and the off-policy lag.
            trainer_version: the version of the weights of ``train_logprobs`` (lag =
                ``trainer_version - policy_version``), or None.
            complete: the step has no further batch of this rank: write its manifest now.
        """
        if self._open is not None and self._open["step"] != int(step):
            self.end_step()
        versions = _versions(policy_version, np.shape(to_numpy(response_mask, np.float64))[0])
        audited = self._audited(int(step), versions)
        if train_logprobs is None and not audited:
            return None
        tokens = to_numpy(responses, np.int64)
        mask = to_numpy(response_mask, np.float64) != 0
        rollout = to_numpy(rollout_logprobs, np.float64)
        train = (
            np.full(rollout.shape, np.nan)
            if train_logprobs is None
            else to_numpy(train_logprobs, np.float64)
        )
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
        meta = {**(self.schema.metadata or {}), ROWS_KEY: str(tokens.shape[0]).encode()}
        if versions is not None:
            meta[POLICY_KEY] = json.dumps(versions).encode()
        if trainer_version is not None:
            meta[TRAINER_VERSION_KEY] = str(int(trainer_version)).encode()
        path = self._write(int(step), table.replace_schema_metadata(meta))
        if audited:
            self._write_audit(int(step), tokens, mask, rollout, group, prompt_ids, prompt_mask,
                              versions)  # fmt: skip
        self._open["rows"] += int(tokens.shape[0])  # type: ignore[index]
        self._open["tokens"] += len(rows)  # type: ignore[index]
        if complete:
            self.end_step()
        return path

    def _audited(self, step: int, versions: list[int | None] | None) -> bool:
        """Whether this batch's rollouts are kept: its policy version (the step when unknown)
        is a multiple of ``audit_every``."""
        if self.audit_every is None:
            return False
        known = [v for v in versions or [] if v is not None]
        version = min(known) if known else step
        return version % self.audit_every == 0

    def _write(self, step: int, table: pa.Table, folder: str = "") -> Path:
        directory = self.root / f"step_{step}"
        if folder:
            directory = directory / folder
        directory.mkdir(parents=True, exist_ok=True)
        if self._open is None:
            self._open = {"step": step, "files": [], "audit": [], "rows": 0, "tokens": 0}
        while True:
            path = directory / f"rank_{self.rank}_{self.calls}.parquet"
            self.calls += 1
            if not path.exists():
                break
        with store.atomic(path) as tmp:
            pq.write_table(table, tmp, **store.parquet_options(table.schema))
        self._open["audit" if folder else "files"].append(path.name)
        return path

    def _write_audit(self, step: int, tokens: np.ndarray, mask: np.ndarray, rollout: np.ndarray,
                     group: Sequence[Any] | None, prompt_ids: Any, prompt_mask: Any,
                     versions: list[int | None] | None) -> None:  # fmt: skip
        """The whole rollouts of an audited batch (``AUDIT_SCHEMA``)."""
        if prompt_ids is None:
            raise ProbeError(
                f"write_step: step {step} is audited (audit_every={self.audit_every}) but no "
                "prompt_ids were given: rescoring needs the prompts"
            )
        prompts = to_numpy(prompt_ids, np.int64)
        keep = (
            np.ones(prompts.shape, bool)
            if prompt_mask is None
            else (to_numpy(prompt_mask, np.int64) != 0)
        )
        rows = range(tokens.shape[0])
        lengths = [int(np.flatnonzero(m).max()) + 1 if m.any() else 0 for m in mask]
        table = pa.table(
            {
                "step": [step] * len(rows),
                "sequence": list(rows),
                "group": [None if group is None else str(group[i]) for i in rows],
                "prompt_ids": [prompts[i][keep[i]].tolist() for i in rows],
                "response_ids": [tokens[i, : lengths[i]].tolist() for i in rows],
                "response_mask": [mask[i, : lengths[i]].tolist() for i in rows],
                "rollout_logprobs": [
                    np.nan_to_num(rollout[i, : lengths[i]], nan=0.0).tolist() for i in rows
                ],
                "policy_version": [None if versions is None else versions[i] for i in rows],
            },
            schema=AUDIT_SCHEMA.with_metadata(self.schema.metadata),
        )
        self._write(step, table, AUDIT_DIR)

    def end_step(self) -> Path | None:
        """Write the manifest of the step being written (its last batch of this rank is in);
        returns it (None when no step is open). Called when a batch of another step comes,
        by ``close`` and at exit."""
        if self._open is None:
            return None
        info, self._open = self._open, None
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "attempt": self.attempt,
            "written": time.time(),
            **info,
        }
        path = self.root / f"step_{info['step']}" / manifest_name(self.rank)
        store.write_json(path, manifest)
        return path

    def close(self) -> None:
        """End the open step (its manifest); the writer can go on with a new step after."""
        self.end_step()


def _close_at_exit(ref: weakref.ReferenceType[ProbeWriter]) -> None:
    """The last step's manifest when the training process ends normally."""
    writer = ref()
    if writer is not None:
        with suppress(OSError):  # a full disk at exit: no manifest (watch never reads the step)
            writer.close()


def _versions(value: Any, rows: int) -> list[int | None] | None:
    """``policy_version`` as one int (or None) per row; None when not given."""
    if value is None:
        return None
    if np.ndim(value) == 0:
        return [int(value)] * rows
    out = [None if v is None else int(v) for v in list(value)]
    if len(out) != rows:
        raise ProbeError(f"write_step: {len(out)} policy versions for {rows} rows")
    return out


def prompt_groups(prompt_ids: Any, prompt_mask: Any = None) -> list[str]:
    """``[B]`` group keys of ``[B, P]`` (left-padded) prompt ids: a short hash of each row's
    ids under ``prompt_mask`` (all ids without one), so the ``num_generations`` responses to a
    prompt share a key."""
    ids = to_numpy(prompt_ids, np.int64)
    mask = np.ones(ids.shape, bool) if prompt_mask is None else to_numpy(prompt_mask, np.int64) != 0
    return [hashlib.sha1(r[m].tobytes()).hexdigest()[:16] for r, m in zip(ids, mask, strict=True)]


def _nullable(values: np.ndarray) -> pa.Array:
    """float32 array with nulls where ``values`` are not finite."""
    return pa.array(values.astype(np.float32), pa.float32(), mask=~np.isfinite(values))
