"""``probe watch`` keeping up with a writer of ``TOKENS_PER_STEP`` (1M) trained tokens per step.

A writer process (``ProbeWriter``, the hook's own format) writes one step every ``PERIOD``
seconds, ``STEPS`` steps (``BENCH_WATCH_STEPS``, ``BENCH_WATCH_PERIOD`` override them), while
``probe watch`` follows it in a process of its own, its RSS sampled every half second. Reported:
each step's latency (its manifest written -> its line in ``steps.jsonl``: flat when watch keeps
up, growing when it falls behind), the watch's busy time per step (latency when it was idle
before the step), its peak RSS in the first and the last fifth of the steps, and their ratios
(last over first: about 1 when time and memory stay flat). The final report (one pass over the
whole store, as ``probe report``) is timed apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

TOKENS_PER_STEP = 1_000_000
RESPONSE = 500  # tokens per response: 2,000 responses per step
STEPS = int(os.environ.get("BENCH_WATCH_STEPS", "200"))
PERIOD = float(os.environ.get("BENCH_WATCH_PERIOD", "8"))
ROOT = Path(__file__).resolve().parents[2]


def _write(src: Path, steps: int, period: float, times: Path) -> None:
    """The writer: one step every ``period`` s; ``times`` gets ``{"step", "written"}`` lines."""
    from mismatch_probe.ingest import ProbeWriter

    writer = ProbeWriter(src, max_off_policy_steps=0)
    rng = np.random.default_rng(0)
    rows = TOKENS_PER_STEP // RESPONSE
    tokens = rng.integers(0, 50_000, (rows, RESPONSE))
    mask = np.ones((rows, RESPONSE), bool)
    for step in range(1, steps + 1):
        start = time.monotonic()
        rollout = np.log(rng.uniform(0.01, 1.0, (rows, RESPONSE)))
        train = np.minimum(rollout + rng.normal(0, 0.01, (rows, RESPONSE)), -1e-6)
        writer.write_step(step, tokens, mask, rollout, train, complete=True)
        with times.open("a") as fh:
            fh.write(json.dumps({"step": step, "written": time.time()}) + "\n")
        time.sleep(max(period - (time.monotonic() - start), 0.0))


def _rss_mb(pid: int) -> float:
    import psutil

    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20
    except psutil.Error:
        return 0.0


def bench_watch() -> dict[str, Any]:
    import multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        src, run, times = Path(tmp) / "logs", Path(tmp) / "run", Path(tmp) / "written.jsonl"
        writer = mp.get_context("spawn").Process(target=_write, args=(src, STEPS, PERIOD, times))
        writer.start()
        args = ["watch", "probe", str(src), "--out", str(run), "--until", str(STEPS),
                "--interval", "0.5"]  # fmt: skip
        command = [sys.executable, "-m", "mismatch_probe.cli", *args]
        watch = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
        samples: list[tuple[int, float]] = []  # (steps stored, rss)
        log = run / "steps.jsonl"
        while watch.poll() is None:
            stored = len(log.read_text().splitlines()) if log.exists() else 0
            samples.append((stored, _rss_mb(watch.pid)))
            if stored >= STEPS:
                break
            time.sleep(0.5)
        finish_start = time.monotonic()
        _, err = watch.communicate(timeout=3600)
        finish_s = time.monotonic() - finish_start
        writer.join()
        if watch.returncode:
            raise RuntimeError(f"probe watch exited {watch.returncode}: {err}")
        written = {d["step"]: d["written"] for d in map(json.loads, times.read_text().split())}
        lines = [json.loads(x) for x in log.read_text().splitlines()]
    stored = {x["step"]: x["time"] for x in lines}
    latency = [stored[s] - written[s] for s in sorted(stored)]
    fifth = max(len(latency) // 5, 1)
    early = [r for n, r in samples if 0 < n <= fifth]
    late = [r for n, r in samples if n > len(latency) - fifth]
    out = {
        "steps": len(lines),
        "tokens_per_step": TOKENS_PER_STEP,
        "writer_period_s": PERIOD,
        "latency_first_fifth_median_s": float(np.median(latency[:fifth])),
        "latency_last_fifth_median_s": float(np.median(latency[-fifth:])),
        "latency_max_s": float(max(latency)),
        "peak_rss_first_fifth_mb": max(early, default=0.0),
        "peak_rss_last_fifth_mb": max(late, default=0.0),
        "final_report_s": finish_s,
    }
    out["latency_ratio_last_over_first"] = (
        out["latency_last_fifth_median_s"] / out["latency_first_fifth_median_s"]
    )
    out["peak_rss_ratio_last_over_first"] = (
        out["peak_rss_last_fifth_mb"] / out["peak_rss_first_fifth_mb"]
        if out["peak_rss_first_fifth_mb"]
        else 0.0
    )
    return out
