"""Metric engine: streaming pass vs the naive in-memory torch computation, time and memory.

Builds synthetic token stores of 1 M and 10 M tokens (about 2,000 and 20,000 sequences of
1..999 tokens, in row groups of about ``store.ROW_GROUP_TOKENS`` rows that never split a
sequence; the values drawn 131,072 rows at a time, whatever the row-group size)
and measures each computation in a fresh ``spawn`` child: wall time and the child's own peak RSS
(``VmHWM`` from ``/proc/self/status``), plus its RSS after imports (the baseline), so no
measurement inherits another's memory. The acceptance check: our peak at 10 M tokens within 2x
of ours at 1 M tokens.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.store import ROW_GROUP_TOKENS, parquet_options

SIZES = {"1m": 1_000_000, "10m": 10_000_000}
MAX_LEN = 999
ROW_GROUP = ROW_GROUP_TOKENS
DRAWN = 131_072  # rows drawn at a time: the store's values do not depend on ROW_GROUP
COMPARED = ("kl", "k3_kl", "chi2_token", "rollout_is_mean", "rollout_is_eff_sample_size", "f_tau_2")


def _chunk(rng: np.random.Generator, first_seq: int, rows: int) -> pa.Table:
    """About ``rows`` tokens of whole synthetic sequences, ids from ``first_seq``."""
    lengths = rng.integers(1, MAX_LEN + 1, size=max(1, rows // (MAX_LEN // 2)))
    n = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    rollout = -rng.exponential(1.5, n)
    spike = rng.random(n) < 1e-3
    r = rng.normal(0.0, 0.02, n) + spike * rng.normal(0.0, 1.0, n)
    return pa.table(
        {
            "seq_id": np.repeat(np.arange(first_seq, first_seq + len(lengths)), lengths),
            "position": (np.arange(n) - starts).astype(np.int32),
            "token_id": rng.integers(0, 50_000, n).astype(np.int32),
            "rollout_logprob": rollout.astype(np.float32),
            "train_logprob": np.minimum(rollout + r, 0.0).astype(np.float32),
            "support_flip": rng.random(n) < 1e-3,
        }
    )


def write_synthetic_store(path: Path, tokens: int, seed: int = 0) -> dict[str, int]:
    """Write a store of at least ``tokens`` rows, drawn ``DRAWN`` rows at a time and written
    in row groups of about ``ROW_GROUP`` rows (as many chunks drawn as make it: whole
    sequences), so memory stays bounded and the values are those of any row-group size."""
    rng = np.random.default_rng(seed)
    rows = seqs = 0
    writer = None
    held: list[pa.Table] = []  # drawn, not yet written
    per_group = max(1, round(ROW_GROUP / DRAWN))
    try:
        while rows < tokens:
            table = _chunk(rng, seqs, min(DRAWN, tokens - rows))
            writer = writer or pq.ParquetWriter(path, table.schema, **parquet_options(table.schema))
            held.append(table)
            rows += table.num_rows
            seqs += len(np.unique(table.column("seq_id").to_numpy()))
            if len(held) == per_group or rows >= tokens:
                group = pa.concat_tables(held)
                writer.write_table(group, row_group_size=group.num_rows)
                held = []
    finally:
        if writer is not None:
            writer.close()
    return {"tokens": rows, "sequences": seqs}


def _measure(kind: str, path: str) -> dict[str, Any]:
    """Runs in a spawned child: one computation, its time and this process's peak RSS."""
    from mismatch_probe.malloc import keep_freed_memory
    from mismatch_probe.metrics import MetricsConfig, compute_metrics

    keep_freed_memory()  # as the probe command does at start (the torch reference too)
    if kind == "naive_torch":
        import torch

        from tests.bench.naive_torch import naive_torch_metrics

        torch.set_num_threads(2)
    baseline = _peak_rss_kb()
    start = time.perf_counter()
    if kind == "stream":
        values = compute_metrics(Path(path), MetricsConfig()).flat()
    else:
        values = naive_torch_metrics(Path(path), MetricsConfig())
    wall = time.perf_counter() - start
    peak = _peak_rss_kb()
    return {
        "wall_s": wall,
        "peak_rss_mb": peak / 1024,
        "baseline_rss_mb": baseline / 1024,
        "values": {k: values[k] for k in COMPARED},
    }


def _peak_rss_kb() -> int:
    """This process's peak RSS (``VmHWM``): unlike ``ru_maxrss``, it is not inherited from a
    large parent through fork + exec, so each spawned child measures only itself."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not Linux


def _in_child(kind: str, path: Path) -> dict[str, Any]:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_measure, (kind, str(path)))


def _max_rel_diff(a: dict[str, float], b: dict[str, float]) -> float:
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in COMPARED)


def bench_metrics() -> dict[str, Any]:
    """Time and peak memory of the streaming engine vs naive torch at 1 M and 10 M tokens."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tag, tokens in SIZES.items():
            path = Path(tmp) / f"tokens_{tag}.parquet"
            start = time.perf_counter()
            sizes = write_synthetic_store(path, tokens)
            out[f"store_{tag}"] = {**sizes, "write_s": time.perf_counter() - start}
            runs = {kind: _in_child(kind, path) for kind in ("stream", "naive_torch")}
            for kind, run in runs.items():
                out[f"{kind}_{tag}"] = {k: v for k, v in run.items() if k != "values"}
            diff = _max_rel_diff(runs["stream"]["values"], runs["naive_torch"]["values"])
            out[f"max_rel_diff_{tag}"] = diff
    peak_1m, peak_10m = out["stream_1m"]["peak_rss_mb"], out["stream_10m"]["peak_rss_mb"]
    out["stream_peak_ratio_10m_over_1m"] = peak_10m / peak_1m
    out["stream_peak_within_2x"] = peak_10m <= 2 * peak_1m
    return out


def run(out: dict[str, Any]) -> None:
    """``out.update(bench_metrics())``."""
    out.update(bench_metrics())
