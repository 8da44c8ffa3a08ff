"""Synthetic framework logs in each exact layout ``probe ingest`` reads (see the reader modules
for the source each layout was checked against).

Every fixture is built from ``synthetic_steps``: per step, sequences of (prompt ids, response
ids, rollout log-probs, train log-probs), with a log-ratio that grows with the step, so the
trend and threshold crossings are known in advance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Seq:
    prompt: list[int]
    response: list[int]
    rollout: list[float]
    train: list[float]


def synthetic_steps(
    steps: list[int], seqs: int = 3, seed: int = 0, growth: float = 0.05
) -> dict[int, list[Seq]]:
    """``{step: [Seq]}``: responses of 3..9 tokens, ``r = train - rollout ~ N(0, growth*k)``
    for the k-th step (k from 0), so the mismatch grows with the step."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, step in enumerate(steps):
        batch = []
        for _ in range(seqs):
            n = int(rng.integers(3, 10))
            rollout = np.log(rng.uniform(0.05, 0.95, n))
            train = np.minimum(rollout + rng.normal(0.0, growth * k + 1e-4, n), 0.0)
            prompt = rng.integers(1, 200, int(rng.integers(2, 5))).tolist()
            response = rng.integers(1, 200, n).tolist()
            batch.append(Seq(prompt, response, rollout.tolist(), train.tolist()))
        out[step] = batch
    return out


def expected_tokens(data: dict[int, list[Seq]]) -> tuple[np.ndarray, np.ndarray]:
    """All (rollout, train) pairs in order, as float32 (what the store holds)."""
    rollout = [x for seqs in data.values() for s in seqs for x in s.rollout]
    train = [x for seqs in data.values() for s in seqs for x in s.train]
    return np.array(rollout, np.float32), np.array(train, np.float32)


def write_prime_rl(root: Path, data: dict[int, list[Seq]], stable: bool = True) -> Path:
    """``root/token_exports/step_<N>/rank_0.jsonl`` (+ ``STABLE``), schema_version 1: arrays
    over prompt + response, trainer_logprobs shifted (index i = log-prob of token i, 0 a pad)."""
    for step, seqs in data.items():
        d = root / "token_exports" / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        lines = []
        for i, s in enumerate(seqs):
            p = len(s.prompt)
            lines.append(
                {
                    "schema_version": 1,
                    "step": step,
                    "export_step": step,
                    "rank": 0,
                    "micro_step": 0,
                    "micro_sequence_idx": i,
                    "export_sequence_idx": i,
                    "run_id": None,
                    "env_name": "synthetic",
                    "token_ids": s.prompt + s.response,
                    "position_ids": list(range(p + len(s.response))),
                    "loss_mask": [False] * p + [True] * len(s.response),
                    "advantages": [0.0] * (p + len(s.response)),
                    "inference_logprobs": [0.0] * p + s.rollout,
                    "trainer_logprobs": [-5.3] + [-1.0] * (p - 1) + s.train,
                    "entropy": [1.0] * (p + len(s.response)),
                }
            )
        (d / "rank_0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        if stable:
            (d / "STABLE").touch()
    return root


def write_nemo_rl(root: Path, data: dict[int, list[Seq]], pad_to: int = 16) -> Path:
    """``root/train_data_step<N>.jsonl``: one line per sample, each field a one-element list
    (the logger slices the batch one sample at a time), arrays padded to the batch length."""
    root.mkdir(parents=True, exist_ok=True)
    for step, seqs in data.items():
        lines = []
        for i, s in enumerate(seqs):
            p, n = len(s.prompt), len(s.response)
            pad = pad_to - p - n
            lines.append(
                {
                    "content": [[{"role": "user", "content": "q"}]],
                    "rewards": [1.0],
                    "input_lengths": [p + n],
                    "token_ids": [s.prompt + s.response + [0] * pad],
                    "token_loss_mask": [[0] * p + [1] * n + [0] * pad],
                    "sample_loss_mask": [1.0],
                    "advantages": [[0.0] * pad_to],
                    "generation_logprobs": [[0.0] * p + s.rollout + [0.0] * pad],
                    "prev_logprobs": [[0.0] * p + s.train + [0.0] * pad],
                    "idx": i,
                }
            )
        (root / f"train_data_step{step}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines)
        )
    return root


def slime_payload(step: int, seqs: list[Seq]) -> dict:
    import torch

    samples = []
    for i, s in enumerate(seqs):
        n = len(s.response)
        samples.append(
            {
                "data_parallel_rank": 0,
                "sample_index": i,
                "rollout_position": i,
                "tokens": torch.tensor(s.prompt + s.response),
                "total_lengths": len(s.prompt) + n,
                "response_lengths": n,
                "loss_masks": torch.ones(n, dtype=torch.int32),
                "log_probs": torch.tensor(s.train, dtype=torch.float32),
                "rollout_log_probs": torch.tensor(s.rollout, dtype=torch.float32),
                "rewards": 1.0,
            }
        )
    return {"format_version": 2, "rollout_id": step, "rank": 0, "samples": samples,
            "dp_shards": [{"rank": 0, "data_parallel_rank": 0}]}  # fmt: skip


def write_slime(root: Path, data: dict[int, list[Seq]]) -> Path:
    """``root/train_data/<rollout_id>.pt`` (format_version 2)."""
    import torch

    (root / "train_data").mkdir(parents=True, exist_ok=True)
    for step, seqs in data.items():
        torch.save(slime_payload(step, seqs), root / "train_data" / f"{step}.pt")
    return root


def write_miles(root: Path, data: dict[int, list[Seq]]) -> Path:
    """``root/dashboard_columns/rollout_<id>.parquet`` with Miles' polars schema (Int32 ids,
    Int8 loss mask, Float32 log-probs), row groups of 8 rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("sample_index", pa.int32()),
            ("response_length", pa.int32()),
            ("total_length", pa.int32()),
            ("tokens", pa.large_list(pa.int32())),
            ("loss_mask", pa.large_list(pa.int8())),
            ("rollout_log_probs", pa.large_list(pa.float32())),
        ]
    )
    (root / "dashboard_columns").mkdir(parents=True, exist_ok=True)
    for step, seqs in data.items():
        rows = {
            "sample_index": list(range(len(seqs))),
            "response_length": [len(s.response) for s in seqs],
            "total_length": [len(s.prompt) + len(s.response) for s in seqs],
            "tokens": [s.prompt + s.response for s in seqs],
            "loss_mask": [[1] * len(s.response) for s in seqs],
            "rollout_log_probs": [s.rollout for s in seqs],
        }
        table = pa.table(rows, schema=schema)
        pq.write_table(table, root / "dashboard_columns" / f"rollout_{step}.parquet",
                       row_group_size=8)  # fmt: skip
    return root
