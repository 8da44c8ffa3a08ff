"""Policy versions in the hook's files: the off-policy lag of a step, and the audited rollouts
``probe watch --model 'ckpts/global_step_{step}/actor'`` rescores with the checkpoint that
sampled them.

The hook records, per batch, the version of the weights that sampled each row
(``hook.POLICY_KEY``) and the version of its training side (``hook.TRAINER_VERSION_KEY``): the
lag is their difference, in policy versions (verl's ``trajectory_staleness``). An audited step's
rollouts (``hook.AUDIT_SCHEMA``) become records with their prompt and whole response and no
training side; each is rescored with the checkpoint of its own policy version (the step's when
the hook was given none), the model of one version loaded at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.hook import AUDIT_DIR, POLICY_KEY, TRAINER_VERSION_KEY
from mismatch_probe.ingest.probe_format import attempts
from mismatch_probe.ingest.records import SeqRecord


def step_lag(step_dir: Path) -> dict[str, float] | None:
    """``{"min", "max", "mean"}`` of ``trainer_version - policy_version`` over the rows of a
    hook step (the latest attempt's files), None when the files do not record both."""
    lags: list[int] = []
    for file in attempts(step_dir)[0]:
        meta = pq.read_schema(file).metadata or {}
        if POLICY_KEY not in meta or TRAINER_VERSION_KEY not in meta:
            return None
        trainer = int(meta[TRAINER_VERSION_KEY])
        lags += [trainer - int(v) for v in json.loads(meta[POLICY_KEY]) if v is not None]
    if not lags:
        return None
    return {"min": float(min(lags)), "max": float(max(lags)), "mean": float(np.mean(lags))}


def audit_records(step_dir: Path, step: int) -> list[tuple[int, SeqRecord]] | None:
    """``(policy version, record to rescore)`` of every audited rollout of a hook step (the
    latest attempt per rank), None when the step kept none."""
    folder = step_dir / AUDIT_DIR
    if not folder.is_dir():
        return None
    out = []
    for file in attempts(folder)[0]:
        for i, row in enumerate(pq.read_table(file).to_pylist()):
            out.append(_record(row, step, f"{file} row {i}"))
    return out or None


def _record(row: dict[str, Any], step: int, where: str) -> tuple[int, SeqRecord]:
    response = np.asarray(row["response_ids"], np.int64)
    mask = np.asarray(row["response_mask"], bool)
    keep = np.flatnonzero(mask)
    version = row["policy_version"] if row["policy_version"] is not None else step
    rollout = np.asarray(row["rollout_logprobs"], np.float64)
    record = SeqRecord(
        step=step,
        source=where,
        prompt_key=row["group"],
        token_ids=response[keep],
        positions=keep,
        rollout=rollout[keep],
        train=None,
        prompt_ids=np.asarray(row["prompt_ids"], np.int64),
        response_ids=response,
    )
    return int(version), record


def rescore_by_version(
    rows: list[tuple[int, SeqRecord]],
    model_for: Callable[[int], Any],
    rescore: Callable[[Iterator[SeqRecord], Any], Iterator[SeqRecord]],
) -> list[SeqRecord]:
    """Each record rescored by the model of its policy version (``model_for(version)``; one
    version at a time, in order), records back in their order.

    Raises:
        ProbeError: a version without a checkpoint (``model_for``'s message).
    """
    out: dict[int, SeqRecord] = {}
    for version in sorted({v for v, _ in rows}):
        model = model_for(version)
        chosen = [(i, r) for i, (v, r) in enumerate(rows) if v == version]
        for (i, _), record in zip(chosen, rescore(iter(r for _, r in chosen), model), strict=True):
            out[i] = record
    if len(out) != len(rows):
        raise ProbeError("rescoring returned another number of records than it was given")
    return [out[i] for i in range(len(rows))]
