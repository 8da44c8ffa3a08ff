"""``probe ingest`` streaming: a prime-rl token export of 10 and of 100 steps of the same size
(``TOKENS_PER_STEP`` trained tokens each), ingested in a fresh ``spawn`` child that reports its
wall time and peak RSS. Streaming holds for peak memory at 100 steps about that at 10 steps
(one JSONL line and one row group at a time, whatever the number of steps).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.bench.metrics import _peak_rss_kb

STEP_COUNTS = {"10_steps": 10, "100_steps": 100}
TOKENS_PER_STEP = 20_000
RESPONSE = 500  # tokens per response (40 responses per step)
PROMPT = 100


def write_export(
    root: Path, steps: int, seed: int = 0, tokens_per_step: int = TOKENS_PER_STEP
) -> int:
    """``root/token_exports/step_<N>/rank_0.jsonl`` + ``STABLE`` (prime-rl schema 1); returns
    the trained tokens written (20 steps of 200,000: 168 MB of JSONL)."""
    rng = np.random.default_rng(seed)
    total = 0
    for step in range(1, steps + 1):
        d = root / "token_exports" / f"step_{step}"
        d.mkdir(parents=True)
        with (d / "rank_0.jsonl").open("w") as fh:
            for i in range(tokens_per_step // RESPONSE):
                n = PROMPT + RESPONSE
                rollout = np.log(rng.uniform(0.01, 1.0, n)).round(6)
                train = (rollout + rng.normal(0, 0.01 * step / steps, n)).round(6)
                line = {
                    "schema_version": 1, "step": step, "export_step": step, "rank": 0,
                    "export_sequence_idx": i, "token_ids": rng.integers(0, 50_000, n).tolist(),
                    "loss_mask": [False] * PROMPT + [True] * RESPONSE,
                    "inference_logprobs": rollout.tolist(), "trainer_logprobs": train.tolist(),
                }  # fmt: skip
                fh.write(json.dumps(line) + "\n")
                total += RESPONSE
        (d / "STABLE").touch()
    return total


def _measure(src: str, out: str) -> dict[str, Any]:
    """In a spawned child: one ingest, its wall time and this process's peak RSS."""
    from mismatch_probe.ingest import IngestConfig, run_ingest
    from mismatch_probe.malloc import keep_freed_memory

    keep_freed_memory()  # as the probe command does at start
    baseline = _peak_rss_kb()
    start = time.perf_counter()
    result = run_ingest(IngestConfig("prime-rl", Path(src), Path(out)))
    wall = time.perf_counter() - start
    tokens = result.run["counts"]["tokens"]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "peak_rss_mb": _peak_rss_kb() / 1024,
        "baseline_rss_mb": baseline / 1024,
    }


def bench_ingest() -> dict[str, Any]:
    import multiprocessing as mp

    out: dict[str, Any] = {"tokens_per_step": TOKENS_PER_STEP}
    with tempfile.TemporaryDirectory() as tmp:
        for tag, steps in STEP_COUNTS.items():
            src = Path(tmp) / f"src_{tag}"
            start = time.perf_counter()
            write_export(src, steps)
            out[f"write_export_{tag}_s"] = time.perf_counter() - start
            src_mb = sum(p.stat().st_size for p in src.rglob("*.jsonl")) / 2**20
            with mp.get_context("spawn").Pool(1) as pool:
                run = pool.apply(_measure, (str(src), str(Path(tmp) / f"run_{tag}")))
            out[f"ingest_{tag}"] = {**run, "jsonl_mb": src_mb}
    small, large = out["ingest_10_steps"], out["ingest_100_steps"]
    out["peak_ratio_100_over_10_steps"] = large["peak_rss_mb"] / small["peak_rss_mb"]
    return out
