"""verl ``DataProto`` dumps: ``DIR/step_<N>.dp``, one per training step (``--trust-pickle`` only).

Checked against volcengine/verl ``verl/protocol.py`` (``DataProto.save_to_disk``,
``__getstate__``, ``serialize_tensordict``), ``verl/trainer/ppo/ray_trainer.py`` (``fit``: the
batch after ``_compute_old_log_prob``), ``verl/experimental/agent_loop/agent_loop.py``
(``_postprocess``: the batch keys) and ``verl/utils/debug/metrics.py``
(``calculate_debug_metrics``: the mask it compares under) at commit b178a3c (2026-01), and
against tensordict 0.10.0 and 0.15.3 ``tensordict/_reductions.py`` (the consolidated pickle):

* verl writes no per-step dump of the training batch (``save_to_disk`` is used only by the
  rollout-skip cache, before any log-prob recompute). The README's one-line hook saves the batch
  after the old-log-prob recompute as ``DIR/step_<global_steps>.dp``; the step is the number in
  the file name;
* ``save_to_disk`` is ``pickle.dump(dataproto)``; ``DataProto.__getstate__`` returns
  ``(torch.save bytes of batch.contiguous().consolidate(), non_tensor_batch, meta_info)``,
  or, with ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``, ``((batch_size, device,
  {key: (dtype name, shape, uint8 array)}), non_tensor_batch, meta_info)``;
* a consolidated TensorDict pickles as ``_rebuild_tensordict_files_consolidated(metadata,
  storage)``: one uint8 storage, ``metadata["leaves"][key] = (dtype str, shape, start, stop,
  pad[, ragged index])``, sub-TensorDicts as further keys; an unconsolidated one as
  ``_make_td(cls, state)`` with the tensors in ``state["_tensordict"]``;
* batch keys (``[B, R]`` unless said): ``responses``, ``response_mask`` (1 = trained token;
  absent in old runs: then ``attention_mask[:, -R:]``), ``rollout_log_probs`` (the engine's,
  needs ``actor_rollout_ref.rollout.calculate_log_probs=True``), ``old_log_probs`` (the
  trainer's recompute), ``prompts`` ``[B, P]``, ``input_ids``/``attention_mask`` ``[B, P+R]``;
  non-tensor ``uid`` (one per prompt, shared by its ``rollout.n`` responses). Responses are
  right-padded: position 0 is the first response token.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
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
    numbered_files,
)

WHAT = "verl DataProto"
_DUMP_FILE = re.compile(r"step_(\d+)\.dp$")


def dump_files(path: Path, steps: StepRange) -> list[tuple[int, Path]]:
    return numbered_files(path, _DUMP_FILE, steps, "step_<N>.dp dump")


def _consolidated(metadata: dict[str, Any], storage: Any) -> dict[str, Any]:
    """Stand-in for tensordict's ``_rebuild_tensordict_files_consolidated``: key -> tensor."""
    import torch

    out: dict[str, Any] = {}
    meta = dict(metadata)
    leaves = meta.pop("leaves")
    for name in ("non_tensors", "cls", "cls_metadata", "size"):
        meta.pop(name, None)
    for key, leaf in leaves.items():
        dtype = getattr(torch, str(leaf[0]).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype) or len(leaf) not in (5, 6):
            raise ProbeError(f"unknown TensorDict leaf layout for {key!r}: {leaf!r}")
        shape, start, stop = torch.Size(leaf[1]), int(leaf[2]), int(leaf[3])
        value = storage[start:stop].view(dtype)
        out[key] = value[: shape.numel()].view(shape)
    for key, sub in meta.items():  # sub-TensorDicts
        out[key] = _consolidated(sub, storage)
    return out


def _make_td(cls: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Stand-in for tensordict's ``_make_td`` (an unconsolidated TensorDict)."""
    return dict(state.get("_tensordict") or {})


_TD_STAND_INS = {
    ("tensordict._reductions", "_rebuild_tensordict_files_consolidated"): _consolidated,
    ("tensordict._reductions", "_make_td"): _make_td,
    ("tensordict._td", "TensorDict"): pickles.Captured,
    ("tensordict.utils", "_StringOnlyDict"): dict,
}
_STAND_INS = {("verl.protocol", "DataProto"): pickles.Captured, **_TD_STAND_INS}


def load_dump(file: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, non_tensor_batch)`` of one ``.dp`` file, without verl or tensordict."""
    obj = pickles.load(file, _STAND_INS, WHAT)
    if not isinstance(obj, pickles.Captured) or not isinstance(obj.state, tuple):
        raise ProbeError(f"{file}: not a pickled verl DataProto")
    if len(obj.state) != 3:
        raise ProbeError(f"{file}: a DataProto state of {len(obj.state)} items (expected 3)")
    batch, non_tensor, _meta = obj.state
    if isinstance(batch, bytes):
        batch = pickles.guarded(file, WHAT, lambda: pickles.torch_load(batch, _TD_STAND_INS))
    elif isinstance(batch, tuple) and len(batch) == 3:
        batch = pickles.guarded(file, WHAT, lambda: _numpy_serialized(batch[2]))
    if not isinstance(batch, dict):
        raise ProbeError(f"{file}: the DataProto holds no tensor batch")
    return batch, non_tensor if isinstance(non_tensor, dict) else {}


def _numpy_serialized(items: dict[str, Any]) -> dict[str, Any]:
    """``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``: ``key -> (dtype name, shape, uint8)``."""
    import torch

    out = {}
    for key, (dtype, shape, data) in items.items():
        torch_dtype = getattr(torch, str(dtype), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ProbeError(f"{key}: {str(dtype)[:40]!r} is not a torch dtype")
        raw = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1))
        out[key] = raw.view(torch_dtype).view(tuple(shape))
    return out


def _numpy(batch: dict[str, Any], key: str, file: Path, dtype: Any) -> np.ndarray:
    keys = f" (keys: {', '.join(sorted(batch))})"
    return pickles.batch_matrix(batch, key, file, dtype, keys)


def _mask(batch: dict[str, Any], width: int, file: Path) -> tuple[np.ndarray, str]:
    """``response_mask``, else the response part of ``attention_mask`` (as verl's own
    ``calculate_debug_metrics`` does)."""
    if batch.get("response_mask") is not None:
        return _numpy(batch, "response_mask", file, np.float64), "response_mask"
    if batch.get("attention_mask") is not None:
        return _numpy(batch, "attention_mask", file, np.float64)[:, -width:], "attention_mask"
    raise ProbeError(f"{file}: the batch has neither response_mask nor attention_mask")


def read(path: Path, steps: StepRange, trust_pickle: bool = False) -> Iterator[SeqRecord]:
    """Every response of each chosen dump, one dump in memory at a time."""
    pickles.refuse_untrusted(path, "verl .dp dumps", trust_pickle)
    for step, file in dump_files(path, steps):
        yield from _rows(file, step, *_step_arrays(file))


def _step_arrays(
    file: Path,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str, Any]:
    """``(responses, rollout, train, mask, mask name, uids)`` of one dump, checked."""
    batch, non_tensor = load_dump(file)
    responses = _numpy(batch, "responses", file, np.int64)
    rollout = _numpy(batch, "rollout_log_probs", file, np.float64)
    train = _numpy(batch, "old_log_probs", file, np.float64)
    mask, mask_key = _mask(batch, responses.shape[1], file)
    check_shapes(file, responses=responses, **{mask_key: mask},
                 rollout_log_probs=rollout, old_log_probs=train)  # fmt: skip
    uids = non_tensor.get("uid")
    if uids is not None and (not hasattr(uids, "__len__") or len(uids) != len(responses)):
        count = len(uids) if hasattr(uids, "__len__") else "no list of"
        raise ProbeError(f"{file}: {count} uids for {len(responses)} responses")
    return responses, rollout, train, mask, mask_key, uids


def _rows(
    file: Path, step: int, responses: np.ndarray, rollout: np.ndarray, train: np.ndarray,
    mask: np.ndarray, mask_key: str, uids: Any,
) -> Iterator[SeqRecord]:  # fmt: skip
    for i in range(len(responses)):
        where = f"{file} row {i}"
        keep = np.flatnonzero(as_bool_mask(mask[i], mask_key, where))
        yield SeqRecord(
            step=step,
            source=where,
            prompt_key=None if uids is None else str(uids[i]),
            token_ids=responses[i][keep],
            positions=keep,
            rollout=rollout[i][keep],
            train=train[i][keep],
        )


def read_batches(path: Path, steps: StepRange, trust_pickle: bool = False) -> Iterator[SeqBatch]:
    """``read`` in columns: each dump is one ``SeqBatch``, its ``[B, R]`` masks turned into the
    trained tokens by one ``nonzero``; a dump whose mask holds other values than 0/1 goes
    through ``read``, which names the row."""
    pickles.refuse_untrusted(path, "verl .dp dumps", trust_pickle)
    for step, file in dump_files(path, steps):
        arrays = _step_arrays(file)
        responses, rollout, train, mask, _, uids = arrays
        if mask.size and not np.all(np.isin(mask, (0.0, 1.0))):
            yield from from_records(_rows(file, step, *arrays))
            continue
        rows, cols = np.nonzero(mask)
        yield SeqBatch(
            step=step,
            sources=[f"{file} row {i}" for i in range(len(responses))],
            prompt_keys=[None if uids is None else str(uids[i]) for i in range(len(responses))],
            lengths=np.bincount(rows, minlength=len(responses)).astype(np.int64),
            token_ids=responses[rows, cols],
            positions=cols.astype(np.int64),
            rollout=rollout[rows, cols],
            train=train[rows, cols],
        )


def off_policy(path: Path) -> dict[str, Any]:
    return {
        "max_off_policy_steps": None,
        "source": "not in the dump: verl's RayPPOTrainer is on-policy (old_log_probs "
        "recomputed with the rollout's weights); its one-step-off-policy and fully-async "
        "trainers are not",
        "staleness": None,
    }
