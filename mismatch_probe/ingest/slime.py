"""slime train-data dumps: ``{dump_details}/train_data/{rollout_id}.pt``.

Checked against THUDM/slime ``slime/observability/train_data_utils.py``
(``_build_dump_payload``, ``save_debug_train_data``), ``slime/utils/arguments.py``
(``--dump-details`` sets ``save_debug_train_data = {dump_details}/train_data/{rollout_id}.pt``)
and ``slime/ray/rollout.py`` (``_convert_samples_to_train_data``) at commit 624b824 (2026-08):

* ``torch.save`` of ``{"format_version": 2, "rollout_id", "rank", "samples": [...],
  "dp_shards": [...], "raw_reward"?}``; each sample a dict with ``tokens`` (prompt + response),
  ``total_lengths``, ``response_lengths``, ``loss_masks``, ``log_probs`` (the trainer's,
  restored to full response length across context parallelism), ``rollout_log_probs`` (the
  engine's), ``sample_index``, ``rollout_position``, ... as tensors or lists;
* the response is the last ``response_lengths`` tokens; ``loss_masks``, ``log_probs`` and
  ``rollout_log_probs`` have one entry per response token;
* a removed sample (``remove_sample``) has an all-zero loss mask: it is skipped, not an error.

Loading: ``torch.load(weights_only=True)`` (tensors, lists, dicts, numbers, strings). A file
that needs more (numpy arrays, slime's own objects) is refused unless ``--trust-pickle``, and
then loaded through the restricted unpickler of the verl and SkyRL dumps (``pickles``): numpy
and torch reconstruction from the whitelist, slime's and Miles' classes rebuilt as inert
``Captured`` stand-ins, anything else refused by name. A TorchScript archive is refused either
way. No file runs code.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest import pickles
from mismatch_probe.ingest.records import (
    SeqRecord,
    StepRange,
    as_bool_mask,
    check_lengths,
    field_of,
    float_array,
    int_array,
    int_value,
    numbered_files,
)

FORMAT_VERSIONS = (2,)
WHAT = "slime train dump"
_DUMP_FILE = re.compile(r"(\d+)\.pt$")
_STAND_INS = pickles.CapturedModules("slime", "miles")


def dump_files(path: Path, steps: StepRange) -> list[tuple[int, Path]]:
    return numbered_files(path, _DUMP_FILE, steps, "<rollout_id>.pt train dump", "train_data")


def load_pt(path: Path, trust_pickle: bool) -> Any:
    """``torch.load`` on the CPU, weights-only; with ``trust_pickle``, what weights-only
    refuses goes through the restricted unpickler (see the module docstring)."""
    import pickle

    import torch

    try:
        pickles.refuse_torchscript(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickles.TorchScriptRefused:
        raise ProbeError(pickles.torchscript_message(path)) from None
    except pickle.UnpicklingError:
        if not trust_pickle:
            raise ProbeError(
                f"{path} needs more than tensors and lists: unpickling can run code from the "
                "file; pass --trust-pickle if you trust it"
            ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ProbeError(f"{path}: not a readable torch file ({reason})") from None
    return pickles.guarded(path, WHAT, lambda: pickles.torch_load(path, _STAND_INS))


def read(path: Path, steps: StepRange, trust_pickle: bool = False) -> Iterator[SeqRecord]:
    """Every sample of each chosen dump, one dump file in memory at a time."""
    for step, file in dump_files(path, steps):
        data = load_pt(file, trust_pickle)
        if not isinstance(data, dict) or data.get("format_version") not in FORMAT_VERSIONS:
            version = data.get("format_version") if isinstance(data, dict) else None
            raise ProbeError(f"{file}: format_version {version!r} (supported: {FORMAT_VERSIONS})")
        samples = data.get("samples")
        if not isinstance(samples, list):
            raise ProbeError(f"{file}: no samples list")
        for i, sample in enumerate(samples):
            if not isinstance(sample, dict):
                raise ProbeError(f"{file}: samples[{i}] is not a dict")
            yield sample_record(sample, step, f"{file} samples[{i}]", train_key="log_probs")
        del data


_NUMPY_DTYPES = {"torch.bool", "torch.uint8", "torch.int8", "torch.int16", "torch.int32",
                 "torch.int64", "torch.float16", "torch.float32", "torch.float64"}  # fmt: skip


def _values(value: Any) -> Any:
    """A tensor's or array's values for ``int_array``/``float_array``: a tensor of a type numpy
    holds (and bfloat16, widened to float32 exactly, as ``tolist`` widens it to Python floats)
    as a numpy array, an array of numbers as it is: no Python object per token, the same
    float64 values as ``tolist``. Anything else (a list, a float8 or complex tensor) as
    ``tolist`` gives it."""
    if hasattr(value, "detach") and hasattr(value, "resolve_neg"):
        dtype = str(value.dtype)
        if dtype in _NUMPY_DTYPES or dtype == "torch.bfloat16":
            tensor = value.detach().cpu().resolve_conj().resolve_neg()
            return (tensor.float() if dtype == "torch.bfloat16" else tensor).numpy()
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return value
    return value.tolist() if hasattr(value, "tolist") else value


def sample_record(
    sample: dict[str, Any], step: int, where: str, train_key: str | None
) -> SeqRecord:
    """A slime/Miles sample (response = last ``response_length`` tokens) -> ``SeqRecord``;
    ``train_key=None`` keeps the prompt for rescoring instead of a training side."""
    tokens = int_array(_values(field_of(sample, "tokens", where)), "tokens", where)
    length_key = _key(sample, "response_length")
    length = int_value(field_of(sample, length_key, where), length_key, where)
    if not 0 < length <= len(tokens):
        raise ProbeError(f"{where}: response length {length} with {len(tokens)} tokens")
    mask_key = _key(sample, "loss_mask")
    mask_values = sample.get(mask_key)
    mask = (
        np.ones(length) if mask_values is None
        else float_array(_values(mask_values), mask_key, where)
    )  # fmt: skip
    rollout = float_array(
        _values(field_of(sample, "rollout_log_probs", where)), "rollout_log_probs", where
    )
    train = None
    if train_key is not None:
        train = float_array(_values(field_of(sample, train_key, where)), train_key, where)
    response = tokens[len(tokens) - length :]
    check_lengths(where, response=response, loss_mask=mask, rollout_log_probs=rollout,
                  log_probs=train)  # fmt: skip
    keep = np.flatnonzero(as_bool_mask(mask, mask_key, where))
    index = sample.get("sample_index")
    return SeqRecord(
        step=step,
        source=where,
        prompt_key=None if index is None else f"sample {index}",
        token_ids=response[keep],
        positions=keep,
        rollout=rollout[keep],
        train=None if train is None else train[keep],
        prompt_ids=None if train_key is not None else tokens[: len(tokens) - length],
        response_ids=None if train_key is not None else response,
    )


def _key(sample: dict[str, Any], singular: str) -> str:
    """slime's train dump pluralises (``response_lengths``); Miles' columns do not."""
    return singular + "s" if singular + "s" in sample else singular


def off_policy(path: Path) -> dict[str, Any]:
    return {
        "max_off_policy_steps": None,
        "source": "not in the dump: slime is on-policy unless run asynchronously "
        "(train_async.py) or with partial rollouts",
        "staleness": None,
    }
