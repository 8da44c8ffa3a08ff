"""Reading back what ``probe export`` wrote, with each tracker's own reader or format:
TensorBoard's ``EventAccumulator``, a W&B offline run file (``run-<id>.wandb``: the LevelDB log
format wandb writes, each record one of wandb's own ``Record`` protobufs), trackio's
``SQLiteStorage``."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768  # LevelDB log blocks
HEADER = 7  # ":W&B" + 2 magic bytes + 1 version byte at the start of the file


def tensorboard_scalars(logdir: Path) -> tuple[dict[str, dict[int, float]], Any]:
    """``{tag: {step: value}}`` of every scalar, and the accumulator (histograms, text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0,
                                                       "tensors": 0})  # fmt: skip
    acc.Reload()
    tags = acc.Tags()["scalars"]
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags}, acc


def wandb_records(run_file: Path) -> list[Any]:
    """Every record of a ``.wandb`` run file, parsed with wandb's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, chunks = HEADER, b"", []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    records = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """Each ``run.log`` call as ``{key: value}`` (``value_json`` decoded)."""
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({
                (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                for item in record.history.item
            })  # fmt: skip
    return rows


def wandb_metrics(run_file: Path) -> dict[str, str]:
    """``define_metric`` records: ``{name or glob: step_metric}``."""
    out = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "metric":
            out[record.metric.name or record.metric.glob_name] = record.metric.step_metric
    return out
