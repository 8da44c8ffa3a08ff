"""What ``--attribute`` costs: the same scan (embedded default model, 16 prompts, 64 tokens,
bf16 rollout vs fp32 training, raw log-probs) without and with it, one after the other.

Reported: each scan's phases, the extra seconds (engine prefill batched and one at a time,
rescoring at the rollout dtype) and the ratios of the totals and of the extra work to the
generation it attributes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.scan import run_scan
from mismatch_probe.sampling import SamplingSpec

EXTRA_PHASES = ("attribution_prefill", "attribution_rescoring")


def _timings(attribute: bool) -> tuple[dict[str, float], float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ScanConfig(
            num_prompts=16,
            sampling=SamplingSpec(max_tokens=64, logprobs_mode="raw"),
            out=Path(tmp),
            attribute=attribute,
        )
        result = run_scan(cfg, Console(stderr=True))
    return dict(result.run["timings"]), result.metrics["num_tokens"]


def bench_attribution() -> dict[str, Any]:
    plain, tokens = _timings(attribute=False)
    attributed, _ = _timings(attribute=True)
    extra = {p: attributed.get(p, 0.0) for p in EXTRA_PHASES}
    total_plain, total_attr = sum(plain.values()), sum(attributed.values())
    return {
        "response_tokens": tokens,
        "without": {"seconds": plain, "total_seconds": total_plain},
        "with": {"seconds": attributed, "total_seconds": total_attr},
        "extra_seconds": extra,
        "total_ratio": total_attr / total_plain,
        "extra_over_generation": sum(extra.values()) / attributed["generation"],
    }
