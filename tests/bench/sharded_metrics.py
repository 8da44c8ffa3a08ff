"""``probe metrics`` over a 10 M-token store split into 20 parts vs the same rows in one file.

The single file is ``metrics.write_synthetic_store``'s; the sharded copy distributes its row
groups (which never split a sequence) over 20 ``shard=K/part-0.parquet`` parts with their
``_SUCCESS`` markers, as a sharded scan writes them. Each computation runs in a fresh ``spawn``
child (``metrics._in_child``), twice, alternating; the best of each is kept. Reported: wall
time, throughput, the throughput ratio (the acceptance check: parts within 20% of the file),
and the largest relative difference over the compared metrics (``metrics.COMPARED``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.store import dataset
from tests.bench.metrics import _in_child, write_synthetic_store

TOKENS = 10_000_000
PARTS = 20
REPEATS = 2  # alternated, best wall time of each kept (a shared machine's noise)


def split_store(path: Path, table_dir: Path, parts: int) -> None:
    """Copy ``path``'s row groups into ``parts`` shards, in order, about equally many each."""
    pf = pq.ParquetFile(path)
    groups = pf.num_row_groups
    for k in range(parts):
        chosen = range(k * groups // parts, (k + 1) * groups // parts)
        part = dataset.part_path(table_dir, k)
        with pq.ParquetWriter(
            part, pf.schema_arrow, **store.parquet_options(pf.schema_arrow)
        ) as writer:
            for i in chosen:
                writer.write_table(pf.read_row_group(i))
        store.mark_done(table_dir, k, {"row_groups": len(chosen)})


def _max_rel_diff(a: dict[str, float], b: dict[str, float]) -> float:
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in b)


def bench_sharded_metrics() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        single, parts = Path(tmp) / "tokens.parquet", Path(tmp) / "tokens"
        out["store"] = write_synthetic_store(single, TOKENS)
        start = time.perf_counter()
        split_store(single, parts, PARTS)
        out["split_s"] = time.perf_counter() - start
        paths = {"one_file": single, "parts": parts}
        tries = [(name, _in_child("stream", paths[name])) for _ in range(REPEATS) for name in paths]
    runs = {
        name: min((r for n, r in tries if n == name), key=lambda r: r["wall_s"]) for name in paths
    }
    tokens = out["store"]["tokens"]
    for name, run in runs.items():
        out[name] = {
            "wall_s": run["wall_s"],
            "tokens_per_s": tokens / run["wall_s"],
            "peak_rss_mb": run["peak_rss_mb"],
        }
    ratio = out["parts"]["tokens_per_s"] / out["one_file"]["tokens_per_s"]
    out["parts"]["count"] = PARTS
    out["throughput_ratio_parts_over_file"] = ratio
    out["throughput_within_20pct"] = ratio >= 0.8
    out["max_rel_diff"] = _max_rel_diff(runs["parts"]["values"], runs["one_file"]["values"])
    return out
