"""``probe refit`` against two plain scans of A and B, in the same run: tiny checkpoints (B is A
after one AdamW step), the bundled refit prompts, float32 engines and training side."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.refit import REFIT_PROMPTS, RefitConfig, run_refit
from mismatch_probe.pipeline.scan import run_scan
from mismatch_probe.sampling import SamplingSpec

PROMPTS, MAX_TOKENS = 8, 32


def checkpoint_pair(root: Path, tied: bool = False, arch: str = "llama") -> tuple[Path, Path]:
    """A tiny checkpoint A and B = A after one AdamW step on a language-modelling loss (the
    bench's pair and ``tests/test_refit.py``'s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mismatch_probe.models.tiny import build_tiny_model

    a, b = root / "A", root / "B"
    build_tiny_model(a, arch=arch, context=1024, tied=tied)
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    model.save_pretrained(b)
    AutoTokenizer.from_pretrained(a).save_pretrained(b)
    return a, b


def bench_refit() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a, b = checkpoint_pair(root)
        start = time.perf_counter()
        cfg = RefitConfig(a, b, root / "refit", num_prompts=PROMPTS, max_tokens=MAX_TOKENS)
        data = run_refit(cfg, None).data
        refit_seconds = time.perf_counter() - start
        scans = {}
        for name, model in (("A", a), ("B", b)):
            start = time.perf_counter()
            scan = ScanConfig(
                model=model,
                prompts=REFIT_PROMPTS,
                num_prompts=PROMPTS,
                sampling=SamplingSpec(max_tokens=MAX_TOKENS),
                rollout_dtypes=("float32",),
                out=root / f"scan-{name}",
            )
            run_scan(scan, Console(stderr=True))
            scans[name] = time.perf_counter() - start
    return {
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "refit_seconds": refit_seconds,
        "refit_phases": data["seconds"],
        "scan_a_seconds": scans["A"],
        "scan_b_seconds": scans["B"],
        "refit_over_two_scans": refit_seconds / (scans["A"] + scans["B"]),
    }
