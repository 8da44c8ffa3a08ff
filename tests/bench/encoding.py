"""``make bench parquet_floats``: what compressing the log-prob columns would cost and save.

Two float32 columns of ``ROWS`` log-probs drawn like a model's (most tokens near 0, a long
tail; the second a slightly perturbed copy, as the other side's), written in row groups of
``store.ROW_GROUP_TOKENS`` as probe writes them (``store.parquet_options``: floats
uncompressed) and with zstd, then read back row group by row group on one thread, best of
``REPEATS``. Reported: each file's size and read time, and their ratios.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.store import ROW_GROUP_TOKENS, parquet_options

ROWS = 4_000_000
REPEATS = 3


def _logprobs(rows: int) -> pa.Table:
    rng = np.random.default_rng(0)
    confident = rng.random(rows) < 0.6
    lp = np.where(confident, -np.exp(rng.normal(-6.0, 3.0, rows)), -rng.exponential(2.0, rows))
    other = lp * (1.0 + rng.normal(0.0, 1e-3, rows))
    return pa.table({"rollout_logprob": lp.astype(np.float32),
                     "train_logprob": other.astype(np.float32)})  # fmt: skip


def _read_s(path: Path) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        pf = pq.ParquetFile(path)
        start = time.perf_counter()
        for i in range(pf.num_row_groups):
            pf.read_row_group(i, use_threads=False)
        best = min(best, time.perf_counter() - start)
    return best


def bench_parquet_floats() -> dict[str, Any]:
    table = _logprobs(ROWS)
    ways = {"as_probe_writes": parquet_options(table.schema),
            "zstd": {"compression": "zstd", "use_dictionary": False}}  # fmt: skip
    out: dict[str, Any] = {"rows": ROWS}
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in ways.items():
            path = Path(tmp) / f"{name}.parquet"
            pq.write_table(table, path, row_group_size=ROW_GROUP_TOKENS, **options)
            out[name] = {"mb": path.stat().st_size / 2**20, "read_s": _read_s(path)}
    probe, zstd = out["as_probe_writes"], out["zstd"]
    out["zstd_size_saving"] = 1.0 - zstd["mb"] / probe["mb"]
    out["zstd_read_time_ratio"] = zstd["read_s"] / probe["read_s"]
    return out
