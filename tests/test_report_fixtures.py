"""Small token stores for the report tests, written with pyarrow (no model, no engine).

``make_run`` writes a run directory the way ``probe scan`` does (``tokens.parquet``,
``run.json``, optionally ``metrics.json``); ``uniform_run`` gives every token the same
log-ratio, so metric ratios between two such runs are known by hand.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from mismatch_probe import store
from mismatch_probe.metrics import compute_metrics

SETTING = "rollout=bf16 | train=fp32"
# The response that tries to inject HTML and a link into report.md.
EVIL = ["<script>", "alert(1)", "</script>", " [x", "](javascript:", "alert(2))", " ok"]


class Seq(NamedTuple):
    """One response: token texts, rollout and train log-probs, support-flip flags."""

    texts: list[str]
    rollout: list[float]
    train: list[float]
    flips: list[bool]


def run_metadata(setting: str, model: str = "tiny-llama", prompts: str = "p.jsonl") -> dict:
    return {
        "setting": setting,
        "model": {"name": model, "path": f"/m/{model}", "config_sha256": "abc"},
        "prompts": {"path": prompts, "count": 2, "chat": False},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 16},
    }


def token_table(seqs: list[Seq], setting: str) -> pa.Table:
    lengths = [len(s.texts) for s in seqs]
    ids = np.repeat(np.arange(len(seqs)), lengths)
    n = int(sum(lengths))
    return pa.table(
        {
            "setting": [setting] * n,
            "seq_id": ids.astype(np.int64),
            "prompt_id": (ids // 2).astype(np.int64),
            "sample_id": (ids % 2).astype(np.int32),
            "position": np.concatenate([np.arange(k) for k in lengths]).astype(np.int32),
            "token_id": np.arange(n, dtype=np.int32),
            "token_text": [t for s in seqs for t in s.texts],
            "rollout_logprob": np.array([x for s in seqs for x in s.rollout], np.float32),
            "train_logprob": np.array([x for s in seqs for x in s.train], np.float32),
            "support_flip": np.array([f for s in seqs for f in s.flips], bool),
        }
    )


def make_run(path: Path, seqs: list[Seq], *, metrics: bool = True, **meta: Any) -> Path:
    """Write a run directory; ``meta`` goes to ``run_metadata`` (setting, model, prompts)."""
    path.mkdir(parents=True, exist_ok=True)
    run = run_metadata(**{"setting": SETTING, **meta})
    store.write_table(
        path / store.TOKENS_FILE, token_table(seqs, run["setting"]), store.TOKEN_SCHEMA, run
    )
    store.write_json(path / store.RUN_FILE, run)
    if metrics:
        store.write_json(path / "metrics.json", tied(path, compute_metrics(path).to_json_dict()))
    return path


def tied(path: Path, metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with their tie to the run's token store, as ``probe scan`` writes them."""
    from mismatch_probe.store.fingerprint import STORE_KEY, store_tie

    return {**metrics, STORE_KEY: store_tie(store.resolve_tokens_path(path))}


def uniform_seqs(r: float, lengths: list[int]) -> list[Seq]:
    """Every token has rollout log-prob log(0.5) and ``train - rollout = r``."""
    lp = math.log(0.5)
    return [Seq([f"w{i}" for i in range(k)], [lp] * k, [lp + r] * k, [False] * k) for k in lengths]


def uniform_run(path: Path, r: float, lengths: list[int], **meta: Any) -> Path:
    return make_run(path, uniform_seqs(r, lengths), **meta)


def mixed_seqs() -> list[Seq]:
    """Three responses: drift everywhere, the largest |r| on ``EVIL``'s ``](javascript:`` token,
    and one support flip."""
    lp = math.log(0.4)
    plain = ["The", " cat", " sat", "\n", " on", " mat", "."]
    small = [0.01, -0.02, 0.015, -0.005, 0.02, -0.01, 0.0]
    evil = [0.03, -0.04, 0.02, 0.05, -1.5, 0.01, -0.02]
    flips = [False] * 7
    return [
        Seq(plain, [lp] * 7, [lp + x for x in small], flips),
        Seq(EVIL, [lp] * 7, [lp + x for x in evil], flips),
        Seq(plain[:5], [lp] * 5, [lp, lp, lp + 0.9, lp, lp], [False, False, True, False, False]),
    ]


def matrix_run(path: Path, settings: dict[str, list[Seq]], **meta: Any) -> Path:
    """A precision-matrix run directory: every setting's sequences in one store, each setting
    with its own seq_id range, ``run.json`` listing the settings in the given order (the first
    is the reference); ``metrics.json`` holds the first setting's metrics, as a scan writes."""
    import pyarrow.compute as pc

    path.mkdir(parents=True, exist_ok=True)
    names = list(settings)
    run = {**run_metadata(**{"setting": names[0], **meta}), "settings": names}
    tables, offset = [], 0
    for name, seqs in settings.items():
        table = token_table(seqs, name)
        tables.append(table.set_column(1, "seq_id", pc.add(table.column("seq_id"), offset)))
        offset += len(seqs)
    tokens = pa.concat_tables(tables)
    store.write_table(path / store.TOKENS_FILE, tokens, store.TOKEN_SCHEMA, run)
    store.write_json(path / store.RUN_FILE, run)
    first = tied(path, compute_metrics(path, setting=names[0]).to_json_dict())
    store.write_json(path / store.METRICS_FILE, first)
    return path
