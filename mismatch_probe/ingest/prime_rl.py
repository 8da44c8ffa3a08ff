"""prime-rl token exports: ``<output_dir>/token_exports/step_<N>/rank_<R>.jsonl``.

Checked against PrimeIntellect-ai/prime-rl ``src/prime_rl/trainer/rl/token_export.py``
(``SCHEMA_VERSION = 1``) and ``src/prime_rl/trainer/rl/train.py`` at commit 559b447 (2026-08):

* one JSON object per line and sequence: ``schema_version, step, export_step, rank,
  micro_step, micro_sequence_idx, export_sequence_idx, run_id, env_name, token_ids,
  position_ids, loss_mask, advantages, losses, rewards, inference_logprobs,
  trainer_logprobs, entropy, mismatch_kl, ...``; every array has one entry per token of the
  packed sequence, prompt included (``loss_mask`` false there);
* ``trainer_logprobs`` is shifted right in ``train.py`` (``shift_tensor_right``), so entry ``i``
  is the log-prob of ``token_ids[i]``; entry 0 is a pad value (``log(1/V)``);
* non-finite floats are written as ``null`` (``_json_float``);
* the directory is named after ``export_step`` (the run step in multi-run mode, under
  ``<output_dir>/<run_id>/token_exports/``); ``STABLE`` is touched in it once every rank has
  flushed the step (``mark_stable``), and removed when a rank writes to it again.

The off-policy bound is not in the export: ``max_off_policy_steps`` lives in the orchestrator
config (default 8), which the ``rl`` entrypoint writes to ``<output_dir>/configs/rl.json`` /
``orchestrator.json``. We read it from there when present.
"""

from __future__ import annotations

import json
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
    SeqRecord,
    StepRange,
    as_bool_mask,
    check_lengths,
    field_of,
    float_array,
    group_key,
    int_array,
    iter_json_lines,
    masked_record,
    require_dir,
    short_repr,
    unique_steps,
)

SCHEMA_VERSIONS = (1,)
STABLE = "STABLE"
_STEP_DIR = re.compile(r"step_(\d+)$")
_RANK_FILE = re.compile(r"rank_(\d+)\.jsonl$")
_ARRAYS = ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")
_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int64()),
        ("token_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.bool_())),
        ("inference_logprobs", pa.list_(pa.float64())),
        ("trainer_logprobs", pa.list_(pa.float64())),
    ]
)
_OPTIONAL = {"sample_id": (pa.string(), pa.int64())}  # not in schema 1; newer exports
_COLUMNS = {  # jsonl.read_columns: a file without sample_id (where it is: pyarrow's reader)
    "schema_version": "int", "token_ids": "int_list", "loss_mask": "bool_list",
    "inference_logprobs": "float_list", "trainer_logprobs": "float_list", "sample_id": "absent",
}  # fmt: skip
DEFAULT_MAX_OFF_POLICY = 8  # OrchestratorConfig.max_off_policy_steps in the source above


def exports_dir(path: Path) -> Path:
    """``path`` itself when it holds ``step_<N>`` directories, else ``path/token_exports``."""
    require_dir(path, "token_exports/ (the trainer's output dir)")
    if any(_STEP_DIR.match(p.name) for p in path.iterdir()):
        return path
    sub = path / "token_exports"
    if not sub.is_dir():
        raise ProbeError(f"{path}: no token_exports/ directory and no step_<N> directories")
    return sub


def step_dirs(path: Path, steps: StepRange) -> list[tuple[int, Path]]:
    """Stable step directories in ``steps``, in step order.

    A directory without ``STABLE`` after the last stable one is a step still being written
    and is skipped (unless ``--steps`` names it); one before a stable step, or one ``--steps``
    names, is an error: the export of that step is incomplete.
    """
    root = exports_dir(path)
    found = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if p.is_dir() and (m := _STEP_DIR.match(p.name))
    )
    found = unique_steps([(n, p) for n, p in found if n in steps])
    stable = [n for n, p in found if (p / STABLE).exists()]
    for n, p in found:
        if (p / STABLE).exists():
            continue
        if steps.last is not None or (stable and n < stable[-1]):
            raise ProbeError(
                f"{p}: no {STABLE} marker (the step's export is incomplete); "
                "choose other steps with --steps"
            )
    chosen = [(n, p) for n, p in found if (p / STABLE).exists()]
    if not chosen:
        raise ProbeError(f"{root}: no step directory with a {STABLE} marker in the chosen steps")
    return chosen


def rank_files(directory: Path) -> list[Path]:
    """A step directory's ``rank_<R>.jsonl`` files, in rank order."""
    found = ((int(m.group(1)), p) for p in directory.iterdir() if (m := _RANK_FILE.match(p.name)))
    return [p for _, p in sorted(found)]


def step_files(path: Path, steps: StepRange) -> list[tuple[int, Path]]:
    """``(step, rank file)`` of the chosen steps, in step then rank order."""
    return [(step, f) for step, d in step_dirs(path, steps) for f in rank_files(d)]


def read(path: Path, steps: StepRange) -> Iterator[SeqRecord]:
    """Every trained sequence of the chosen steps, rank files in rank order (one record per
    JSON line: the reference reader, and where the fast one finds something to say)."""
    for step, directory in step_dirs(path, steps):
        for file in rank_files(directory):
            yield from read_file_records(file, step)


def read_file_records(file: Path, step: int) -> Iterator[SeqRecord]:
    for number, obj in iter_json_lines(file):
        yield _record(obj, step, f"{file}:{number}")


def read_batches(path: Path, steps: StepRange) -> Iterator[SeqBatch]:
    """``read`` as one ``SeqBatch`` per rank file (``fast_batch``), or the reference reader's
    batches for a file it leaves to it (``jsonl.file_batches``)."""
    yield from jsonl.file_batches(step_files(path, steps), fast_batch, read_file_records)


def fast_batch(file: Path, step: int) -> SeqBatch | None:
    """One rank file of one step as one ``SeqBatch`` (the records ``read`` yields for it, the
    same values), parsed in compiled code (``jsonl.read_columns``) or else by pyarrow's JSON
    reader; None where the reference reader must read it (an error to report, an unusual type,
    no line at all: ``jsonl``)."""
    columns = jsonl.read_columns(file, _COLUMNS)
    if columns is not None:
        version, _ = columns.pop("schema_version")
        lines = len(version)
        return _batch(version, columns, [None] * lines, file, step)  # type: ignore[arg-type]
    table = jsonl.read_table(file, _SCHEMA, optional=_OPTIONAL)
    if table is None or not table.num_rows:
        return None
    versions = table.column("schema_version")
    keys = jsonl.group_keys(table, "sample_id", table.num_rows)
    cols = {n: jsonl.flat_list(table.column(n)) for n in _ARRAYS}
    if versions.null_count or keys is None or any(c is None for c in cols.values()):
        return None
    return _batch(versions.to_numpy(), cols, keys, file, step)  # type: ignore[arg-type]


def _batch(
    version: np.ndarray,
    cols: dict[str, tuple[np.ndarray, np.ndarray]],
    keys: list[str | None],
    file: Path,
    step: int,
) -> SeqBatch | None:
    """The fast path's checks and masks on the flat arrays of ``_ARRAYS`` (values, offsets);
    None where the reference reader must decide."""
    if not np.isin(version, SCHEMA_VERSIONS).all():
        return None
    offsets = cols["token_ids"][1]
    if any(not np.array_equal(c[1], offsets) for c in cols.values()):
        return None  # unequal lengths: the reference reader names the line
    tokens, mask_values = (cols[n][0] for n in ("token_ids", "loss_mask"))
    if tokens.dtype.kind != "i" or mask_values.dtype != np.bool_:
        return None
    if len(tokens) and (tokens.max() > 2**53 or tokens.min() < -(2**53)):
        return None  # int_array reads ids through float64: exact only up to 2^53
    mask = mask_values.copy()
    lengths = np.diff(offsets)
    mask[offsets[:-1][lengths > 0]] = False  # index 0 has no log-prob (a pad value)
    kept = jsonl.masked(mask, offsets)
    if kept is None:
        return None  # a line whose mask selects no token: an error the reference reader names
    keep, counts, positions = kept
    rollout, train = (cols[n][0] for n in ("inference_logprobs", "trainer_logprobs"))
    return SeqBatch(
        step=step,
        sources=[f"{file}:{i}" for i in range(1, len(lengths) + 1)],
        prompt_keys=keys,
        lengths=counts,
        token_ids=tokens[keep].astype(np.int64, copy=False),
        positions=positions,
        rollout=np.asarray(rollout, np.float64)[keep],
        train=np.asarray(train, np.float64)[keep],
    )


def _record(obj: dict[str, Any], step: int, where: str) -> SeqRecord:
    version = obj.get("schema_version")
    if version not in SCHEMA_VERSIONS:
        raise ProbeError(f"{where}: schema_version {version!r} (supported: {SCHEMA_VERSIONS})")
    tokens = int_array(field_of(obj, "token_ids", where), "token_ids", where)
    mask = float_array(field_of(obj, "loss_mask", where), "loss_mask", where)
    rollout = float_array(field_of(obj, "inference_logprobs", where), "inference_logprobs", where)
    train = float_array(field_of(obj, "trainer_logprobs", where), "trainer_logprobs", where)
    check_lengths(
        where, token_ids=tokens, loss_mask=mask, inference_logprobs=rollout, trainer_logprobs=train
    )
    mask = as_bool_mask(mask, "loss_mask", where)
    mask[:1] = False  # index 0 has no log-prob (trainer_logprobs[0] is a pad value)
    key = group_key(obj.get("sample_id"), "sample_id", where)  # not in schema 1; newer exports
    return masked_record(step, where, key, tokens, mask, rollout, train)


def off_policy(path: Path) -> dict[str, Any]:
    """The bound on policy staleness from the run's config files, else the default. A config
    file that does not parse, or a bound that is not a non-negative integer, is one line."""
    root = exports_dir(path).parent
    for name, keys in (("orchestrator.json", ()), ("rl.json", ("orchestrator",))):
        file = root / "configs" / name
        if not file.is_file():
            continue
        try:
            data: Any = json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProbeError(f"{file}: not valid JSON ({exc})") from None
        for key in (*keys, "max_off_policy_steps"):
            data = data.get(key) if isinstance(data, dict) else None
        if data is None:
            continue
        if not isinstance(data, int) or isinstance(data, bool) or data < 0:
            raise ProbeError(
                f"{file}: max_off_policy_steps {short_repr(data)} is not a non-negative integer"
            )
        return {"max_off_policy_steps": data, "source": str(file), "staleness": data > 0}
    return {
        "max_off_policy_steps": None,
        "source": f"not found under {root / 'configs'}; prime-rl's default is "
        f"{DEFAULT_MAX_OFF_POLICY}",
        "staleness": True,
    }
