"""A sharded scan (2 shards on a local Ray instance) against the same scan in one process.

Three runs of the same scan of the embedded default model (16 prompts, 32 tokens), each with
the engine inside the process that uses it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the Ray
workers run it), so that only the sharding and Ray differ:

* ``one_process``: ``probe scan``;
* ``shards_in_process``: ``--shards 2`` without Ray (the shards one after the other here: the
  cost of sharding itself, an engine start and a model load per shard);
* ``ray``: ``--ray local --shards 2`` (a fresh local Ray instance; the node's CPUs per shard,
  so the shards run one at a time).

Ray's overhead is ``ray - shards_in_process`` (starting Ray, a worker per shard importing the
libraries, scheduling, shutdown), reported as a share of the Ray run's wall time.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.scan import run_scan
from mismatch_probe.pipeline.sharding import run_sharded
from mismatch_probe.sampling import SamplingSpec

ENGINE_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def _timed(cfg: ScanConfig) -> tuple[float, Any]:
    start = time.perf_counter()
    run = run_sharded if cfg.sharded else run_scan
    result = run(cfg, Console(stderr=True, quiet=True))
    return time.perf_counter() - start, result


def bench_sharded_scan() -> dict[str, Any]:
    saved = os.environ.get(ENGINE_ENV)
    os.environ[ENGINE_ENV] = "0"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = ScanConfig(num_prompts=16, sampling=SamplingSpec(max_tokens=32))
            runs = {
                "one_process": replace(base, out=Path(tmp) / "one"),
                "shards_in_process": replace(base, out=Path(tmp) / "shards", shards=2),
                "ray": replace(base, out=Path(tmp) / "ray", shards=2, ray="local"),
            }
            results = {name: _timed(cfg) for name, cfg in runs.items()}
    finally:
        if saved is None:
            os.environ.pop(ENGINE_ENV, None)
        else:
            os.environ[ENGINE_ENV] = saved
    out: dict[str, Any] = {}
    for name, (wall, result) in results.items():
        out[name] = {"wall_s": wall, "tokens": result.metrics["num_tokens"]}
    ray_wall = out["ray"]["wall_s"]
    overhead = ray_wall - out["shards_in_process"]["wall_s"]
    out["ray_overhead_s"] = overhead
    out["ray_overhead_share"] = overhead / ray_wall
    out["sharding_cost_s"] = out["shards_in_process"]["wall_s"] - out["one_process"]["wall_s"]
    out["same_tokens"] = len({v["tokens"] for v in out.values() if isinstance(v, dict)}) == 1
    out["load_average_1m_after"] = os.getloadavg()[0]  # other work on the machine, for context
    return out
