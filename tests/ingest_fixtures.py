"""Synthetic framework logs in each exact layout ``probe ingest`` reads (see the reader modules
for the source each layout was checked against).

Every fixture is built from ``synthetic_steps``: per step, sequences of (prompt ids, response
ids, rollout log-probs, train log-probs), with a log-ratio that grows with the step, so the
trend and threshold crossings are known in advance.
"""

from __future__ import annotations

import json
import sys
import types
from contextlib import contextmanager
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
            # below 0: a training log-prob of exactly 0.0 would be a placeholder (integrity)
            train = np.minimum(rollout + rng.normal(0.0, growth * k + 1e-4, n), -1e-6)
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


@contextmanager
def registered(module: str, **names: object):
    """``module`` (and its parents) in ``sys.modules`` holding ``names``, for ``pickle.dump`` to
    name classes by the framework's module path; removed afterwards, and an imported module's
    own attributes put back."""
    parts = module.split(".")
    added = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    added = [m for m in added if m not in sys.modules]
    for m in added:
        sys.modules[m] = types.ModuleType(m)
    missing = object()
    before = {name: getattr(sys.modules[module], name, missing) for name in names}
    for name, obj in names.items():
        setattr(sys.modules[module], name, obj)
        if callable(obj):  # pickle names it by module and qualified name
            obj.__module__ = module  # type: ignore[attr-defined]
            obj.__qualname__ = name  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for name, old in before.items():  # a real module (verl's, imported) gets its own back
            if old is missing:
                delattr(sys.modules[module], name)
            else:
                setattr(sys.modules[module], name, old)
        for m in added:
            del sys.modules[m]


def _padded(rows: list[list], width: int, value: float, left: bool, dtype):
    """``[len(rows), width]`` tensor of ``rows``, each left-padded (``left``: right-aligned,
    SkyRL's layout) or right-padded (verl's responses) with ``value``."""
    import torch

    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            row = torch.tensor(r, dtype=torch.float64).to(dtype)
            if left:
                out[i, width - len(r) :] = row
            else:
                out[i, : len(r)] = row
    return out


def verl_batch(seqs: list[Seq], group: int = 2):
    """verl's batch after the old-log-prob recompute (``ray_trainer.fit``, keys as
    ``agent_loop._postprocess`` builds them): prompts left-padded, responses right-padded,
    ``uid`` shared by ``group`` consecutive responses. ``(tensors, non_tensor_batch)``."""
    import torch

    p_len = max(len(s.prompt) for s in seqs)
    r_len = max(len(s.response) for s in seqs) + 2  # padding after every response
    prompts = _padded([s.prompt for s in seqs], p_len, 0, True, torch.int64)
    responses = _padded([s.response for s in seqs], r_len, 0, False, torch.int64)
    mask = _padded([[1] * len(s.response) for s in seqs], r_len, 0, False, torch.int64)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([(prompts != 0).long(), mask], dim=1),
        "rollout_log_probs": _padded([s.rollout for s in seqs], r_len, 0.0, False, torch.float32),
        "old_log_probs": _padded([s.train for s in seqs], r_len, 0.0, False, torch.float32),
    }
    n = len(seqs)
    raw_prompt = np.empty(n, dtype=object)
    raw_prompt[:] = [[{"role": "user", "content": "q"}] for _ in range(n)]
    non_tensor = {
        "uid": np.array([f"uid-{i // group}" for i in range(n)], dtype=object),
        "data_source": np.array(["synthetic"] * n, dtype=object),
        "raw_prompt": raw_prompt,
        "__num_turns__": np.full(n, 2, dtype=np.int32),
        "extra_info": np.array([{"index": np.int64(i), "split": "train"} for i in range(n)]),
    }
    return tensors, non_tensor


class DataProto:
    """verl's ``DataProto`` pickle protocol, reproduced from volcengine/verl ``verl/protocol.py``
    (``__getstate__``: ``torch.save`` of the consolidated TensorDict to bytes, then
    ``(bytes, non_tensor_batch, meta_info)``); pickled under ``verl.protocol.DataProto``.
    ``method``: ``"consolidated"`` (tensordict >= 0.5), ``"plain"`` (older tensordict: not
    consolidated) or ``"numpy"`` (``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``:
    ``serialize_tensordict``)."""

    method = "consolidated"

    def __init__(self, batch, non_tensor_batch, meta_info) -> None:
        self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch, meta_info

    def __getstate__(self):
        import io

        import torch

        if self.method == "numpy":
            items = {
                k: (str(v.dtype).removeprefix("torch."), v.shape,
                    v.flatten().contiguous().view(torch.uint8).numpy())
                for k, v in self.batch.items()
            }  # fmt: skip
            batch = (tuple(self.batch.batch_size), None, items)
            return batch, self.non_tensor_batch, self.meta_info
        batch = self.batch.contiguous()
        if self.method == "consolidated":
            batch = batch.consolidate()
        buffer = io.BytesIO()
        torch.save(batch, buffer)
        return buffer.getvalue(), self.non_tensor_batch, self.meta_info

    def save_to_disk(self, filepath) -> None:
        import pickle

        with registered("verl.protocol", DataProto=DataProto), open(filepath, "wb") as f:
            pickle.dump(self, f)


def write_verl(root: Path, data: dict[int, list[Seq]], method: str = "consolidated") -> Path:
    """``root/step_<N>.dp``: the README hook's ``DataProto.save_to_disk`` of each step's batch,
    with the real ``tensordict.TensorDict`` (``method``: see ``DataProto``)."""
    from tensordict import TensorDict

    root.mkdir(parents=True, exist_ok=True)
    for step, seqs in data.items():
        tensors, non_tensor = verl_batch(seqs)
        td = TensorDict(tensors, batch_size=[len(seqs)])
        meta = {
            "temperature": 1.0,
            "global_token_num": [len(s.prompt) + len(s.response) for s in seqs],
        }
        proto = DataProto(td, non_tensor, meta)
        proto.method = method
        proto.save_to_disk(root / f"step_{step}.dp")
    return root


SKYRL_MODULE = "skyrl.backends.skyrl_train.training_batch"


def _skyrl_serialize(value):
    """SkyRL ``_serialize_tensor``: numpy bytes, ``torch.save`` for bfloat16."""
    import io

    import torch

    try:
        arr = value.numpy()
        return {
            "format": "numpy",
            "data": arr.tobytes(),
            "shape": arr.shape,
            "dtype": str(arr.dtype),
        }
    except TypeError:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return {"format": "torch", "data": buffer.getvalue()}


def rebuild_tensor_batch(cls, state):
    obj = dict.__new__(cls)
    obj.__setstate__(state)
    return obj


class TrainingInputBatch(dict):
    """SkyRL's ``TensorBatch`` pickle protocol, reproduced from NovaSky-AI/SkyRL
    ``skyrl/backends/skyrl_train/training_batch.py``: ``__reduce__`` ->
    ``_rebuild_tensor_batch(cls, __getstate__())`` (``legacy=True``: the layout before 2026-03,
    a dict subclass pickled with its raw tensor items and the same state)."""

    metadata = None
    legacy = False

    def __reduce_ex__(self, protocol):
        if self.legacy:
            return super().__reduce_ex__(protocol)
        return (rebuild_tensor_batch, (type(self), self.__getstate__()))

    def __getstate__(self):
        import torch

        batch_dict = {k: None if v is None else _skyrl_serialize(v) for k, v in self.items()}
        size = len(next(iter(self.values())))
        return {"batch_dict": batch_dict, "batch_size": size, "device": torch.device("cpu"),
                "metadata": self.metadata}  # fmt: skip

    def __setstate__(self, state) -> None:  # pragma: no cover - SkyRL's, not used here
        raise NotImplementedError


def skyrl_batch(seqs: list[Seq], pad_size: int = 0, train_dtype=None):
    """``convert_prompts_responses_to_batch_tensors`` + ``fwd_logprobs_values_reward``: left-padded
    sequences, right-aligned response tensors; ``pad_size`` padding copies of row 0 (loss mask 0)
    as ``pad_training_input_batch`` adds; two responses per prompt."""
    import torch

    n = len(seqs)
    total = max(len(s.prompt) + len(s.response) for s in seqs)
    width = max(len(s.response) for s in seqs)
    batch = TrainingInputBatch(
        sequences=_padded([s.prompt + s.response for s in seqs], total, 0, True, torch.int64),
        attention_mask=_padded(
            [[1] * (len(s.prompt) + len(s.response)) for s in seqs], total, 0, True, torch.int64
        ),
        response_mask=_padded([[1] * len(s.response) for s in seqs], width, 0, True, torch.int64),
        loss_mask=_padded([[1.0] * len(s.response) for s in seqs], width, 0.0, True, torch.float32),
        rollout_logprobs=_padded([s.rollout for s in seqs], width, 0.0, True, torch.float32),
        action_log_probs=_padded(
            [s.train for s in seqs], width, 0.0, True, train_dtype or torch.float32
        ),
        base_action_log_probs=_padded([s.train for s in seqs], width, 0.0, True, torch.float32),
        advantages=torch.zeros(n, width),
        values=None,
    )
    if pad_size:
        for key, value in list(batch.items()):
            if value is not None:
                pad = (
                    torch.zeros_like(value[:pad_size])
                    if key == "loss_mask"
                    else value[[0] * pad_size]
                )
                batch[key] = torch.cat([value, pad])
    batch.metadata = {
        "policy_mini_batch_boundaries": [(0, n + pad_size)],
        "policy_prompt_boundaries": [(i, min(i + 2, n)) for i in range(0, n, 2)],
        "response_length": width,
        "avg_response_length": sum(len(s.response) for s in seqs) / n,
        "pad_size": pad_size,
        "metrics": {"loss/avg_final_rewards": 0.5},
    }
    return batch


def write_skyrl(root: Path, data: dict[int, list[Seq]], legacy: bool = False, **kw) -> Path:
    """``root/dumped_data/global_step_<N>_training_input.pkl`` (``trainer.dump_data``);
    ``legacy``: the ``skyrl_train.training_batch`` module and pickle layout of early 2026."""
    import pickle

    (root / "dumped_data").mkdir(parents=True, exist_ok=True)
    module = "skyrl_train.training_batch" if legacy else SKYRL_MODULE
    with registered(module, TrainingInputBatch=TrainingInputBatch,
                     _rebuild_tensor_batch=rebuild_tensor_batch):  # fmt: skip
        for step, seqs in data.items():
            batch = skyrl_batch(seqs, **kw)
            batch.legacy = legacy
            with open(root / "dumped_data" / f"global_step_{step}_training_input.pkl", "wb") as f:
                pickle.dump(batch, f)
    return root
