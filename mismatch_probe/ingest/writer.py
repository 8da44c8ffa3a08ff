"""Stream responses (``batches.SeqBatch`` es, or ``SeqRecord`` s one at a time) into a run's
``tokens.parquet`` and ``sequences.parquet``, column by column (no Python object per token).

Responses are buffered until ``store.ROW_GROUP_TOKENS`` tokens or a new step, then written as one
row group (a batch is cut where its responses, added one by one, would have closed one): a
row group never splits a sequence and never mixes steps, so the ``step`` column's footer
statistics locate each step exactly (``store.step_row_groups``). Memory is one row group.

The token store is the scan's schema (``store.TOKEN_SCHEMA``) with a ``step`` column and
without ``setting`` and ``support_flip`` (an ingested run has one source and no flip flags);
``token_text`` only when a tokenizer is given; ``train_entropy`` is null (logs hold
log-probabilities, not logits); ``turn`` from a format's explicit turn ids, else from the runs
of consecutive trained positions (``records.turns_from_positions``), and the sequences'
``num_turns``. Log-probs the framework left non-finite are
nulls, which the metric engine reads as padding. Token ids and positions outside int32's
``0..2**31-1`` are refused (a cast would store another number). Ids: ``seq_id`` counts
sequences over the run; ``prompt_id`` numbers the framework's group keys in order of appearance
(a sequence without a key is its own prompt); ``sample_id`` is the response's index within its
prompt and step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.batches import SeqBatch, batch_of, segment_turns
from mismatch_probe.ingest.records import SeqRecord
from mismatch_probe.store.arrays import arrow_of, arrow_strings

INT32_MAX = int(np.iinfo(np.int32).max)
_FIELDS = {f.name: f for f in store.TOKEN_SCHEMA}


def token_schema(with_text: bool) -> pa.Schema:
    names = ["seq_id", "prompt_id", "sample_id", "position", "token_id"]
    names += ["token_text"] if with_text else []
    fields = [pa.field("step", pa.int64(), nullable=False)]
    fields += [_FIELDS[n] for n in names]
    fields += [pa.field(n, pa.float32()) for n in ("rollout_logprob", "train_logprob")]
    return pa.schema([*fields, store.ENTROPY_FIELD, store.TURN_FIELD])  # entropy: null


SEQUENCE_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("seq_id", pa.int64(), nullable=False),
        pa.field("prompt_id", pa.int64(), nullable=False),
        pa.field("sample_id", pa.int32(), nullable=False),
        pa.field("prompt_key", pa.string()),  # the framework's group key
        pa.field("source", pa.string(), nullable=False),  # file and line / row
        pa.field("response_length", pa.int32(), nullable=False),  # trained tokens
        pa.field("num_turns", pa.int32()),  # runs of trained tokens (or explicit turn ids)
    ]
)


@dataclass
class Counts:
    steps: list[int] = field(default_factory=list)
    sequences: int = 0
    tokens: int = 0
    null_logprobs: int = 0  # tokens with a non-finite log-prob on either side (not counted)
    empty_sequences: int = 0  # sequences with no trained token (e.g. slime's removed samples)
    steps_without_tokens: list[int] = field(default_factory=list)  # read, but nothing trained
    # (rule, applied, detail) -> [sequences it touched, tokens]: see ``mask_rules``
    rules: dict[tuple[str, bool, str], list[int]] = field(default_factory=dict)

    def mask_rules(self) -> list[dict[str, Any]]:
        """``run.json``'s ``mask_rules``: one entry per rule and outcome, ``{"rule", "applied",
        "detail", "sequences", "tokens"}``; ``sequences`` counts the records whose tokens the
        rule removed (applied) or would have changed (not applied), ``tokens`` sums them."""
        return [
            {"rule": rule, "applied": applied, "detail": detail, "sequences": n, "tokens": t}
            for (rule, applied, detail), (n, t) in self.rules.items()
        ]


class RunStoreWriter:
    """``add_batch`` (or ``add``) responses, steps ascending, then ``close``; see the module
    docstring. A batch is written in the row groups the records it holds would have been
    written in one by one: a row group closes once it holds ``store.ROW_GROUP_TOKENS`` tokens
    or before a new step."""

    def __init__(
        self,
        out: Path,
        run: dict[str, Any],
        tokenizer: Any = None,
        first_seq: int = 0,
        first_prompt: int = 0,
        on_table: Callable[[pa.Table], None] | None = None,
    ) -> None:
        """``first_seq``/``first_prompt``: the first ids to give (``probe watch`` writes one
        store per step, its ids following the earlier steps'); ``on_table`` is handed each
        row group of the token store once written (``probe ingest`` measures them as they
        come: ``store.written_sequence_batches``)."""
        self.tokenizer = tokenizer
        self.on_table = on_table
        meta = {store.META_KEY: json.dumps(run, sort_keys=True, default=str),
                store.VERSION_KEY: store.SCHEMA_VERSION}  # fmt: skip
        self.token_schema = token_schema(tokenizer is not None).with_metadata(meta)
        seq_schema = SEQUENCE_SCHEMA.with_metadata(meta)
        self.tokens = pq.ParquetWriter(
            out / store.TOKENS_FILE, self.token_schema, **store.parquet_options(self.token_schema)
        )
        try:
            self.seqs = pq.ParquetWriter(
                out / store.SEQUENCES_FILE, seq_schema, **store.parquet_options(seq_schema)
            )
        except BaseException:
            self.tokens.close()
            raise
        self.buffer: list[_Piece] = []
        self.buffered = 0
        self.prompts: dict[str, int] = {}  # this step's group keys -> prompt_id
        self.samples: dict[int, int] = {}  # this step's prompt_id -> responses so far
        self.next_prompt = first_prompt
        self.counts = Counts()
        self.first_seq = first_seq
        self.empty_steps: set[int] = set()  # steps with an empty record

    def add(self, record: SeqRecord) -> None:
        self.add_batch(batch_of([record]))

    def add_batch(self, batch: SeqBatch) -> None:
        """Add the responses of one step (see ``SeqBatch``)."""
        self._count_rules(batch)
        keep = np.flatnonzero(batch.lengths > 0)
        if len(keep) < batch.num_seqs:
            self.counts.empty_sequences += batch.num_seqs - len(keep)
            self.empty_steps.add(batch.step)
        if not len(keep):
            return
        self._start_step(batch.step)
        _check_int32(batch)
        ids = self._ids(batch, keep)
        lengths = batch.lengths[keep]
        first = self.first_seq + self.counts.sequences
        self.counts.sequences += len(keep)
        done = 0  # responses placed; a row group closes after the one that fills it
        while done < len(keep):
            filled = np.cumsum(lengths[done:])
            reach = int(np.searchsorted(filled, store.ROW_GROUP_TOKENS - self.buffered))
            stop = min(done + reach + 1, len(keep))
            self.buffer.append(_Piece(batch, keep[done:stop], first + done, ids[:, done:stop]))
            self.buffered += int(filled[stop - done - 1])
            done = stop
            if self.buffered >= store.ROW_GROUP_TOKENS:
                self.flush()

    def _count_rules(self, batch: SeqBatch) -> None:
        for rules in batch.mask_rules:
            for rule in rules:
                key = (rule.rule, rule.applied, rule.detail)
                seen = self.counts.rules.setdefault(key, [0, 0])
                seen[0] += int(rule.tokens > 0)
                seen[1] += rule.tokens

    def _start_step(self, step: int) -> None:
        steps = self.counts.steps
        if steps and step != steps[-1]:
            if step < steps[-1]:
                raise AssertionError("readers yield steps in ascending order")
            self.flush()
            self.prompts.clear()
            self.samples.clear()
        if not steps or step != steps[-1]:
            steps.append(step)

    def _ids(self, batch: SeqBatch, keep: np.ndarray) -> np.ndarray:
        """``[2, S']`` prompt_id and sample_id of the kept responses: a new prompt id per
        (step, key), a keyless response a prompt of its own; samples counted per prompt."""
        out = np.zeros((2, len(keep)), dtype=np.int64)
        keys = batch.prompt_keys
        for j, i in enumerate(keep.tolist()):
            key = keys[i]
            prompt = self.prompts.get(key) if key is not None else None
            if prompt is None:
                prompt, self.next_prompt = self.next_prompt, self.next_prompt + 1
                if key is not None:
                    self.prompts[key] = prompt
            sample = self.samples.get(prompt, 0)
            self.samples[prompt] = sample + 1
            out[0, j], out[1, j] = prompt, sample
        return out

    def flush(self) -> None:
        if not self.buffer:
            return
        # Taken first: whatever fails below, close() finds nothing to write again.
        pieces, self.buffer, self.buffered = self.buffer, [], 0
        parts = [p.columns() for p in pieces]
        cat = parts[0] if len(parts) == 1 else _concatenated(parts)
        lengths = cat["lengths"]
        token_ids = cat["token_id"].astype(np.int32)
        n = len(token_ids)
        rollout, rollout_ok = _nullable(cat["rollout"])
        train, train_ok = _nullable(cat["train"])
        columns: dict[str, pa.Array] = {  # from the arrays' buffers: no pa.array, no pandas
            "step": arrow_of(np.repeat(cat["step"], lengths), pa.int64()),
            "seq_id": arrow_of(np.repeat(cat["seq_id"], lengths), pa.int64()),
            "prompt_id": arrow_of(np.repeat(cat["prompt_id"], lengths), pa.int64()),
            "sample_id": arrow_of(
                np.repeat(cat["sample_id"].astype(np.int32), lengths), pa.int32()
            ),
            "position": arrow_of(cat["position"], pa.int32()),
            "token_id": arrow_of(token_ids, pa.int32()),
            "rollout_logprob": rollout,
            "train_logprob": train,
            "train_entropy": pa.nulls(n, pa.float32()),
            "turn": arrow_of(cat["turn"], pa.int32()),
        }
        if self.tokenizer is not None:
            from mismatch_probe.prompts import decode_tokens

            columns["token_text"] = arrow_strings(decode_tokens(self.tokenizer, token_ids))
        schema = self.token_schema
        table = pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema)
        self.tokens.write_table(table, row_group_size=store.WRITTEN_ROW_GROUP_ROWS)
        self.seqs.write_table(self._sequence_table(cat, pieces))
        self.counts.tokens += n
        self.counts.null_logprobs += n - int(np.count_nonzero(rollout_ok & train_ok))
        if self.on_table is not None:  # last: the row group is written
            self.on_table(table)

    def _sequence_table(self, cat: dict[str, np.ndarray], pieces: list[_Piece]) -> pa.Table:
        first = np.concatenate([[0], np.cumsum(cat["lengths"])[:-1]]).astype(np.int64)
        turns = cat["turn"]
        num_turns = np.maximum.reduceat(turns, first) + 1 if len(turns) else turns
        columns = {
            "step": arrow_of(cat["step"], pa.int64()),
            "seq_id": arrow_of(cat["seq_id"], pa.int64()),
            "prompt_id": arrow_of(cat["prompt_id"], pa.int64()),
            "sample_id": arrow_of(cat["sample_id"], pa.int32()),
            "prompt_key": arrow_strings([k for p in pieces for k in p.prompt_keys()]),
            "source": arrow_strings([s for p in pieces for s in p.sources()]),
            "response_length": arrow_of(cat["lengths"], pa.int32()),
            "num_turns": arrow_of(num_turns, pa.int32()),
        }
        schema = self.seqs.schema
        return pa.Table.from_arrays([columns[n] for n in schema.names], schema=schema)

    def close(self) -> Counts:
        """Write what is buffered and close both files (closed even when that write fails)."""
        try:
            self.flush()
        finally:
            try:
                self.tokens.close()
            finally:
                self.seqs.close()
        self.counts.steps_without_tokens = sorted(self.empty_steps - set(self.counts.steps))
        return self.counts


@dataclass(frozen=True)
class _Piece:
    """Responses ``rows`` (indices into ``batch``) waiting for the next row group, with their
    ``seq_id`` s (from ``first``) and ``[2, k]`` prompt and sample ids."""

    batch: SeqBatch
    rows: np.ndarray
    first: int
    ids: np.ndarray

    def columns(self) -> dict[str, np.ndarray]:
        b, rows = self.batch, self.rows
        off = b.offsets
        lengths = b.lengths[rows]
        lo, hi = int(off[rows[0]]), int(off[rows[-1] + 1])
        if hi - lo == int(lengths.sum()):  # contiguous: slices, no gather
            take: Any = slice(lo, hi)
        else:
            take = np.concatenate([np.arange(off[i], off[i + 1]) for i in rows.tolist()])
        positions = b.positions[take]
        turn = b.turn[take] if b.turn is not None else segment_turns(positions, lengths)
        train = b.train[take] if b.train is not None else np.full(len(positions), np.nan)
        return {
            "lengths": lengths,
            "step": np.full(len(rows), b.step, dtype=np.int64),
            "seq_id": np.arange(self.first, self.first + len(rows), dtype=np.int64),
            "prompt_id": self.ids[0],
            "sample_id": self.ids[1],
            "position": positions,
            "token_id": b.token_ids[take],
            "rollout": np.asarray(b.rollout[take], dtype=np.float64),
            "train": np.asarray(train, dtype=np.float64),
            "turn": turn,
        }

    def prompt_keys(self) -> list[str | None]:
        return [self.batch.prompt_keys[i] for i in self.rows.tolist()]

    def sources(self) -> list[str]:
        return [self.batch.sources[i] for i in self.rows.tolist()]


def _check_int32(batch: SeqBatch) -> None:
    """Token ids and positions fit the store's int32 columns; else one line naming the first
    response (in order) that holds one, token ids checked before positions."""
    bad = {}
    for name, values in (("token id", batch.token_ids), ("position", batch.positions)):
        values = np.asarray(values)
        if not len(values) or (values.min() >= 0 and values.max() <= INT32_MAX):
            continue  # two passes and no mask: the usual case
        outside = (values < 0) | (values > INT32_MAX)
        if outside.any():
            bad[name] = (values, outside)
    if not bad:
        return
    seq_of = np.repeat(np.arange(batch.num_seqs), batch.lengths)
    first = min(int(seq_of[np.argmax(o)]) for _, o in bad.values())
    for name in ("token id", "position"):
        if name not in bad:
            continue
        values, outside = bad[name]
        here = outside & (seq_of == first)
        if here.any():
            raise ProbeError(
                f"{batch.sources[first]}: {name} {int(values[here][0])} is outside "
                f"0..{INT32_MAX} (the store holds int32; a cast would store another number)"
            )


def _nullable(values: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    """float32, null where not finite (a framework's null/NaN/inf: not a measured token), and
    the ``[N]`` bool of the finite values. Values past float32's range are clipped to it (an
    extreme, not an infinity); the clip is skipped where none is."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    bound = float(np.finfo(np.float32).max)
    inside = bool(finite.all()) and (not len(values) or max(-values.min(), values.max()) <= bound)
    if inside:
        narrow = values.astype(np.float32)
    else:
        with np.errstate(invalid="ignore"):
            narrow = np.clip(values, -bound, bound).astype(np.float32)
    return arrow_of(narrow, pa.float32(), valid=finite), finite


def _concatenated(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
