"""``probe watch`` keeping up with a writer of ``TOKENS_PER_STEP`` (1M) trained tokens per step.

A writer process (``ProbeWriter``, the hook's own format) writes ``STEPS`` steps
(``BENCH_WATCH_STEPS``; ``BENCH_WATCH_TOKENS`` sets the tokens per step) while ``probe watch``
follows it in a process of its own, its RSS sampled every half second. The writer stays at most
``AHEAD`` steps ahead of what watch has stored, so watch is never idle: the time between two
stored steps is watch's time per step. Reported: the writer's and watch's median time per step
(watch keeps up with a trainer whose steps take longer than its own), watch's median time per
step and peak RSS in the first and the last fifth of the steps, and their ratios (last over
first: about 1 when time and memory stay flat over the steps). The final report (one pass over
the whole store, as ``probe report``) is timed apart.
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

TOKENS_PER_STEP = int(os.environ.get("BENCH_WATCH_TOKENS", "1000000"))
RESPONSE = 500  # tokens per response: 2,000 responses per step
STEPS = int(os.environ.get("BENCH_WATCH_STEPS", "200"))
AHEAD = 2
ROOT = Path(__file__).resolve().parents[2]


def _stored(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def _write(src: Path, log: Path, steps: int, times: Path) -> None:
    """The writer: step after step, at most ``AHEAD`` ahead of ``log``'s stored steps;
    ``times`` gets each step's write time."""
    from mismatch_probe.ingest import ProbeWriter

    writer = ProbeWriter(src, max_off_policy_steps=0)
    rng = np.random.default_rng(0)
    rows = TOKENS_PER_STEP // RESPONSE
    tokens = rng.integers(0, 50_000, (rows, RESPONSE))
    mask = np.ones((rows, RESPONSE), bool)
    for step in range(1, steps + 1):
        while step - _stored(log) > AHEAD:
            time.sleep(0.2)
        start = time.monotonic()
        rollout = np.log(rng.uniform(0.01, 1.0, (rows, RESPONSE)))
        train = np.minimum(rollout + rng.normal(0, 0.01, (rows, RESPONSE)), -1e-6)
        writer.write_step(step, tokens, mask, rollout, train, complete=True)
        with times.open("a") as fh:
            fh.write(json.dumps({"step": step, "s": time.monotonic() - start}) + "\n")


def _rss_mb(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return 0.0


def _follow(watch: subprocess.Popen, log: Path) -> list[tuple[int, float]]:
    """``(steps stored, RSS)`` every half second until every step is stored."""
    samples = []
    while watch.poll() is None:
        stored = _stored(log)
        samples.append((stored, _rss_mb(watch.pid)))
        if stored >= STEPS:
            break
        time.sleep(0.5)
    return samples


def bench_watch() -> dict[str, Any]:
    import multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        src, run, times = Path(tmp) / "logs", Path(tmp) / "run", Path(tmp) / "written.jsonl"
        log = run / "steps.jsonl"
        writer = mp.get_context("spawn").Process(target=_write, args=(src, log, STEPS, times))
        writer.start()
        args = ["watch", "probe", str(src), "--out", str(run), "--until", str(STEPS),
                "--interval", "0.2"]  # fmt: skip
        command = [sys.executable, "-m", "mismatch_probe.cli", *args]
        watch = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            samples = _follow(watch, log)
            finish_start = time.monotonic()
            _, err = watch.communicate(timeout=3600)
            finish_s = time.monotonic() - finish_start
        finally:
            if watch.poll() is None:
                watch.kill()
            writer.join(timeout=60)
            if writer.is_alive():
                writer.kill()
        if watch.returncode:
            raise RuntimeError(f"probe watch exited {watch.returncode}: {err}")
        written = [json.loads(x)["s"] for x in times.read_text().splitlines()]
        stored = [json.loads(x)["time"] for x in log.read_text().splitlines()]
    per_step = np.diff(stored)  # watch busy throughout: its time per step
    fifth = max(len(per_step) // 5, 1)
    early = [r for n, r in samples if 0 < n <= fifth]
    late = [r for n, r in samples if n > len(stored) - fifth]
    out: dict[str, Any] = {
        "steps": len(stored),
        "tokens_per_step": TOKENS_PER_STEP,
        "writer_s_per_step_median": float(np.median(written)),
        "watch_s_per_step_median": float(np.median(per_step)),
        "watch_s_per_step_first_fifth": float(np.median(per_step[:fifth])),
        "watch_s_per_step_last_fifth": float(np.median(per_step[-fifth:])),
        "peak_rss_first_fifth_mb": max(early, default=0.0),
        "peak_rss_last_fifth_mb": max(late, default=0.0),
        "final_report_s": finish_s,
    }
    out["time_ratio_last_over_first"] = (
        out["watch_s_per_step_last_fifth"] / out["watch_s_per_step_first_fifth"]
    )
    first_rss = out["peak_rss_first_fifth_mb"]
    out["peak_rss_ratio_last_over_first"] = (
        out["peak_rss_last_fifth_mb"] / first_rss if first_rss else 0.0
    )
    return out
