"""Stream ``SeqRecord`` s into a run's ``tokens.parquet`` and ``sequences.parquet``.

Records are buffered until ``store.ROW_GROUP_TOKENS`` tokens or a new step, then written as one
row group: a row group never splits a sequence and never mixes steps, so the ``step`` column's
footer statistics locate each step exactly (``store.step_row_groups``). Memory is one row group.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.records import SeqRecord, turns_from_positions

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
    """``add`` records (steps ascending), then ``close``; see the module docstring."""

    def __init__(
        self,
        out: Path,
        run: dict[str, Any],
        tokenizer: Any = None,
        first_seq: int = 0,
        first_prompt: int = 0,
    ) -> None:
        """``first_seq``/``first_prompt``: the first ids to give (``probe watch`` writes one
        store per step, its ids following the earlier steps')."""
        self.tokenizer = tokenizer
        meta = {store.META_KEY: json.dumps(run, sort_keys=True, default=str),
                store.VERSION_KEY: store.SCHEMA_VERSION}  # fmt: skip
        self.token_schema = token_schema(tokenizer is not None).with_metadata(meta)
        self.tokens = pq.ParquetWriter(
            out / store.TOKENS_FILE, self.token_schema, compression="zstd"
        )
        self.seqs = pq.ParquetWriter(
            out / store.SEQUENCES_FILE, SEQUENCE_SCHEMA.with_metadata(meta), compression="zstd"
        )
        self.buffer: list[tuple[SeqRecord, int, int, int]] = []
        self.buffered = 0
        self.prompts: dict[str, int] = {}  # this step's group keys -> prompt_id
        self.samples: dict[int, int] = {}  # this step's prompt_id -> responses so far
        self.next_prompt = first_prompt
        self.counts = Counts()
        self.first_seq = first_seq
        self.empty_steps: set[int] = set()  # steps with an empty record

    def add(self, record: SeqRecord) -> None:
        for rule in record.mask_rules:
            seen = self.counts.rules.setdefault((rule.rule, rule.applied, rule.detail), [0, 0])
            seen[0] += int(rule.tokens > 0)
            seen[1] += rule.tokens
        if len(record.token_ids) == 0:
            self.counts.empty_sequences += 1
            self.empty_steps.add(record.step)
            return
        steps = self.counts.steps
        if steps and record.step != steps[-1]:
            if record.step < steps[-1]:
                raise AssertionError("readers yield steps in ascending order")
            self.flush()
            self.prompts.clear()
            self.samples.clear()
        if not steps or record.step != steps[-1]:
            steps.append(record.step)
        _check_int32(record)
        prompt_id = self._prompt_id(record)
        sample_id = self.samples.get(prompt_id, 0)
        self.samples[prompt_id] = sample_id + 1
        self.buffer.append((record, self.first_seq + self.counts.sequences, prompt_id, sample_id))
        self.counts.sequences += 1
        self.buffered += len(record.token_ids)
        if self.buffered >= store.ROW_GROUP_TOKENS:
            self.flush()

    def _prompt_id(self, record: SeqRecord) -> int:
        """A new id per (step, key); a keyless record is a prompt of its own."""
        key = record.prompt_key
        if key is not None and key in self.prompts:
            return self.prompts[key]
        prompt_id, self.next_prompt = self.next_prompt, self.next_prompt + 1
        if key is not None:
            self.prompts[key] = prompt_id
        return prompt_id

    def flush(self) -> None:
        if not self.buffer:
            return
        recs = [r for r, *_ in self.buffer]
        turns = [turns_from_positions(r.positions) if r.turn is None else r.turn for r in recs]
        lengths = np.array([len(r.token_ids) for r in recs], dtype=np.int64)
        per_seq = lambda i, dtype: np.repeat(  # noqa: E731
            np.array([b[i] for b in self.buffer], dtype=dtype), lengths
        )
        token_ids = np.concatenate([r.token_ids for r in recs]).astype(np.int32)
        rollout = np.concatenate([r.rollout for r in recs])
        train = np.concatenate([r.train for r in recs if r.train is not None])
        columns: dict[str, Any] = {
            "step": np.repeat(np.array([r.step for r in recs], np.int64), lengths),
            "seq_id": per_seq(1, np.int64),
            "prompt_id": per_seq(2, np.int64),
            "sample_id": per_seq(3, np.int32),
            "position": np.concatenate([r.positions for r in recs]).astype(np.int32),
            "token_id": token_ids,
            "rollout_logprob": _nullable(rollout),
            "train_logprob": _nullable(train),
            "train_entropy": pa.nulls(len(token_ids), pa.float32()),
            "turn": np.concatenate(turns).astype(np.int32),
        }
        if self.tokenizer is not None:
            from mismatch_probe.prompts import decode_tokens

            columns["token_text"] = decode_tokens(self.tokenizer, token_ids)
        self.tokens.write_table(pa.table(columns, schema=self.token_schema))
        num_turns = [int(t.max()) + 1 for t in turns]
        self.seqs.write_table(self._sequence_table(recs, lengths, num_turns))
        self.counts.tokens += len(token_ids)
        self.counts.null_logprobs += int((~np.isfinite(rollout) | ~np.isfinite(train)).sum())
        self.buffer, self.buffered = [], 0

    def _sequence_table(
        self, recs: list[SeqRecord], lengths: np.ndarray, num_turns: list[int]
    ) -> pa.Table:
        return pa.table(
            {
                "step": [r.step for r in recs],
                "seq_id": [b[1] for b in self.buffer],
                "prompt_id": [b[2] for b in self.buffer],
                "sample_id": [b[3] for b in self.buffer],
                "prompt_key": [r.prompt_key for r in recs],
                "source": [r.source for r in recs],
                "response_length": lengths.astype(np.int32),
                "num_turns": num_turns,
            },
            schema=self.seqs.schema,
        )

    def close(self) -> Counts:
        self.flush()
        self.counts.steps_without_tokens = sorted(self.empty_steps - set(self.counts.steps))
        self.tokens.close()
        self.seqs.close()
        return self.counts


def _check_int32(record: SeqRecord) -> None:
    """Token ids and positions fit the store's int32 columns; else one line naming the record."""
    for name, values in (("token id", record.token_ids), ("position", record.positions)):
        values = np.asarray(values)
        outside = (values < 0) | (values > INT32_MAX)
        if outside.any():
            raise ProbeError(
                f"{record.source}: {name} {int(values[outside][0])} is outside "
                f"0..{INT32_MAX} (the store holds int32; a cast would store another number)"
            )


def _nullable(values: np.ndarray) -> pa.Array:
    """float32, null where not finite (a framework's null/NaN/inf: not a measured token)."""
    values = np.asarray(values, dtype=np.float64)
    bound = float(np.finfo(np.float32).max)
    with np.errstate(invalid="ignore"):
        narrow = np.clip(values, -bound, bound).astype(np.float32)
    return pa.array(narrow, pa.float32(), mask=~np.isfinite(values))
