"""Build the token store's tables from rollouts and their rescoring (``store`` schemas)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe.engine.rollout import Rollout
from mismatch_probe.pipeline import trajectory
from mismatch_probe.prompts import decode_tokens
from mismatch_probe.settings import Setting
from mismatch_probe.training.rescore import Scored


def with_setting_columns(table: pa.Table, setting: Setting) -> pa.Table:
    """``table`` (rows of one setting) with the typed setting columns (``store.SETTING_FIELDS``):
    each row says what ran without parsing the ``setting`` string."""
    values = {
        "rollout_dtype": setting.rollout.dtype,
        "kv_cache_dtype": setting.rollout.kv_cache_dtype,
        "quantization": setting.rollout.quantization,
        "lm_head_fp32": setting.rollout.lm_head_fp32,
        "train_dtype": setting.train_dtype,
        "routing_replay": setting.replay,
    }
    for name, value in values.items():
        kind = pa.bool_() if isinstance(value, bool) else pa.string()
        table = table.append_column(name, pa.array([value] * table.num_rows, kind))
    return table


def token_table(
    setting: str,
    rollouts: list[Rollout],
    scored: list[Scored],
    tokenizer: Any,
    seq_offset: int = 0,
) -> pa.Table:
    """One row per response token (``store.TOKEN_SCHEMA``), sequences contiguous.

    ``seq_offset`` is added to each rollout's ``seq_id`` so that ids stay unique when several
    settings share one file.
    """
    lengths = np.array([len(r.response_ids) for r in rollouts], dtype=np.int64)
    token_ids = np.array([t for r in rollouts for t in r.response_ids], dtype=np.int32)
    texts = decode_tokens(tokenizer, token_ids)
    per_seq = lambda values, dtype: np.repeat(np.array(values, dtype=dtype), lengths)  # noqa: E731
    entropy = {}  # train_entropy, when the rescorer gave it (store.token_schema adds the field)
    entropies = [s.entropy for s in scored if s.entropy is not None]
    if scored and len(entropies) == len(scored):
        entropy["train_entropy"] = _concat(entropies, np.float32)
    return pa.table(
        {
            "setting": pa.array([setting] * len(token_ids), pa.string()),
            "seq_id": per_seq([r.seq_id + seq_offset for r in rollouts], np.int64),
            "prompt_id": per_seq([r.prompt_id for r in rollouts], np.int64),
            "sample_id": per_seq([r.sample_id for r in rollouts], np.int32),
            "position": _turn_values(rollouts, trajectory.token_positions, _positions(lengths)),
            "token_id": token_ids,
            "token_text": pa.array(texts, pa.string()),
            "rollout_logprob": np.array(
                [x for r in rollouts for x in r.rollout_logprobs], dtype=np.float32
            ),
            "train_logprob": _concat([s.logprobs for s in scored], np.float32),
            "support_flip": _concat([s.support_flip for s in scored], np.bool_),
            **entropy,
            "turn": _turn_values(rollouts, trajectory.token_turns, np.zeros(len(token_ids), "i4")),
        }
    )


def _turn_values(rollouts: list[Rollout], per_token: Any, single: np.ndarray) -> np.ndarray:
    """``[N]`` int32 values of ``per_token(rollout)``; ``single`` when no rollout has turns."""
    if not any(r.turns is not None for r in rollouts):
        return single
    return np.array([v for r in rollouts for v in per_token(r)], dtype=np.int32)


def _positions(lengths: np.ndarray) -> np.ndarray:
    """``[0..n0-1, 0..n1-1, ...]`` as int32."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return (np.arange(int(lengths.sum())) - starts).astype(np.int32)


def _concat(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)


def mismatch_columns(scored: list[Scored], rollouts: list[Rollout]) -> dict[str, pa.Array]:
    """``store.SEQUENCE_MISMATCH_FIELDS`` of each sequence (float64 sums; null where a token's
    log-probability is not finite)."""
    from mismatch_probe.metrics.batch import clamp_b

    k3_sums: list[float | None] = []
    r_sums: list[float | None] = []
    for s, r in zip(scored, rollouts, strict=True):
        ratio = np.asarray(s.logprobs, np.float64) - np.asarray(r.rollout_logprobs, np.float64)
        if not np.isfinite(ratio).all():
            k3_sums.append(None)
            r_sums.append(None)
            continue
        rs = clamp_b(ratio)
        k3_sums.append(float(np.sum(np.expm1(rs) - rs)))
        r_sums.append(float(np.sum(ratio)))
    return {
        "seq_k3_sum": pa.array(k3_sums, pa.float64()),
        "seq_log_ratio_sum": pa.array(r_sums, pa.float64()),
    }


def sequence_table(
    setting: str, rollouts: list[Rollout], tokenizer: Any, seq_offset: int = 0
) -> pa.Table:
    """One row per response (``store.SEQUENCE_SCHEMA`` and its multi-turn fields); a
    multi-turn trajectory's ``response_text`` is everything after its prompt, given messages
    included."""
    prompt_texts = tokenizer.batch_decode([r.prompt_ids for r in rollouts])
    texts = [
        tokenizer.decode(list(r.turns.continuation)) if r.turns else r.response_text
        for r in rollouts
    ]
    return pa.table(
        {
            "setting": [setting] * len(rollouts),
            "seq_id": pa.array([r.seq_id + seq_offset for r in rollouts], pa.int64()),
            "prompt_id": pa.array([r.prompt_id for r in rollouts], pa.int64()),
            "sample_id": pa.array([r.sample_id for r in rollouts], pa.int32()),
            "prompt_text": prompt_texts,
            "response_text": texts,
            "prompt_length": pa.array([len(r.prompt_ids) for r in rollouts], pa.int32()),
            "response_length": pa.array([len(r.response_ids) for r in rollouts], pa.int32()),
            "finish_reason": [r.finish_reason for r in rollouts],
            **trajectory.sequence_columns(rollouts, tokenizer),
        }
    )
