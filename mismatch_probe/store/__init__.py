"""The token store: the Parquet files that are the contract between pipeline stages.

A run directory holds

* ``tokens.parquet``: one row per response token (``TOKEN_SCHEMA``). Rows of one sequence are
  contiguous and in position order, and a row group never splits a sequence when we write it;
  readers still group by ``seq_id`` (``iter_sequence_batches``) so that any Parquet file with the
  required columns works, whoever wrote it.
* ``sequences.parquet``: one row per response (``SEQUENCE_SCHEMA``).
* ``run.json``: the run metadata, also stored in both files' key-value metadata under
  ``mismatch_probe.run``.

A sharded scan writes ``tokens/`` and ``sequences/`` directories of parts instead
(``dataset``: ``tokens/shard=K/part-0.parquet``); every reader here takes a file or such a
directory alike.

Sign convention used by every later stage: ``r = train_logprob - rollout_logprob``.

This module knows nothing about vLLM or transformers; it writes and reads tables.
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.errors import ProbeError
from mismatch_probe.store.arrays import arrow_of, numpy_of
from mismatch_probe.store.dataset import part_files

SCHEMA_VERSION = "1"
META_KEY = b"mismatch_probe.run"
VERSION_KEY = b"mismatch_probe.schema_version"

TOKEN_SCHEMA = pa.schema(
    [
        pa.field("setting", pa.string(), nullable=False),  # e.g. "rollout=bf16 | train=fp32"
        pa.field("seq_id", pa.int64(), nullable=False),  # unique in the file
        pa.field("prompt_id", pa.int64(), nullable=False),  # line index in the prompts file
        pa.field("sample_id", pa.int32(), nullable=False),  # 0..samples_per_prompt-1
        pa.field("position", pa.int32(), nullable=False),  # 0-based in the response
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("token_text", pa.string(), nullable=False),  # decoded alone, for reports
        pa.field("rollout_logprob", pa.float32(), nullable=False),  # engine, sampled token
        pa.field("train_logprob", pa.float32(), nullable=False),  # training forward, same token
        pa.field("support_flip", pa.bool_(), nullable=False),  # top-k/top-p boundary at risk
    ]
)

SEQUENCE_SCHEMA = pa.schema(
    [
        pa.field("setting", pa.string(), nullable=False),
        pa.field("seq_id", pa.int64(), nullable=False),
        pa.field("prompt_id", pa.int64(), nullable=False),
        pa.field("sample_id", pa.int32(), nullable=False),
        pa.field("prompt_text", pa.string(), nullable=False),  # after the chat template
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("prompt_length", pa.int32(), nullable=False),  # tokens
        pa.field("response_length", pa.int32(), nullable=False),  # tokens
        pa.field("finish_reason", pa.string(), nullable=False),  # "stop" | "length" | ...
    ]
)

# Attribution rungs (``probe scan --attribute``, see ``metrics/attribution.py``): nullable float32
# columns of the same tokens scored at points between decode and training. A store without them
# reads as before; ``token_schema`` adds those a table has.
RUNG_FIELDS = (
    pa.field("engine_prefill_logprob", pa.float32()),  # L1: engine prefill, sequences batched
    pa.field("engine_prefill_single_logprob", pa.float32()),  # L2: prefill, one per engine step
    pa.field("train_rollout_dtype_logprob", pa.float32()),  # L3: transformers at rollout dtype
    pa.field("stale_logprob", pa.float32()),  # L5: --stale-model at the training dtype
    pa.field("train_no_replay_logprob", pa.float32()),  # MoE replay setting: own-routes L4
)


# Entropy (nats) of the training-side distribution each token was scored under, from the
# rescorer's logits. Optional: stores written before it, and ingested runs (no logits), lack it.
ENTROPY_FIELD = pa.field("train_entropy", pa.float32())

# The precision setting of each row as typed columns (the ``setting`` string parsed), written by
# scans so that pandas / polars / duckdb filter without parsing; nullable, and absent from stores
# written before them or by ``probe ingest`` (readers never need them).
SETTING_FIELDS = (
    pa.field("rollout_dtype", pa.string()),  # float32 | float16 | bfloat16
    pa.field("kv_cache_dtype", pa.string()),  # auto | fp8 | fp8_e4m3 | fp8_e5m2
    pa.field("quantization", pa.string()),  # none | fp8 (rollout weights)
    pa.field("lm_head_fp32", pa.bool_()),  # the engine's LM head in float32
    pa.field("train_dtype", pa.string()),  # the training forward's dtype
    pa.field("routing_replay", pa.string()),  # none | rollout (MoE routing replay, R3)
)

# Multi-turn trajectories (the multi-turn spec). ``turn``: 0-based index of the generated turn
# of each token (a scan writes it always, 0 for a single-turn response); a store without it
# reads as one turn. In a multi-turn trajectory ``position`` is the token's index in everything
# after the first prompt (given context included), so positions have gaps between turns, as an
# ingested response's masked-out tokens do.
TURN_FIELD = pa.field("turn", pa.int32())
# Sequences: ``num_turns`` and each turn's finish reason (comma-separated, in turn order);
# re-render drift of a multi-turn trajectory (null elsewhere): whether the chat template,
# applied to the final conversation, gives other ids than the trajectory's anywhere, how many
# generated tokens differ or lack an aligned counterpart, and the first difference in context.
SEQUENCE_TURN_FIELDS = (
    pa.field("num_turns", pa.int32()),
    pa.field("turn_finish_reasons", pa.string()),
    pa.field("rerender_differs", pa.bool_()),
    pa.field("rerender_mismatched_tokens", pa.int32()),
    pa.field("rerender_context", pa.string()),
)


# Each sequence's own mismatch (a scan's; null where a token's log-probability is not finite), so
# that "which sequences carry the mismatch" needs no join with the token store: the sum over its
# response tokens of ``k3`` on ``clampB(r)`` (the terms of ``k3_kl``) and of ``r`` itself
# (``r = train_logprob - rollout_logprob``, the log of the sequence's IS ratio).
SEQUENCE_MISMATCH_FIELDS = (
    pa.field("seq_k3_sum", pa.float64()),
    pa.field("seq_log_ratio_sum", pa.float64()),
)


def token_schema(names: Sequence[str]) -> pa.Schema:
    """``TOKEN_SCHEMA`` plus the entropy, rung, turn and setting fields among ``names``."""
    extra = [
        f for f in (ENTROPY_FIELD, *RUNG_FIELDS, TURN_FIELD, *SETTING_FIELDS) if f.name in names
    ]
    return pa.schema([*TOKEN_SCHEMA, *extra])


def sequence_schema(names: Sequence[str]) -> pa.Schema:
    """``SEQUENCE_SCHEMA`` plus the setting fields among ``names``."""
    optional = (*SEQUENCE_MISMATCH_FIELDS, *SEQUENCE_TURN_FIELDS, *SETTING_FIELDS)
    return pa.schema([*SEQUENCE_SCHEMA, *(f for f in optional if f.name in names)])


# What each column holds, in words, stored as each Parquet field's ``description`` metadata
# (``describe_fields``): log-probabilities are natural logs (nats); ``{rollout}`` and
# ``{rescoring}`` are filled from the run's sampling metadata.
FIELD_DESCRIPTIONS: dict[str, str] = {
    "setting": "precision setting, rollout engine | training forward, e.g. "
    "'rollout=bf16,kv=fp8 | train=fp32' (parsed in rollout_dtype ... routing_replay)",
    "seq_id": "response id, unique in the store (each setting has its own range)",
    "prompt_id": "line index of the prompt in the prompts file",
    "sample_id": "sample of the prompt, 0 .. samples_per_prompt - 1",
    "position": "0-based position of the token in the response",
    "token_id": "id of the sampled token",
    "token_text": "the token decoded on its own (for reports)",
    "rollout_logprob": "log-probability of the sampled token reported by the inference engine "
    "(natural log, nats; {rollout})",
    "train_logprob": "log-probability of the same token under the training forward pass "
    "(natural log, nats; {rescoring} logits); r = train_logprob - rollout_logprob",
    "train_entropy": "entropy of the training-side distribution the token was scored under "
    "(nats; null for ingested runs, which hold no logits)",
    "support_flip": "the token sat at the top-k/top-p boundary (it could leave the sampled set)",
    "engine_prefill_logprob": "attribution rung L1: engine prefill, sequences batched (nats)",
    "engine_prefill_single_logprob": "attribution rung L2: engine prefill, one sequence per "
    "engine step (nats)",
    "train_rollout_dtype_logprob": "attribution rung L3: transformers at the rollout dtype (nats)",
    "stale_logprob": "attribution rung L5: --stale-model at the training dtype (nats)",
    "train_no_replay_logprob": "MoE replay setting: the training forward with its own routes "
    "(nats)",
    "rollout_dtype": "dtype of the rollout engine (float32, float16, bfloat16)",
    "kv_cache_dtype": "KV-cache dtype of the rollout engine (auto = the model dtype)",
    "quantization": "weight quantization of the rollout engine (none, fp8)",
    "lm_head_fp32": "the rollout engine's LM head ran in float32",
    "train_dtype": "dtype of the training forward pass",
    "routing_replay": "MoE routing replay in the training forward (none, rollout)",
    "prompt_text": "the prompt as the engine saw it (after the chat template)",
    "response_text": "the sampled response",
    "prompt_length": "prompt length in tokens",
    "response_length": "response length in tokens",
    "finish_reason": "why generation stopped (stop, length, ...)",
    "step": "training step of an ingested run",
    "turn": "0-based index of the generated turn the token belongs to (0 for single-turn)",
    "num_turns": "generated turns of the trajectory (1 for single-turn)",
    "turn_finish_reasons": "each turn's finish reason, comma-separated, in turn order",
    "rerender_differs": "re-rendering the final conversation with the chat template gives other "
    "ids than the trajectory's",
    "rerender_mismatched_tokens": "generated tokens whose re-rendered id differs or has no "
    "aligned counterpart",
    "rerender_context": "the first re-render difference, in context",
    "seq_k3_sum": "the sequence's k3 summed over its response tokens (k3 on clampB(r))",
    "seq_log_ratio_sum": "the sequence's r = train - rollout log-prob summed (log IS ratio)",
}


def describe_fields(schema: pa.Schema, run: dict[str, Any]) -> pa.Schema:
    """``schema`` with a ``description`` on every field ``FIELD_DESCRIPTIONS`` knows, the
    log-prob mode of the run filled in (``run.json`` sampling)."""
    found = run.get("sampling")
    sampling: dict[str, Any] = found if isinstance(found, dict) else {}
    mode = sampling.get("logprobs_mode")
    values = {
        "rollout": sampling.get("rollout_logprobs")
        or (f"{mode} log-probs" if mode else "as given"),
        "rescoring": sampling.get("rescoring") or "see run.json sampling for the",
    }
    fields = []
    for field in schema:
        text = FIELD_DESCRIPTIONS.get(field.name)
        if text is not None:
            meta = dict(field.metadata or {})
            meta[b"description"] = text.format(**values).encode()
            field = field.with_metadata(meta)
        fields.append(field)
    return pa.schema(fields, metadata=schema.metadata)


# The columns a metrics reader needs; any Parquet file with these can be analysed.
METRIC_COLUMNS = ("seq_id", "position", "rollout_logprob", "train_logprob")

# Every file a run directory can hold: the one place their names are written.
TOKENS_FILE = "tokens.parquet"  # the token store (TOKEN_SCHEMA)
SEQUENCES_FILE = "sequences.parquet"  # one row per response (SEQUENCE_SCHEMA)
RUN_FILE = "run.json"  # the run metadata
METRICS_FILE = "metrics.json"  # the reference setting's metrics, curves included
SETTINGS_FILE = "settings.json"  # every setting's flat metrics, least mismatch first
ROUTING_FILE = "routing.parquet"  # MoE: both sides' expert ids (routing/store.py)
TOKENS_DIR = "tokens"  # a sharded scan's parts instead of TOKENS_FILE (``dataset``)
SEQUENCES_DIR = "sequences"  # ... instead of SEQUENCES_FILE
ROUTING_DIR = "routing"  # ... instead of ROUTING_FILE
ROUTING_METRICS_FILE = "routing.json"  # MoE: disagreement and the mismatch split by it
STEPS_FILE = "steps.json"  # an ingested run's metrics per training step
INTEGRITY_FILE = "integrity.json"  # data-integrity findings (metrics spec section 8)
REPORT_FILE = "report.md"
COMPARE_FILE = "compare.md"  # written by ``probe compare`` into its own directory
REFIT_FILE = "refit.json"  # ``probe refit``: the weight audit and the links of a refit
PLOTS_DIR = "plots"

# Rows per row group of the stores probe writes: one batch of the metric engine (a few MB of
# columns), large enough that a batch's fixed cost is small beside its arithmetic.
ROW_GROUP_TOKENS = 262_144


def _is_integer(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t))


def _is_number(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t))


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


# What each known column must hold, checked when a store is opened (readers cast the columns, so
# strings, lists or fractional ids would otherwise fail deep inside a reader): (test, in words).
COLUMN_KINDS: dict[str, tuple[Any, str]] = {
    **{name: (_is_integer, "integers") for name in
       ("seq_id", "prompt_id", "sample_id", "position", "token_id", "turn")},
    **{name: (_is_number, "numbers") for name in
       ("rollout_logprob", "train_logprob", "train_entropy")},
    "support_flip": (pa.types.is_boolean, "booleans"),
    **{name: (_is_text, "text") for name in ("setting", "token_text")},
}  # fmt: skip


def _with_metadata(schema: pa.Schema, run: dict[str, Any]) -> pa.Schema:
    return describe_fields(schema, run).with_metadata(
        {META_KEY: json.dumps(run, sort_keys=True, default=str), VERSION_KEY: SCHEMA_VERSION}
    )


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


@contextmanager
def atomic(path: Path) -> Iterator[Path]:
    """The one way every output file is written: yield a hidden temporary path beside ``path``
    to write to; when the block completes it is renamed to ``path``, otherwise removed. An
    interrupted write never leaves a file that looks complete, and an existing file at ``path``
    stays as it was until the rename."""
    tmp = _tmp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def move_into_place(done: Path, path: Path) -> None:
    """Rename ``done``, a file completely written under a hidden temporary name (a writer's
    own temporary directory), to ``path`` on the same file system: a reader sees the old file
    or the new one, never half of either."""
    os.replace(done, path)


@contextmanager
def atomic_files(folder: Path) -> Iterator[Path]:
    """``atomic`` for several files written by one call (``save_pretrained``): yield a hidden
    temporary directory inside ``folder`` to write them to; when the block completes each is
    renamed to ``folder/<name>`` (other files of ``folder`` are kept), otherwise all are
    removed."""
    tmp = _tmp_path(folder / ".files")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for path in sorted(tmp.iterdir()):
            os.replace(path, folder / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def made_parents(path: Path) -> Iterator[None]:
    """Create the missing parents of ``path`` for the block; when the block fails, remove the
    ones it created (a failed write leaves no empty directory behind)."""
    missing = [p for p in path.parents if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        if missing:
            shutil.rmtree(missing[-1], ignore_errors=True)
        raise


@contextmanager
def atomic_dir(
    path: Path, complete: Callable[[Path], bool], replace: bool = False
) -> Iterator[Path]:
    """``atomic`` for a directory (a converted model): yield a fresh hidden directory beside
    ``path`` (its own for each caller) to fill; when the block completes it becomes ``path``,
    otherwise it is removed. A ``complete`` directory another process published first is kept
    and this one dropped, unless ``replace``; an incomplete one (a damaged cache) is replaced.
    A reader never sees a half-written directory under ``path``, two processes writing at once
    never write into one, and what a killed writer of this host left beside ``path`` is removed
    on the next write."""
    _remove_orphans(path)
    tmp = _fresh_dir(path, "partial")
    try:
        yield tmp
        if replace or not complete(path):
            _publish_dir(tmp, path, complete)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish_dir(tmp: Path, path: Path, complete: Callable[[Path], bool]) -> None:
    """Rename ``tmp`` to ``path``; what was at ``path`` is moved aside first (one rename) and
    removed after. A complete directory published meanwhile by another process wins."""
    aside = _fresh_dir(path, "old")
    try:
        with suppress(FileNotFoundError):
            os.rename(path, aside / path.name)
        try:
            tmp.rename(path)
        except OSError:
            if not complete(path):
                raise  # not another process's finished directory: a real failure
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _fresh_dir(path: Path, kind: str) -> Path:
    """A new hidden directory beside ``path``, this caller's alone, named after this host and
    process (mode from the umask, as a directory made by hand: a shared cache stays readable)."""
    fresh = path.with_name(f".{path.name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")
    fresh.mkdir()
    return fresh


def _remove_orphans(path: Path) -> None:
    """Remove the hidden directories beside ``path`` whose writer, a process of this host, is
    gone (killed mid-write: a whole model's weights each). Other hosts' are left alone."""
    for kind in ("partial", "old"):
        for orphan in path.parent.glob(f".{path.name}.{kind}-{_HOST}-*-*"):
            pid = orphan.name.rsplit("-", 2)[-2]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(orphan, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


_HOST = socket.gethostname().replace("-", "_") or "host"


def writable_dir(path: Path, what: str) -> Path:
    """Create ``path`` (parents too) and prove it can be written, by writing and removing a
    probe file: called before any slow work, so an unwritable output fails at once.

    Raises:
        ProbeError: one line naming ``what`` (e.g. ``--out``) and the reason.
    """
    if path.exists() and not path.is_dir():
        raise ProbeError(f"{what}: {path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        _write_probe(path)
    except OSError as exc:
        raise ProbeError(f"{what}: cannot write to {path} ({os_error_reason(exc)})") from None
    return path


def check_writable(path: Path, what: str) -> Path:
    """What ``writable_dir`` proves, without creating ``path``: it is a writable directory, or
    the nearest of its parents that exists is one (proven by writing and removing a probe file
    there). For the checks that run before anything else, so a failed command leaves nothing.

    Raises:
        ProbeError: one line naming ``what`` and the reason, as ``writable_dir``'s.
    """
    if path.exists() and not path.is_dir():
        raise ProbeError(f"{what}: {path} is a file, not a directory")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
        _write_probe(existing)
    except OSError as exc:
        raise ProbeError(f"{what}: cannot write to {path} ({os_error_reason(exc)})") from None
    return path


def _write_probe(directory: Path) -> None:
    """Prove ``directory`` writable: write and remove an empty probe file (OSError if not)."""
    probe = _tmp_path(directory / ".write-check")
    probe.write_bytes(b"")
    probe.unlink()


def os_error_reason(exc: OSError) -> str:
    """``Read-only file system``, ``Not a directory: a parent is a file``: an OSError in words."""
    reason = exc.strerror or type(exc).__name__
    if isinstance(exc, NotADirectoryError):
        reason += " (a parent of the path is a file)"
    return reason


def parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """How every Parquet file probe writes is encoded: numbers in plain pages (floats
    uncompressed, integers LZ4, token ids zstd), text in dictionary pages, zstd for every other
    leaf.

    * Floats (a log-prob per row, also inside lists) are stored uncompressed: zstd saves a few
      per cent of their size and more than doubles their read time (``make bench
      parquet_floats``).
    * Integers (steps, sequence, prompt and sample ids, positions, turns) come in runs or
      counting up, which LZ4 packs nearly as small as a dictionary would (the token store of
      an ingest within 2%), without hashing every value into one: that hashing was a third
      of writing an ingested store, and dictionary pages with zstd read slower. LZ4_RAW, the
      codec the Parquet format recommends (not the Hadoop-framed LZ4 it deprecates).
    * Token ids (a vocabulary's worth, no runs) are plain and zstd: its entropy coding keeps
      them a third smaller than LZ4 would.
    * Text (settings, sources, prompt keys, token text: few distinct values) gets dictionary
      pages. Flags and lists (ids, expert routes) are zstd without one: Parquet has no
      dictionary for booleans, and ``use_dictionary`` names columns, not a list's leaf."""
    ints = {f.name for f in schema if pa.types.is_integer(f.type)} - {"token_id"}
    plain = {f.name for f in schema if pa.types.is_floating(f.type)} | ints | {"token_id"}
    compression = {
        path: "none" if floats else "lz4_raw" if path in ints else "zstd"
        for path, floats in _leaves(schema)
    }
    return {
        "compression": compression,
        "use_dictionary": [n for n in schema.names if n not in plain],
    }


def _leaves(schema: pa.Schema) -> list[tuple[str, bool]]:
    """Each Parquet leaf column of ``schema`` (``name``, ``name.list.element``, ...: the paths
    a per-column option is keyed by) and whether it holds floats, as pyarrow writes them."""
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_batches([], schema=schema), buffer)  # empty_table: pandas
    layout = pq.ParquetFile(pa.BufferReader(buffer.getvalue())).metadata.schema
    leaves = (layout.column(i) for i in range(len(layout)))
    return [(c.path, c.physical_type in ("FLOAT", "DOUBLE")) for c in leaves]


def write_table(path: Path, table: pa.Table, schema: pa.Schema, run: dict[str, Any]) -> None:
    """Write ``table`` to ``path`` atomically (``atomic``), in row groups that never split a
    sequence."""
    table = table.select(schema.names).cast(_with_metadata(schema, run))
    options = parquet_options(table.schema)
    with atomic(path) as tmp, pq.ParquetWriter(tmp, table.schema, **options) as writer:
        for start, stop in _sequence_aligned_chunks(table, ROW_GROUP_TOKENS):
            writer.write_table(table.slice(start, stop - start))


def _sequence_aligned_chunks(table: pa.Table, target: int) -> Iterator[tuple[int, int]]:
    """Row ranges of about ``target`` rows that end on a ``seq_id`` change."""
    n = table.num_rows
    if n == 0:
        yield 0, 0
        return
    seq = numpy_of(table.column("seq_id"))
    start = 0
    while start < n:
        stop = min(start + target, n)
        while stop < n and seq[stop] == seq[stop - 1]:
            stop += 1
        yield start, stop
        start = stop


def write_bytes(path: Path, data: bytes) -> None:
    """Write a binary file atomically (``atomic``)."""
    with atomic(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path, text: str) -> None:
    """Write a text file atomically (``atomic``)."""
    with atomic(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def mark_done(table_dir: Path, shard: int, info: dict[str, Any]) -> None:
    """Write a sharded table's ``_SUCCESS`` marker of ``shard`` (``dataset``; atomically)."""
    from mismatch_probe.store.dataset import MARKER, shard_dir

    text = json.dumps(info, sort_keys=True, default=str) + "\n"
    write_text(shard_dir(table_dir, shard) / MARKER, text)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (temporary name, then rename); NaN and infinities are refused, so
    no output file can hold them (strict JSON has no such values)."""
    try:
        text = json.dumps(data, indent=2, sort_keys=True, default=str, allow_nan=False)
    except ValueError as exc:
        raise ProbeError(f"refusing to write {path.name}: {exc}") from None
    write_text(path, text + "\n")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def read_json(path: Path) -> Any:
    """A JSON file we wrote, strictly: ``NaN``/``Infinity`` (which strict JSON lacks, and our
    writer refuses) and numbers that overflow to infinity are errors.

    Raises:
        OSError: unreadable file; ValueError: not strict, finite JSON (UnicodeDecodeError and
        JSONDecodeError are ValueErrors).
    """
    data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    if not all_finite(data):
        raise ValueError(f"{path.name} holds a number too large for a float")
    return data


def all_finite(data: Any) -> bool:
    """True when every float in a JSON value (dicts and lists walked) is finite."""
    if isinstance(data, float):
        return math.isfinite(data)
    if isinstance(data, dict):
        return all(all_finite(v) for v in data.values())
    if isinstance(data, list):
        return all(all_finite(v) for v in data)
    return True


def open_parquet(path: Path, required: Sequence[str] = METRIC_COLUMNS) -> pq.ParquetFile:
    """Open a token store, checking it is readable Parquet with the ``required`` columns.

    ``path`` may be a directory of parts (``dataset.part_files``): every part is checked, and
    the first one is returned (its schema is the store's: use it for column names and metadata).
    """
    opened = [_open_part(p, required) for p in part_files(path)]
    return opened[0]


def _open_part(path: Path, required: Sequence[str]) -> pq.ParquetFile:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ProbeError(f"{path} is not a readable Parquet file ({exc})") from None
    missing = [c for c in required if c not in pf.schema_arrow.names]
    if missing:
        raise ProbeError(f"{path} lacks the column(s) {', '.join(missing)}")
    for field in pf.schema_arrow:
        test, kind = COLUMN_KINDS.get(field.name, (None, ""))
        if test is not None and not test(field.type):
            raise ProbeError(f"{path}: column {field.name} holds {field.type}, not {kind}")
    return pf


def resolve_tokens_path(path: Path) -> Path:
    """A run directory, a Parquet file or a directory of parts -> the token store's path: a run
    directory's ``tokens.parquet``, else its sharded ``tokens/`` directory."""
    if not path.is_dir():
        return path
    single, sharded = path / TOKENS_FILE, path / TOKENS_DIR
    if single.exists() or not (sharded.is_dir() or _holds_parts(path)):
        return single
    return sharded if sharded.is_dir() else path


def _holds_parts(path: Path) -> bool:
    """True for a directory that is itself a table (``shard=K`` folders or Parquet parts)."""
    return any(p.name.startswith("shard=") or p.suffix == ".parquet" for p in path.iterdir())


def read_run_metadata(path: Path) -> dict[str, Any]:
    """The run metadata stored in a token store's key-value metadata ({} if none)."""
    meta = open_parquet(path, required=()).schema_arrow.metadata or {}
    return json.loads(meta[META_KEY]) if META_KEY in meta else {}


# Not a stored column: asked of ``iter_sequence_batches``, each row's place in the store, read
# back with ``read_rows`` (the metric pass names its worst tokens' ids without decoding every
# row's). A locator is the part file's index (``part_files`` order) * 2**40 + the row's index in
# that file.
ROW_COLUMN = "__row"
_PART_SHIFT = 40


def iter_sequence_batches(
    path: Path,
    columns: Sequence[str] = METRIC_COLUMNS,
    row_groups: Sequence[int] | None = None,
    parts: Sequence[Path] | None = None,
) -> Iterator[pa.Table]:
    """Yield tables of whole sequences, a row group (or a bounded piece of one) at a time.

    Memory stays bounded whatever the file's row-group size (see ``_chunks``): a chunk is
    yielded once the next one is read and starts with another sequence (so row groups that
    end on whole sequences, as our writers' do, are yielded as they are); a sequence that
    continues into the next chunk is carried over, so every yielded table holds complete
    sequences. Rows of a sequence must be contiguous in the file (our writer guarantees it); a
    sequence that reappears after others is an error, since its statistics could not be
    computed in one pass.

    Yields:
        Tables with ``columns`` (plus ``seq_id``), rows in file order: each sequence's rows
        together, sequences in order of appearance (rows are not re-sorted by position).
        With ``row_groups``, only those row groups are read (see ``step_row_groups``). With
        ``ROW_COLUMN`` among the columns, each row's locator (int64) as that column, the part
        its index in ``parts`` (default ``part_files(path)``, listed once by the caller that
        reads the rows back with ``read_rows``: a part written meanwhile shifts no index).
    """
    cols = list(dict.fromkeys(["seq_id", *columns]))
    locate = ROW_COLUMN in cols
    cols = [c for c in cols if c != ROW_COLUMN]
    files = [_open_part(p, cols) for p in (part_files(path) if parts is None else parts)]
    try:
        if row_groups is not None and len(files) > 1:
            raise ProbeError(f"{path}: row groups (one training step) of a sharded store")
        chunks = (
            chunk
            for part, pf in enumerate(files)
            for chunk in _chunks(pf, cols, row_groups, part if locate else None)
        )
        yield from _whole_sequences(chunks, path)
    except (pa.ArrowException, OSError) as exc:
        raise ProbeError(f"{path} is corrupt ({exc})") from None


WRITTEN_ROW_GROUP_ROWS = 1 << 20  # the most rows a writer's table puts in one row group


def written_sequence_batches(
    tables: Iterable[pa.Table], columns: Sequence[str], path: Path
) -> Iterator[pa.Table]:
    """``iter_sequence_batches(path, columns)`` of a file being written, from the tables its
    writer writes, as they are written: the same tables, cut where reading the file back
    would cut them, so that a pass over these gives the numbers a pass over the file gives. A
    table is written as row groups of at most ``WRITTEN_ROW_GROUP_ROWS`` rows (the writer's
    ``row_group_size``, pyarrow's default), each read back in slices of
    ``2 * ROW_GROUP_TOKENS`` rows (``_chunks``). No ``ROW_COLUMN``: the tables hold every
    column."""
    cols = list(dict.fromkeys(["seq_id", *columns]))
    size = 2 * ROW_GROUP_TOKENS
    chunks = (
        table.select(cols).slice(start, min(size, group + WRITTEN_ROW_GROUP_ROWS - start))
        for table in tables
        for group in range(0, table.num_rows, WRITTEN_ROW_GROUP_ROWS)
        for start in range(group, min(group + WRITTEN_ROW_GROUP_ROWS, table.num_rows), size)
    )
    yield from _whole_sequences(chunks, path)


def _whole_sequences(chunks: Iterable[pa.Table], path: Path) -> Iterator[pa.Table]:
    """The rows of ``chunks`` as tables of whole sequences (``iter_sequence_batches``)."""
    seen: set[int] = set()
    held: pa.Table | None = None  # rows read, not yet yielded: their last sequence may go on
    for group in chunks:
        if group.num_rows == 0:
            continue
        if held is None:
            held = group
            continue
        seq = numpy_of(held.column("seq_id"))
        if seq[-1] != group.column("seq_id")[0].as_py():  # held ends on a whole sequence
            _check_contiguous(seq, seen, path)
            yield held
            held = group
            continue
        tail_start = _last_run_start(seq)  # the last sequence goes on in this group
        if tail_start:
            _check_contiguous(seq[:tail_start], seen, path)
            yield held.slice(0, tail_start)
        held = pa.concat_tables([held.slice(tail_start), group])
    if held is not None:
        _check_contiguous(numpy_of(held.column("seq_id")), seen, path)
        yield held


def _chunks(
    pf: pq.ParquetFile,
    cols: list[str],
    row_groups: Sequence[int] | None = None,
    part: int | None = None,
) -> Iterator[pa.Table]:
    """The file as tables of at most ``2 * ROW_GROUP_TOKENS`` rows (one of our row groups fits
    whole), reading one row group at a time: no read-ahead across groups, and a foreign file's
    huge row group is decoded piece by piece. Its columns are decoded in the calling thread
    (``use_threads=False``): the batches' consumers (the metric pass's workers) already keep
    every core busy, so Arrow's pool would only add threads to wake for every row group."""
    starts = _row_group_starts(pf) if part is not None else []
    for i in range(pf.num_row_groups) if row_groups is None else row_groups:
        batches = pf.iter_batches(
            2 * ROW_GROUP_TOKENS, row_groups=[i], columns=cols, use_threads=False
        )
        row = starts[i] if part is not None else 0
        for batch in batches:
            table = pa.Table.from_batches([batch])
            if part is not None:  # each row's locator: (part << _PART_SHIFT) + its row
                first = (part << _PART_SHIFT) + row
                locators = np.arange(first, first + table.num_rows, dtype=np.int64)
                table = table.append_column(ROW_COLUMN, arrow_of(locators, pa.int64()))
                row += table.num_rows
            yield table


def _row_group_starts(pf: pq.ParquetFile) -> list[int]:
    """The index of each row group's first row in the file."""
    sizes = (pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups))
    return [0, *accumulate(sizes)][: pf.num_row_groups]


def read_rows(parts: Sequence[Path], locators: Sequence[int], column: str) -> list[Any]:
    """The values of ``column`` at the rows ``locators`` name (``ROW_COLUMN`` of
    ``iter_sequence_batches`` over the same ``parts``), reading only the row groups that hold
    them.

    Raises:
        ProbeError: the store is unreadable.
    """
    wanted: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (part, group) -> (locator, row)
    files: dict[int, tuple[pq.ParquetFile, list[int]]] = {}
    for locator in dict.fromkeys(locators):
        part, row = divmod(locator, 1 << _PART_SHIFT)
        if part not in files:
            pf = _open_part(parts[part], [column])
            files[part] = (pf, _row_group_starts(pf))
        starts = files[part][1]
        group = max(i for i, start in enumerate(starts) if start <= row)
        wanted.setdefault((part, group), []).append((locator, row - starts[group]))
    values: dict[int, Any] = {}
    for (part, group), rows in wanted.items():
        try:
            read = files[part][0].read_row_group(group, columns=[column]).column(column)
        except (pa.ArrowException, OSError) as exc:
            raise ProbeError(f"{parts[part]} is corrupt ({exc})") from None
        values.update((locator, read[row].as_py()) for locator, row in rows)
    return [values[locator] for locator in locators]


def clean_int64_column(
    parts: Sequence[Path], column: str, row_groups: Sequence[int] | None = None
) -> bool:
    """True when every part holds ``column`` as integers int64 holds (any integer type but
    uint64) and the footers' statistics show it without nulls in every row group read (False
    where a row group has no statistics for it)."""
    for part in parts:
        pf = _open_part(part, [column])
        kind = pf.schema_arrow.field(column).type
        if not pa.types.is_integer(kind) or kind == pa.uint64():
            return False
        leaf = _leaf(pf, column)
        for i in range(pf.num_row_groups) if row_groups is None else row_groups:
            stats = pf.metadata.row_group(i).column(leaf).statistics
            if stats is None or not stats.has_null_count or stats.null_count:
                return False
    return True


def _leaf(pf: pq.ParquetFile, column: str) -> int:
    """The Parquet leaf column of a top-level ``column`` (its index among the footer's column
    chunks, which counts every leaf of a list or struct before it)."""
    layout = pf.metadata.schema
    return next(i for i in range(len(layout)) if layout.column(i).path == column)


def _last_run_start(seq: Any) -> int:
    """Index where the final run of equal seq_ids begins."""
    change = np.flatnonzero(seq[1:] != seq[:-1])
    return int(change[-1] + 1) if len(change) else 0


def _check_contiguous(seq: Any, seen: set[int], path: Path) -> None:
    """Record the sequences of a batch in ``seen``; fail if one was seen in an earlier run."""
    first = np.ones(len(seq), dtype=bool)
    np.not_equal(seq[1:], seq[:-1], out=first[1:])
    starts = seq[first].tolist()
    if len(set(starts)) != len(starts) or not seen.isdisjoint(starts):
        raise ProbeError(
            f"{path}: the rows of a sequence are not contiguous; sort the file by seq_id"
        )
    seen.update(starts)


# --- training steps (runs made by ``probe ingest``: a ``step`` column) ------------------------

STEP_COLUMN = "step"


def step_ranges(pf: pq.ParquetFile) -> list[tuple[int, int] | None]:
    """``(min, max)`` of the ``step`` column per row group, from the footer statistics (None
    where a row group has none)."""
    index = _leaf(pf, STEP_COLUMN)
    out: list[tuple[int, int] | None] = []
    for i in range(pf.num_row_groups):
        stats = pf.metadata.row_group(i).column(index).statistics
        ok = stats is not None and stats.has_min_max
        out.append((int(stats.min), int(stats.max)) if ok else None)
    return out


def step_source(path: Path, step: int) -> tuple[Path, list[int]]:
    """Where ``step`` is in a token store: the file and its row groups that may hold it. A
    directory of parts (``probe watch`` writes one part per step) gives the one part whose
    footer statistics may hold the step (the first part, no row group, when none does).

    Raises:
        ProbeError: several parts may hold the step (a sharded store, not read step by step).
    """
    parts = part_files(path)
    if len(parts) == 1:
        return parts[0], step_row_groups(_open_part(parts[0], ()), step)
    found = [(p, groups) for p in parts if (groups := step_row_groups(_open_part(p, ()), step))]
    if len(found) > 1:
        raise ProbeError(f"{path}: row groups (one training step) of a sharded store")
    return found[0] if found else (parts[0], [])


def step_row_groups(pf: pq.ParquetFile, step: int) -> list[int]:
    """The row groups that may hold rows of ``step`` (all of them when statistics are missing)."""
    return [
        i for i, span in enumerate(step_ranges(pf)) if span is None or span[0] <= step <= span[1]
    ]
