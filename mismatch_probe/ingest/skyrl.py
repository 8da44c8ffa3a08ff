"""SkyRL training-batch dumps: ``{export_path}/dumped_data/global_step_<N>_training_input.pkl``
(``--trust-pickle`` only).

Checked against NovaSky-AI/SkyRL ``skyrl/train/trainer.py`` (``train``: with
``trainer.dump_data_batch=true`` the batch is dumped after ``fwd_logprobs_values_reward`` and
``compute_advantages_and_returns``; ``dump_data``; ``convert_to_training_input``),
``skyrl/train/dataset/preprocess.py`` (``convert_prompts_responses_to_batch_tensors``,
``compute_prompt_boundaries``), ``skyrl/backends/skyrl_train/training_batch.py``
(``TensorBatch.__reduce__``/``__getstate__``, ``pad_training_input_batch``) and
``skyrl/train/config/config.py`` (``dump_data_batch``) at commit a956457 (2026-08), and
``skyrl-train/skyrl_train/training_batch.py`` before the move (2026-02):

* ``TrainingInputBatch.save`` is ``pickle.dump(batch)``; since 2026-03 the batch pickles as
  ``_rebuild_tensor_batch(cls, {"batch_dict", "batch_size", "device", "metadata"})``, each
  tensor in ``batch_dict`` as ``{"format": "numpy", "data", "shape", "dtype"}`` or
  ``{"format": "torch", "data": torch.save bytes}`` (bfloat16); before, as a dict subclass whose
  items are the raw tensors and whose state is that dict. The module is
  ``skyrl.backends.skyrl_train.training_batch`` (``skyrl_train.training_batch`` before 2026-02);
* keys: ``sequences`` ``[B, T]`` (left-padded prompt + response), and, right-aligned in
  ``[B, R]`` (a response of length ``n`` fills the last ``n`` columns): ``response_mask``,
  ``loss_mask`` (1 = trained; 0 e.g. for tool output), ``rollout_logprobs`` (the engine's;
  None without ``generator.sampling_params.logprobs``), ``action_log_probs`` (the trainer's
  forward; None when ``_skip_policy_forward``), ``base_action_log_probs`` (reference model);
  the response tokens are ``sequences[:, -R:]``;
* ``metadata["uids"]`` is popped before the dump; ``metadata["policy_prompt_boundaries"]``
  (``(start, end)`` rows per prompt, where present) gives the prompt groups;
  ``metadata["pad_size"]`` rows at the end are padding copies (loss mask 0) and are dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest import pickles
from mismatch_probe.ingest.batches import SeqBatch, from_records
from mismatch_probe.ingest.records import (
    SeqRecord,
    StepRange,
    as_bool_mask,
    check_shapes,
    int_value,
    numbered_files,
    short_repr,
)

WHAT = "SkyRL TrainingInputBatch"
_DUMP_FILE = re.compile(r"global_step_(\d+)_training_input\.pkl$")
_NO_ROLLOUT = " (the generator returned none: set generator.sampling_params.logprobs)"
_NO_TRAIN = " (the trainer skipped its policy forward: no recomputed log-probs)"
_MODULES = ("skyrl.backends.skyrl_train.training_batch", "skyrl_train.training_batch")


def dump_files(path: Path, steps: StepRange) -> list[tuple[int, Path]]:
    what = "global_step_<N>_training_input.pkl dump"
    return numbered_files(path, _DUMP_FILE, steps, what, "dumped_data")


def _rebuild_tensor_batch(cls: Any, state: Any) -> pickles.CapturedDict:
    """Stand-in for SkyRL's ``_rebuild_tensor_batch``: the state, nothing rebuilt."""
    batch = pickles.CapturedDict()
    batch.state = state
    return batch


_STAND_INS: dict[tuple[str, str], Any] = {}
for _module in _MODULES:
    for _name in ("TensorBatch", "TrainingInputBatch", "TrainingOutputBatch"):
        _STAND_INS[(_module, _name)] = pickles.CapturedDict
    _STAND_INS[(_module, "_rebuild_tensor_batch")] = _rebuild_tensor_batch
    _STAND_INS[(_module, "TensorList")] = pickles.Captured


def _tensor(value: Any, key: str) -> Any:
    """One ``batch_dict`` entry (or a raw tensor of the older layout) -> array or tensor."""
    if not isinstance(value, dict):
        return value
    if value.get("format") == "torch":
        return pickles.torch_load(value["data"], {})
    if value.get("format") == "tensor_list":
        return None  # variable-shape tensors (pixel values): not needed here
    return np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])


def load_dump(file: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, metadata)`` of one dump, without SkyRL."""
    obj = pickles.load(file, _STAND_INS, WHAT)
    if not isinstance(obj, pickles.CapturedDict):
        raise ProbeError(f"{file}: not a pickled SkyRL TrainingInputBatch")
    state = obj.state if isinstance(obj.state, dict) else {}
    tensors: dict[str, Any] = dict(obj)
    encoded = state.get("batch_dict")
    if isinstance(encoded, dict):
        tensors = pickles.guarded(
            file, WHAT, lambda: {k: _tensor(v, k) for k, v in encoded.items()}
        )
    metadata = state.get("metadata")
    return tensors, metadata if isinstance(metadata, dict) else {}


def _groups(metadata: dict[str, Any], rows: int, file: Path) -> list[str | None]:
    """Each row's prompt key: ``uids`` when kept, else the prompt boundaries, else None."""
    uids = metadata.get("uids")
    if isinstance(uids, list) and len(uids) >= rows:
        return [str(u) for u in uids[:rows]]
    keys: list[str | None] = [None] * rows
    for k, (start, end) in enumerate(_boundaries(metadata, file)):
        keys[start : min(end, rows)] = [f"prompt {k}"] * max(0, min(end, rows) - start)
    return keys


def _boundaries(metadata: dict[str, Any], file: Path) -> list[tuple[int, int]]:
    """``policy_prompt_boundaries``: ``(start, end)`` integer pairs, ``0 <= start <= end``."""
    name = "policy_prompt_boundaries"
    value = metadata.get(name)
    if value is None:
        return []
    where = f"{file}: metadata {name}"
    pairs = list(value) if isinstance(value, (list, tuple)) else None
    if pairs is None:
        raise ProbeError(f"{where} {short_repr(value)} is not a list of (start, end) pairs")
    out = []
    for bounds in pairs:
        if not isinstance(bounds, (list, tuple)) or len(bounds) != 2:
            raise ProbeError(f"{where}: {short_repr(bounds)} is not a (start, end) pair")
        start, end = (int_value(b, "bound", where) for b in bounds)
        if not 0 <= start <= end:
            raise ProbeError(f"{where}: ({start}, {end}) is not a range of rows")
        out.append((start, end))
    return out


def _pad_size(metadata: dict[str, Any], rows: int, file: Path) -> int:
    """``metadata["pad_size"]``: padding rows at the end, ``0..rows``."""
    value = metadata.get("pad_size")
    pad = 0 if value is None else int_value(value, "pad_size", f"{file}: metadata")
    if not 0 <= pad <= rows:
        raise ProbeError(f"{file}: metadata pad_size {pad} is not within 0..{rows} rows")
    return pad


def read(path: Path, steps: StepRange, trust_pickle: bool = False) -> Iterator[SeqRecord]:
    """Every response of each chosen dump, one dump in memory at a time."""
    pickles.refuse_untrusted(path, "SkyRL .pkl dumps", trust_pickle)
    for step, file in dump_files(path, steps):
        yield from _rows(file, step, _Dump.load(file))


def read_batches(path: Path, steps: StepRange, trust_pickle: bool = False) -> Iterator[SeqBatch]:
    """``read`` in columns: each dump is one ``SeqBatch`` (its masks turned into the trained
    tokens by one ``nonzero``); a dump whose masks hold other values than 0/1 goes through
    ``read``'s rows, which name the row."""
    pickles.refuse_untrusted(path, "SkyRL .pkl dumps", trust_pickle)
    for step, file in dump_files(path, steps):
        d = _Dump.load(file)
        masks = np.stack([d.loss_mask[: d.rows], d.response_mask[: d.rows]])
        if masks.size and not np.all(np.isin(masks, (0.0, 1.0))):
            yield from from_records(_rows(file, step, d))
            continue
        rows, cols = np.nonzero((masks[0] == 1.0) & (masks[1] == 1.0))
        first = d.width - d.response_mask[: d.rows].sum(axis=1).astype(np.int64)
        yield SeqBatch(
            step=step,
            sources=[f"{file} row {i}" for i in range(d.rows)],
            prompt_keys=d.groups,
            lengths=np.bincount(rows, minlength=d.rows).astype(np.int64),
            token_ids=d.sequences[:, -d.width :][rows, cols],
            positions=(cols - first[rows]).astype(np.int64),
            rollout=d.rollout[rows, cols],
            train=d.train[rows, cols],
        )


@dataclass(frozen=True)
class _Dump:
    """One dump's ``[B, R]`` arrays, checked; ``rows`` without the padding rows."""

    rollout: np.ndarray
    train: np.ndarray
    loss_mask: np.ndarray
    response_mask: np.ndarray
    sequences: np.ndarray
    rows: int
    groups: list[str | None]

    @property
    def width(self) -> int:
        return int(self.rollout.shape[1])

    @classmethod
    def load(cls, file: Path) -> _Dump:
        tensors, metadata = load_dump(file)
        rollout = pickles.batch_matrix(tensors, "rollout_logprobs", file, np.float64, _NO_ROLLOUT)
        train = pickles.batch_matrix(tensors, "action_log_probs", file, np.float64, _NO_TRAIN)
        loss_mask = pickles.batch_matrix(tensors, "loss_mask", file, np.float64)
        response_mask = pickles.batch_matrix(tensors, "response_mask", file, np.float64)
        check_shapes(file, loss_mask=loss_mask, response_mask=response_mask,
                     rollout_logprobs=rollout, action_log_probs=train)  # fmt: skip
        width = rollout.shape[1]
        sequences = pickles.batch_matrix(tensors, "sequences", file, np.int64)
        if sequences.shape[0] != rollout.shape[0] or sequences.shape[1] < width:
            raise ProbeError(f"{file}: sequences {list(sequences.shape)} do not hold the "
                             f"responses {list(rollout.shape)}")  # fmt: skip
        rows = rollout.shape[0] - _pad_size(metadata, rollout.shape[0], file)
        groups = _groups(metadata, rows, file)
        return cls(rollout, train, loss_mask, response_mask, sequences, rows, groups)


def _rows(file: Path, step: int, d: _Dump) -> Iterator[SeqRecord]:
    for i in range(d.rows):
        where = f"{file} row {i}"
        trained = as_bool_mask(d.loss_mask[i], "loss_mask", where)
        trained &= as_bool_mask(d.response_mask[i], "response_mask", where)
        keep = np.flatnonzero(trained)
        first = d.width - int(d.response_mask[i].sum())  # the response's first column
        yield SeqRecord(
            step=step,
            source=where,
            prompt_key=d.groups[i],
            token_ids=d.sequences[i, -d.width :][keep],
            positions=keep - first,
            rollout=d.rollout[i][keep],
            train=d.train[i][keep],
        )


def off_policy(path: Path) -> dict[str, Any]:
    return {
        "max_off_policy_steps": None,
        "source": "not in the dump: SkyRL's RayPPOTrainer is on-policy; its fully async "
        "trainer trains on rollouts up to trainer.fully_async.max_staleness_steps (default 4) "
        "policy versions old",
        "staleness": None,
    }
