"""What ``--layers`` costs: the same scan (embedded default model, 16 prompts, 64 tokens, bf16
rollout vs fp32 training) without and with it, one after the other.

Reported: each scan's phases, the extra seconds (the engine capture prefill, the training-side
hidden states and comparison, the transformers precision view) and the ratios of the totals and
of the extra work to the generation.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.scan import run_scan
from mismatch_probe.sampling import SamplingSpec

EXTRA_PHASES = ("layers_capture", "layers_compare", "layers_views")


def _timings(layers: bool) -> tuple[dict[str, float], float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ScanConfig(
            num_prompts=16, sampling=SamplingSpec(max_tokens=64), out=Path(tmp), layers=layers
        )
        result = run_scan(cfg, Console(stderr=True))
    return dict(result.run["timings"]), result.metrics["num_tokens"]


def bench_layers() -> dict[str, Any]:
    plain, tokens = _timings(layers=False)
    probed, _ = _timings(layers=True)
    extra = {p: probed.get(p, 0.0) for p in EXTRA_PHASES}
    total_plain, total_probed = sum(plain.values()), sum(probed.values())
    return {
        "response_tokens": tokens,
        "without": {"seconds": plain, "total_seconds": total_plain},
        "with": {"seconds": probed, "total_seconds": total_probed},
        "extra_seconds": extra,
        "total_ratio": total_probed / total_plain,
        "extra_over_generation": sum(extra.values()) / probed["generation"],
    }
