"""NeMo-RL GRPO training-data logs: ``<log_dir>/train_data_step<N>.jsonl``.

Checked against NVIDIA-NeMo/RL ``nemo_rl/algorithms/grpo.py`` (sync and async GRPO logging) and
``nemo_rl/utils/logger.py`` (``log_batched_dict_as_jsonl``) at commit 7ea279a (2026-08):

* one line per sample: ``content, rewards, input_lengths, token_ids, token_loss_mask,
  sample_loss_mask, advantages, generation_logprobs, prev_logprobs`` (optionally
  ``agent_ref``, ``filtered_rewards``) plus ``idx`` (the line's index) added by the logger;
* the logger slices the batch one sample at a time (``make_microbatch_iterator(1)``), so each
  field is a one-element list: ``token_ids`` is ``[[t0, t1, ...]]``. We accept that and a flat
  list alike;
* the arrays are the batch's padded ``input_ids``-aligned tensors: ``input_lengths`` gives the
  real length; ``generation_logprobs[i]`` / ``prev_logprobs[i]`` belong to ``token_ids[i]``,
  index 0 unused (grpo.py compares ``[:, 1:]``); prompt tokens have ``token_loss_mask`` 0;
* ``prev_logprobs`` is ``torch.zeros_like`` when the trainer skipped that forward
  (``force_on_policy_ratio``): not a training log-prob, so such a step is refused;
* ``json.dumps`` writes non-finite floats as ``NaN`` / ``Infinity``, which we read as NaN/inf;
* ``sample_loss_mask`` is the batch's ``sample_mask`` (the rollout's ``loss_multiplier``: 0 for
  a sample truncated past the length limit with overlong filtering, or filtered out): NeMo's loss
  (``ClippedPGLossFn``) multiplies it into the token mask, ``mask = token_mask[:, 1:] *
  sample_mask[:, None]``, and its ``gen_kl_error`` is the k3 estimator
  ``exp(prev - gen) - 1 - (prev - gen)`` averaged over that mask. We apply it the same way (a
  sample with 0 keeps no token), so our ``k3_kl`` of a step is NeMo's ``gen_kl_error``. Each
  record says so in ``mask_rules``; where the line has no ``sample_loss_mask``, or a weight
  other than 0 and 1 (which the token store cannot carry), the rule is recorded as not applied.

Off-policy: sync GRPO recomputes ``prev_logprobs`` with the weights that generated the
rollouts; async GRPO (``grpo.async_grpo``) trains on trajectories up to
``max_trajectory_age_steps`` old. The log does not say which ran.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest import jsonl
from mismatch_probe.ingest.batches import SeqBatch
from mismatch_probe.ingest.records import (
    MaskRule,
    SeqRecord,
    StepRange,
    as_bool_mask,
    check_lengths,
    field_of,
    float_array,
    int_array,
    iter_json_lines,
    masked_record,
    numbered_files,
    short_repr,
)

_STEP_FILE = re.compile(r"train_data_step(\d+)\.jsonl$")
SAMPLE_MASK = "sample_loss_mask"
_APPLIED = (
    "NeMo multiplies sample_loss_mask into the token mask: samples with 0 (truncated or "
    "filtered) are left out, as in NeMo's own gen_kl_error"
)
_MISSING = (
    "the log has no sample_loss_mask: samples NeMo leaves out of its loss and gen_kl_error "
    "(truncated or filtered) may be counted"
)
_WEIGHTED = (
    "sample_loss_mask holds weights other than 0 and 1, which the token store cannot carry: "
    "those samples are counted with weight 1"
)


def step_files(path: Path, steps: StepRange) -> list[tuple[int, Path]]:
    return numbered_files(path, _STEP_FILE, steps, "train_data_step<N>.jsonl file")


def _unwrap(value: Any) -> Any:
    """``[[...]]`` (one sample sliced from the batch) -> ``[...]``; ``[x]`` -> ``x`` for scalars."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        return value[0]
    return value


def read(path: Path, steps: StepRange) -> Iterator[SeqRecord]:
    """Every sample of the chosen steps, one record per line (the reference reader, and where
    the fast one finds something to say)."""
    for step, file in step_files(path, steps):
        yield from read_file_records(file, step)


def read_file_records(file: Path, step: int) -> Iterator[SeqRecord]:
    """One step file's samples. Records are held back only while every one so far has
    all-zero ``prev_logprobs`` (normally just the first), so memory stays one line."""
    held: list[SeqRecord] = []
    trained = False
    for n, obj in iter_json_lines(file):
        record = _record(obj, step, f"{file}:{n}")
        if trained:
            yield record
            continue
        held.append(record)
        if len(record.token_ids) and not _zero(record.train):
            trained = True
            yield from held
            held.clear()
    if any(len(r.token_ids) for r in held):
        raise ProbeError(
            f"{file}: prev_logprobs are all zero (the trainer skipped its forward, "
            "force_on_policy_ratio): no training-side log-prob; exclude it with --steps"
        )
    yield from held  # only samples the sample mask removed: nothing to refuse


def read_batches(path: Path, steps: StepRange) -> Iterator[SeqBatch]:
    """``read`` as one ``SeqBatch`` per step file (``fast_batch``), or the reference reader's
    batches for a file it leaves to it (``jsonl.file_batches``)."""
    yield from jsonl.file_batches(step_files(path, steps), fast_batch, read_file_records)


def fast_batch(file: Path, step: int) -> SeqBatch | None:
    """One step file as one ``SeqBatch`` (the records ``read`` yields for it, the same values),
    parsed in compiled code (``jsonl.read_columns``) or else by pyarrow's JSON reader, in the
    shapes the file's first line has; None where the reference reader must read it (an error
    to report, an unusual shape or type: ``jsonl`` and ``_batch``)."""
    parsed = _compiled(file)
    if parsed is None:
        parsed = _by_pyarrow(file)
    return None if parsed is None else _batch(*parsed, file, step)


Parsed = tuple[
    dict[str, tuple[np.ndarray, np.ndarray]],  # _ARRAYS: (values, offsets)
    "np.ndarray | None",  # input_lengths of each row, None where the file has none
    "np.ndarray | None",  # sample_loss_mask of each row, None where the file has none
    list[str | None],  # each row's key (idx)
]


def _compiled(file: Path) -> Parsed | None:
    """The file by the compiled reader, in the kinds and wraps of its first line
    (``_fields``); None where it leaves the file to pyarrow's reader."""
    first = jsonl.first_object(file) if jsonl.COMPILED else None
    fields = _fields(first) if first is not None else None
    columns = jsonl.read_columns(file, fields) if fields is not None else None
    if columns is None:
        return None
    per_row = {n: columns[n][0] if n in columns else None for n in _SHAPED}
    idx = per_row["idx"]
    rows = len(columns["token_ids"][1]) - 1  # type: ignore[arg-type]
    keys: list[str | None] = [None] * rows if idx is None else [f"idx {v}" for v in idx.tolist()]
    arrays = {n: columns[n] for n in _ARRAYS}
    return arrays, per_row["input_lengths"], per_row[SAMPLE_MASK], keys  # type: ignore[return-value]


def _fields(first: dict[str, Any]) -> dict[str, tuple[str, int]] | None:
    """``_schema`` for the compiled reader: each field's kind and wrap; None where it cannot
    read the first line's shapes (an ``idx`` string)."""
    fields = {}
    for name, kind in _ARRAYS_COMPILED.items():
        value = first.get(name)
        if not isinstance(value, list):
            return None
        fields[name] = (kind, 1 if len(value) == 1 and isinstance(value[0], list) else 0)
    optional = (("input_lengths", "int", 1), (SAMPLE_MASK, "float", 2), ("idx", "int", 0))
    for name, kind, depth in optional:
        if name not in first:
            fields[name] = ("absent", 0)
            continue
        value, wrap = first[name], 0
        while isinstance(value, list) and len(value) == 1 and wrap < depth:
            value, wrap = value[0], wrap + 1
        if isinstance(value, bool) or not isinstance(value, int if kind == "int" else (int, float)):
            return None
        fields[name] = (kind, wrap)
    return fields


def _by_pyarrow(file: Path) -> Parsed | None:
    """The file by pyarrow's JSON reader (``_schema``); None where the reference reader must
    read it."""
    table = jsonl.read_table_shaped(file, _schema, _SHAPED)
    if table is None or not table.num_rows:
        return None
    arrays = {}
    for name in _ARRAYS:
        column = _unwrapped(table.column(name))
        flat = jsonl.flat_list(column) if column is not None else None
        if flat is None:
            return None
        arrays[name] = flat
    per_row = {n: _per_row(table, n) if n in table.column_names else None for n in _SHAPED[:2]}
    if any(v is None for n, v in per_row.items() if n in table.column_names):
        return None
    return arrays, per_row["input_lengths"], per_row[SAMPLE_MASK], _keys(table, table.num_rows)


_ARRAYS = {"token_ids": pa.int64(), "token_loss_mask": pa.float64(),
           "generation_logprobs": pa.float64(), "prev_logprobs": pa.float64()}  # fmt: skip
_SHAPED = ("input_lengths", SAMPLE_MASK, "idx")  # optional, each a number or one-element lists
_ARRAYS_COMPILED = {"token_ids": "int_list", "token_loss_mask": "float_list",
                    "generation_logprobs": "float_list", "prev_logprobs": "float_list"}  # fmt: skip


def _schema(first: dict[str, Any]) -> pa.Schema | None:
    """The fast reader's schema for a file whose first line is ``first``: each array as it
    comes there (a list, or the logger's one-element list of it), the optional fields in the
    shapes ``_record`` reads; None for any other shape (the reference reader decides)."""
    fields = []
    for name, kind in _ARRAYS.items():
        value = first.get(name)
        if not isinstance(value, list):
            return None
        nested = len(value) == 1 and isinstance(value[0], list)
        fields.append((name, pa.list_(pa.list_(kind)) if nested else pa.list_(kind)))
    for name, kind, depth in (("input_lengths", pa.int64(), 1), (SAMPLE_MASK, pa.float64(), 2)):
        if name in first:
            shape = _scalar_shape(first[name], depth, kind)
            if shape is None:
                return None
            fields.append((name, shape))
    if "idx" in first:
        idx = first["idx"]
        if isinstance(idx, bool) or not isinstance(idx, (int, str)):
            return None
        fields.append(("idx", pa.int64() if isinstance(idx, int) else pa.string()))
    return pa.schema(fields)


def _scalar_shape(value: Any, depth: int, kind: pa.DataType) -> pa.DataType | None:
    """The type of a number, or of it in up to ``depth`` one-element lists; None otherwise."""
    shape = kind
    while isinstance(value, list) and len(value) == 1 and depth > 0:
        value, shape, depth = value[0], pa.list_(shape), depth - 1
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return shape if number and (kind == pa.float64() or isinstance(value, int)) else None


def _only_items(array: pa.Array) -> pa.Array | None:
    """A list array of one-element lists -> their elements, one per row; None where a row is
    null or its list has another length."""
    if array.null_count or not np.all(np.diff(array.offsets.to_numpy()) == 1):
        return None
    return array.flatten()


def _unwrapped(column: pa.ChunkedArray) -> pa.ChunkedArray | None:
    """Each row's one-element list of a list -> the list (``_unwrap``); a list column as it is.
    None where a row is null or its outer list has another length."""
    if not pa.types.is_list(column.type.value_type):
        return column
    inner = _only_items(column.combine_chunks())
    return None if inner is None else pa.chunked_array([inner])


def _per_row(table: pa.Table, name: str) -> np.ndarray | None:
    """``[rows]`` the number each row holds (inside its one-element lists); None where a row
    holds none (null, a list of another length)."""
    array: pa.Array | None = table.column(name).combine_chunks()
    while array is not None and pa.types.is_list(array.type):
        array = _only_items(array)
    if array is None or array.null_count:
        return None
    return array.to_numpy(zero_copy_only=False)


def _batch(
    cols: dict[str, tuple[np.ndarray, np.ndarray]],
    lengths: np.ndarray | None,
    weights: np.ndarray | None,
    keys: list[str | None],
    file: Path,
    step: int,
) -> SeqBatch | None:
    """``_record`` on every row at once (the flat ``_ARRAYS``, each row's ``input_lengths`` and
    ``sample_loss_mask`` where the file has them), and the all-zero ``prev_logprobs`` refusal
    of ``read_file_records``; None wherever either would raise (the reference reader then names
    the line) or a value comes in a form only it reads."""
    offsets = cols["token_ids"][1]
    if any(not np.array_equal(c[1], offsets) for c in cols.values()):
        return None
    tokens, mask_values, rollout, train = (cols[n][0] for n in _ARRAYS)
    if tokens.dtype.kind != "i" or np.any((tokens > 2**53) | (tokens < -(2**53))):
        return None  # int_array reads ids through float64: exact only up to 2^53
    if not np.isin(mask_values, (0.0, 1.0)).all():
        return None
    n = np.diff(offsets)
    lengths = n if lengths is None else lengths
    if not np.all((lengths > 0) & (lengths <= n)):
        return None
    index = np.arange(len(tokens)) - np.repeat(offsets[:-1], n)  # each entry's index in its row
    mask = (mask_values == 1.0) & (index < np.repeat(lengths, n)) & (index > 0)
    running = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    trained = running[offsets[1:]] - running[offsets[:-1]]  # [rows] trained tokens of each
    sampled = _sample_rules(weights, trained)
    if sampled is None:
        return None
    rules, removed = sampled
    mask &= ~np.repeat(removed, n)
    kept = jsonl.masked(mask, offsets, empty_ok=removed)
    if kept is None:
        return None
    keep, counts, positions = kept
    if len(keep) and not np.any(train[keep] != 0.0):
        return None  # the trainer skipped its forward: the reference reader refuses the file
    return SeqBatch(
        step=step,
        sources=[f"{file}:{i}" for i in range(1, len(n) + 1)],
        prompt_keys=keys,
        lengths=counts,
        token_ids=tokens[keep].astype(np.int64),
        positions=positions,
        rollout=np.asarray(rollout, np.float64)[keep],
        train=np.asarray(train, np.float64)[keep],
        mask_rules=rules,
    )


def _sample_rules(
    weights: np.ndarray | None, trained: np.ndarray
) -> tuple[list[tuple[MaskRule, ...]], np.ndarray] | None:
    """``_sample_mask`` of every row (``weights``: each row's ``sample_loss_mask``, None where
    the file has none; ``trained``: ``[rows]`` its trained tokens): the rules and ``[rows]``
    whether the mask removes the row; None where ``_sample_mask`` would raise."""
    rows = len(trained)
    if weights is None:
        return [(MaskRule(SAMPLE_MASK, False, _MISSING, int(t)),) for t in trained], np.zeros(
            rows, bool
        )
    if not np.all((weights >= 0.0) & (weights <= 1.0)):  # NaN fails too
        return None
    rules: list[tuple[MaskRule, ...]] = [
        (MaskRule(SAMPLE_MASK, True, _APPLIED, int(t) if w == 0.0 else 0),)
        if w in (0.0, 1.0)
        else (MaskRule(SAMPLE_MASK, False, _WEIGHTED, int(t)),)
        for w, t in zip(weights.tolist(), trained.tolist(), strict=True)
    ]
    return rules, weights == 0.0


def _keys(table: pa.Table, rows: int) -> list[str | None]:
    """Each row's ``idx`` as ``_record`` names it (None where absent)."""
    if "idx" not in table.column_names:
        return [None] * rows
    return [None if v is None else f"idx {v}" for v in table.column("idx").to_pylist()]


def _zero(train: np.ndarray | None) -> bool:
    return train is not None and bool(np.all(train == 0.0))


def _record(obj: dict[str, Any], step: int, where: str) -> SeqRecord:
    arrays = {
        "token_ids": _unwrap(field_of(obj, "token_ids", where)),
        "token_loss_mask": _unwrap(field_of(obj, "token_loss_mask", where)),
        "generation_logprobs": _unwrap(field_of(obj, "generation_logprobs", where)),
        "prev_logprobs": _unwrap(field_of(obj, "prev_logprobs", where)),
    }
    tokens = int_array(arrays["token_ids"], "token_ids", where)
    mask = float_array(arrays["token_loss_mask"], "token_loss_mask", where)
    rollout = float_array(arrays["generation_logprobs"], "generation_logprobs", where)
    train = float_array(arrays["prev_logprobs"], "prev_logprobs", where)
    n = check_lengths(
        where,
        token_ids=tokens,
        token_loss_mask=mask,
        generation_logprobs=rollout,
        prev_logprobs=train,
    )
    length = _input_length(obj, n, where)
    mask = as_bool_mask(mask, "token_loss_mask", where)
    mask[length:] = False
    mask[:1] = False  # index 0 has no log-prob
    rule, removed = _sample_mask(obj, int(mask.sum()), where)
    key = None if obj.get("idx") is None else f"idx {obj['idx']}"
    if removed:
        mask[:] = False
    return masked_record(step, where, key, tokens, mask, rollout, train, mask_rules=(rule,),
                         empty_ok=removed)  # fmt: skip


def _sample_mask(obj: dict[str, Any], tokens: int, where: str) -> tuple[MaskRule, bool]:
    """``sample_loss_mask`` as NeMo applies it (see the module docstring): the rule as this
    sample of ``tokens`` trained tokens met it, and whether it removes the sample."""
    value = _unwrap(obj.get(SAMPLE_MASK))
    value = value[0] if isinstance(value, list) and len(value) == 1 else value
    if value is None:
        return MaskRule(SAMPLE_MASK, False, _MISSING, tokens), False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ProbeError(f"{where}: {SAMPLE_MASK} {short_repr(value)} is not a number")
    if value == 0:
        return MaskRule(SAMPLE_MASK, True, _APPLIED, tokens), True
    if value == 1:
        return MaskRule(SAMPLE_MASK, True, _APPLIED, 0), False
    if not 0 < value < 1:
        raise ProbeError(f"{where}: {SAMPLE_MASK} {short_repr(value)} is not within 0..1")
    return MaskRule(SAMPLE_MASK, False, _WEIGHTED, tokens), False


def _input_length(obj: dict[str, Any], n: int, where: str) -> int:
    value = obj.get("input_lengths")
    value = value[0] if isinstance(value, list) and len(value) == 1 else value
    if value is None:
        return n
    if not isinstance(value, int) or not 0 < value <= n:
        raise ProbeError(f"{where}: input_lengths {value!r} is not a length within 1..{n}")
    return value


def off_policy(path: Path) -> dict[str, Any]:
    return {
        "max_off_policy_steps": None,
        "source": "not in train_data_step*.jsonl: sync GRPO is on-policy, async GRPO trains on "
        "trajectories up to grpo.async_grpo.max_trajectory_age_steps old",
        "staleness": None,
    }
