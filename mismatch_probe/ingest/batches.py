"""Columnar record batches: many responses of one training step as flat arrays.

A ``SeqBatch`` is what a fast reader yields (the prime-rl JSONL reader parses a whole rank file
in compiled code, ``jsonl.read_columns``, and never builds a Python object per token) and what
the store writer consumes (``RunStoreWriter.add_batch``). It holds the same information as a run
of ``SeqRecord`` s of one step, in order: ``[S]`` per response, ``[T]`` per trained token (the
responses' tokens concatenated, ``lengths`` of them each). A response with no trained token has
length 0 (an empty record: counted, not stored).

``from_records`` turns record readers' output into batches (one step per batch, at most about
``BATCH_TOKENS`` tokens), so every format goes through the same vectorised writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from mismatch_probe.ingest.records import MaskRule, SeqRecord

BATCH_TOKENS = 262_144  # record readers' tokens gathered per batch (a few MB)


@dataclass(frozen=True)
class SeqBatch:
    """Responses of one step, flat. ``S`` responses, ``T = lengths.sum()`` trained tokens.

    Attributes:
        step: the training step of every response.
        sources: ``[S]`` where each came from, for people (``"step_3/rank_0.jsonl:12"``).
        prompt_keys: ``[S]`` the framework's group key of each, or None.
        lengths: ``[S]`` int64 trained tokens of each response.
        token_ids: ``[T]`` int64 trained tokens.
        positions: ``[T]`` int64 position of each in its response.
        rollout: ``[T]`` float64 engine log-probs (NaN where the framework logged none).
        train: ``[T]`` float64 trainer log-probs, or None when the format has none.
        turn: ``[T]`` int64 explicit turn ids, or None (runs of consecutive positions).
        mask_rules: ``[S]`` the mask rules each response met (``()`` for a batch of none).
    """

    step: int
    sources: Sequence[str]
    prompt_keys: Sequence[str | None]
    lengths: np.ndarray
    token_ids: np.ndarray
    positions: np.ndarray
    rollout: np.ndarray
    train: np.ndarray | None
    turn: np.ndarray | None = None
    mask_rules: Sequence[tuple[MaskRule, ...]] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def offsets(self) -> np.ndarray:
        """``[S + 1]`` start of each response's tokens (and the end)."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    def records(self) -> Iterator[SeqRecord]:
        """The batch as ``SeqRecord`` s (the rescoring stage and the old writer take them)."""
        off = self.offsets
        for i in range(self.num_seqs):
            a, b = int(off[i]), int(off[i + 1])
            yield SeqRecord(
                step=self.step,
                source=self.sources[i],
                prompt_key=self.prompt_keys[i],
                token_ids=self.token_ids[a:b],
                positions=self.positions[a:b],
                rollout=self.rollout[a:b],
                train=None if self.train is None else self.train[a:b],
                mask_rules=self.mask_rules[i] if self.mask_rules else (),
                turn=None if self.turn is None else self.turn[a:b],
            )


def _cat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def batch_of(records: Sequence[SeqRecord]) -> SeqBatch:
    """One batch of records of one step (in order)."""
    turns = [r.turn for r in records]
    has_turn = any(t is not None for t in turns)
    trains = [r.train for r in records]
    no_train = all(t is None for t in trains)
    return SeqBatch(
        step=records[0].step,
        sources=[r.source for r in records],
        prompt_keys=[r.prompt_key for r in records],
        lengths=np.array([len(r.token_ids) for r in records], dtype=np.int64),
        token_ids=_cat([np.asarray(r.token_ids) for r in records], np.int64),
        positions=_cat([np.asarray(r.positions) for r in records], np.int64),
        rollout=_cat([np.asarray(r.rollout, np.float64) for r in records], np.float64),
        train=None
        if no_train
        else _cat([np.asarray(t, np.float64) for t in trains if t is not None], np.float64),
        turn=_cat(
            [np.asarray(r.turn) if r.turn is not None else turns_of(r.positions) for r in records],
            np.int64,
        )
        if has_turn
        else None,
        mask_rules=[r.mask_rules for r in records],
    )


def turns_of(positions: np.ndarray) -> np.ndarray:
    from mismatch_probe.ingest.records import turns_from_positions

    return turns_from_positions(np.asarray(positions))


def from_records(records: Iterable[SeqRecord], tokens: int = BATCH_TOKENS) -> Iterator[SeqBatch]:
    """Group a record stream (steps ascending) into batches of one step each, at most about
    ``tokens`` trained tokens (and one record) each."""
    held: list[SeqRecord] = []
    size = 0
    for record in records:
        if held and (record.step != held[0].step or size >= tokens):
            yield batch_of(held)
            held, size = [], 0
        held.append(record)
        size += len(record.token_ids)
    if held:
        yield batch_of(held)


def segment_turns(positions: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[T]`` 0-based turn of each token, per response: runs of consecutive positions
    (``records.turns_from_positions`` on each response, vectorised)."""
    n = len(positions)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    gap = np.zeros(n, dtype=np.int64)
    gap[1:] = np.diff(positions) > 1
    starts = np.cumsum(lengths)[:-1]
    starts = starts[starts < n]
    gap[starts] = 0  # a response's first token starts its turn 0
    csum = np.cumsum(gap)
    first = np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return csum - csum[first]
