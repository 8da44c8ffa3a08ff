"""A scan's time split on the embedded default model: engine start, generation, rescoring,
writing, metrics (a shorter scan than the demo: 16 prompts, 64 tokens)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.scan import run_scan
from mismatch_probe.sampling import SamplingSpec


def bench_scan() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ScanConfig(num_prompts=16, sampling=SamplingSpec(max_tokens=64), out=Path(tmp))
        result = run_scan(cfg, Console(stderr=True))
    timings = result.run["timings"]
    tokens = result.metrics["num_tokens"]
    return {
        "setting": cfg.settings()[0].name,
        "response_tokens": tokens,
        "seconds": timings,
        "total_seconds": sum(timings.values()),
        "generation_tokens_per_s": tokens / timings["generation"],
        "rescoring_tokens_per_s": tokens / timings["rescoring"],
    }
