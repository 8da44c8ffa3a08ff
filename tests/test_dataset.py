"""A sharded token store (``tokens/shard=K/part-0.parquet``) reads like one file.

The same rows are written once as ``tokens.parquet`` and once split into shards the way a
sharded scan splits them (each shard a range of sequences, every setting's rows of those
sequences); ``probe metrics``, ``report``, ``check`` and ``compare`` must give the same numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mismatch_probe import store
from mismatch_probe.metrics import compute_metrics
from mismatch_probe.metrics.stream import STRUCTURED_KEYS
from mismatch_probe.store import dataset
from tests.cli_runner import run_probe as cli_run

SETTINGS = ("rollout=bf16 | train=fp32", "rollout=fp16 | train=fp32")
SEQS = 240  # per setting


def token_rows(seed: int = 3) -> pa.Table:
    """Two settings' tokens, setting-major like a scan's file: seq ids 0..479."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, SEQS * len(SETTINGS))
    n = int(lengths.sum())
    seq = np.repeat(np.arange(len(lengths)), lengths)
    rollout = -rng.exponential(1.0, n)
    setting = np.where(seq < SEQS, SETTINGS[0], SETTINGS[1])
    return pa.table(
        {
            "setting": setting.tolist(),
            "seq_id": seq.astype(np.int64),
            "prompt_id": (seq % SEQS).astype(np.int64),
            "sample_id": np.zeros(n, np.int32),
            "position": np.concatenate([np.arange(k) for k in lengths]).astype(np.int32),
            "token_id": rng.integers(0, 300, n).astype(np.int32),
            "token_text": [f"t{i % 7}" for i in range(n)],
            "rollout_logprob": rollout.astype(np.float32),
            # a log-prob stays below 0 (the positive_logprob integrity check would fail the gate)
            "train_logprob": np.minimum(rollout + rng.normal(0, 0.2, n), -1e-6).astype(np.float32),
            "support_flip": rng.random(n) < 0.05,
        }
    )


def write_sharded(table_dir: Path, table: pa.Table, shards: int, run: dict[str, Any]) -> None:
    """Shard k holds the sequences of prompts ``[k * SEQS / shards, ...)`` of every setting."""
    bounds = np.linspace(0, SEQS, shards + 1).astype(int)
    prompt = table.column("prompt_id")
    for k in range(shards):
        mask = pc.and_(
            pc.greater_equal(prompt, int(bounds[k])), pc.less(prompt, int(bounds[k + 1]))
        )
        part = table.filter(mask)
        store.write_table(dataset.part_path(table_dir, k), part, store.TOKEN_SCHEMA, run)
        store.mark_done(table_dir, k, {"rows": part.num_rows})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(run dir with tokens.parquet, run dir with a 3-shard tokens/ directory)."""
    root = tmp_path_factory.mktemp("stores")
    table = token_rows()
    run = {"setting": SETTINGS[0], "settings": list(SETTINGS), "model": {"name": "m"}}
    single, sharded = root / "single", root / "sharded"
    for path in (single, sharded):
        path.mkdir()
        store.write_json(path / store.RUN_FILE, run)
    store.write_table(single / store.TOKENS_FILE, table, store.TOKEN_SCHEMA, run)
    write_sharded(sharded / store.TOKENS_DIR, table, 3, run)
    return single, sharded


def assert_same_metrics(a: dict[str, float], b: dict[str, float]) -> None:
    """Equal up to float64 summation order: the accumulators sum per batch, and a batch ends
    with a part, so partial sums are grouped differently. Each sum has < 2^14 terms, so the
    rounding differs by at most ~2^14 * 2^-53 ~ 2e-12 relative to the sum of |terms|; a
    relative 1e-9 (plus 1e-12 absolute for values near 0 after cancellation) covers that."""
    assert a.keys() == b.keys()
    for key in a:
        assert math.isclose(a[key], b[key], rel_tol=1e-9, abs_tol=1e-12), (key, a[key], b[key])


@pytest.mark.parametrize("setting", SETTINGS)
def test_sharded_store_gives_the_same_metrics(runs: tuple[Path, Path], setting: str) -> None:
    single, sharded = runs
    one = compute_metrics(single, setting=setting).to_json_dict()
    for path in (sharded, sharded / store.TOKENS_DIR):
        parts = compute_metrics(path, setting=setting).to_json_dict()
        assert_same_metrics(
            {k: v for k, v in one.items() if k not in STRUCTURED_KEYS},
            {k: v for k, v in parts.items() if k not in STRUCTURED_KEYS},
        )
        assert parts["curves"]["worst_tokens"] == one["curves"]["worst_tokens"]


def test_cli_reads_a_sharded_store_like_a_file(
    runs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    single, sharded = runs
    out, integrity = {}, {}
    for path in (single, sharded, sharded / store.TOKENS_DIR):
        code, stdout, err = cli_run(
            ["metrics", str(path), "--setting", SETTINGS[1], "--json"], monkeypatch, capsys
        )
        assert code == 0, err
        out[path] = json.loads(stdout)
        out[path].pop("recommendation")  # the same rule on the same numbers
        integrity[path] = out[path].pop("integrity")
    assert integrity[single] == integrity[sharded] == integrity[sharded / store.TOKENS_DIR]
    assert_same_metrics(out[single], out[sharded])
    assert_same_metrics(out[single], out[sharded / store.TOKENS_DIR])

    for path in (single, sharded):  # report writes metrics.json of the reference setting
        code, _, err = cli_run(["report", str(path)], monkeypatch, capsys)
        assert code == 0, err
    report = [json.loads((p / "metrics.json").read_text()) for p in (single, sharded)]
    assert_same_metrics(
        {k: v for k, v in report[0].items() if k not in STRUCTURED_KEYS},
        {k: v for k, v in report[1].items() if k not in STRUCTURED_KEYS},
    )

    bound = f"k3_kl={report[0]['k3_kl'] * (1 + 1e-6)}"
    args = ["check", str(sharded), "--max", bound, "--setting", SETTINGS[0]]
    code, stdout, err = cli_run(args, monkeypatch, capsys)
    assert code == 0 and "all bounds hold in 1 setting" in stdout, err

    code, stdout, err = cli_run(
        ["compare", str(single), str(sharded), "--out", str(tmp_path / "cmp")], monkeypatch, capsys
    )
    assert code == 0, err
    assert "×1" in stdout


def test_unfinished_shard_is_refused(
    runs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    table_dir = tmp_path / store.TOKENS_DIR
    write_sharded(table_dir, token_rows(), 2, {})
    (dataset.shard_dir(table_dir, 1) / dataset.MARKER).unlink()
    code, _, err = cli_run(["metrics", str(tmp_path), "--json"], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: {table_dir}: shard(s) 1 unfinished (no _SUCCESS); "
        "finish them with probe scan --resume"
    ]


def test_hidden_parts_and_markers_are_not_data(tmp_path: Path) -> None:
    table_dir = tmp_path / store.TOKENS_DIR
    write_sharded(table_dir, token_rows(), 2, {})
    junk = dataset.shard_dir(table_dir, 0) / ".part-1.parquet.partial-99"
    junk.write_bytes(b"half a file")
    assert dataset.part_files(table_dir) == [
        dataset.shard_dir(table_dir, k) / dataset.PART for k in range(2)
    ]
    assert sorted(dataset.done_shards(table_dir)) == [0, 1]
    rows = sum(t.num_rows for t in store.iter_sequence_batches(table_dir))
    assert rows == token_rows().num_rows
