"""The training side of a format that logs rollout log-probs only (Miles' dashboard columns):
the same prompt + response tokens through ``mismatch_probe.training.rescore`` with ``--model``.

Records are scored in chunks of about ``CHUNK_BATCHES`` rescoring batches, so memory stays a
chunk whatever the number of steps. The scoring is raw at temperature 1 unless ``--temperature``
says how the rollouts were sampled (the dump does not record sampling parameters). Every token
id of a record (prompt and response) is checked against the model's vocabulary before the
record joins a chunk: an id outside it is one line naming the record, not an ``IndexError``
from inside the forward pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.records import SeqRecord
from mismatch_probe.sampling import FLIP_EPS, SamplingSpec
from mismatch_probe.training import rescore

CHUNK_BATCHES = 8


def rescored(
    records: Iterator[SeqRecord],
    model: Any,
    spec: SamplingSpec,
    train_dtype: str,
    batch_tokens: int,
) -> Iterator[SeqRecord]:
    """``records`` with ``train`` filled in from ``model`` (each needs ``prompt_ids`` and
    ``response_ids``; ``positions`` index ``response_ids``)."""
    chunk: list[SeqRecord] = []
    size = 0
    vocab = vocabulary_size(model)
    for record in records:
        if record.prompt_ids is None or record.response_ids is None:
            raise AssertionError("a record to rescore carries its prompt and response")
        if len(record.prompt_ids) == 0:
            raise ProbeError(f"{record.source}: no prompt token before the response to rescore")
        _check_vocabulary(record, vocab)
        chunk.append(record)
        size += len(record.prompt_ids) + len(record.response_ids)
        if size >= CHUNK_BATCHES * batch_tokens:
            yield from _score(chunk, model, spec, train_dtype, batch_tokens)
            chunk, size = [], 0
    yield from _score(chunk, model, spec, train_dtype, batch_tokens)


def vocabulary_size(model: Any) -> int:
    """The ids the model can score: its input embedding's rows (and its output layer's, when
    it has one of another size)."""
    sizes = [int(model.get_input_embeddings().num_embeddings)]
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "out_features"):
        sizes.append(int(head.out_features))
    return min(sizes)


def _check_vocabulary(record: SeqRecord, vocab: int) -> None:
    for name, ids in (("prompt", record.prompt_ids), ("response", record.response_ids)):
        ids = np.asarray(ids)
        outside = (ids < 0) | (ids >= vocab)
        if outside.any():
            raise ProbeError(
                f"{record.source}: {name} token id {int(ids[outside][0])} is outside the "
                f"vocabulary of --model (ids 0..{vocab - 1}): not the model that generated "
                "these rollouts, or a corrupt dump"
            )


def _score(
    chunk: list[SeqRecord], model: Any, spec: SamplingSpec, dtype: str, batch_tokens: int
) -> Iterator[SeqRecord]:
    if not chunk:
        return
    requests = [
        rescore.ScoreRequest(r.prompt_ids.tolist(), r.response_ids.tolist())  # type: ignore[union-attr]
        for r in chunk
    ]
    scored = rescore.rescore(model, requests, spec, FLIP_EPS[dtype], batch_tokens)
    for record, result in zip(chunk, scored, strict=True):
        record.train = result.logprobs.astype(np.float64)[record.positions]
        record.prompt_ids = record.response_ids = None
        yield record
