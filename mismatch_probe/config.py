"""``ScanConfig``: every setting of a scan, validated once when built, then passed down."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.sampling import SamplingSpec

DTYPES = ("float32", "float16", "bfloat16")
DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

# Support-flip margin by rollout dtype: about one unit in the last place of a probability near
# 1, so a boundary within the rollout's own rounding error counts as a possible flip.
FLIP_EPS = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 8e-3}


def check_dtype(value: str, option: str) -> str:
    if value not in DTYPES:
        raise ProbeError(f"{option}: unknown dtype {value!r}; choose from {', '.join(DTYPES)}")
    return value


@dataclass(frozen=True)
class ScanConfig:
    """One ``probe scan``. ``model=None`` and ``prompts=None`` mean the embedded defaults."""

    model: Path | None = None
    prompts: Path | None = None
    num_prompts: int | None = None
    samples_per_prompt: int = 1
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    rollout_dtype: str = "bfloat16"
    train_dtype: str = "float32"
    chat: bool | None = None  # None: on when the tokenizer has a chat template
    out: Path | None = None
    vllm_args: dict[str, Any] = field(default_factory=dict)
    batch_tokens: int = 8192
    flip_eps: float | None = None  # None: FLIP_EPS[rollout_dtype]

    def __post_init__(self) -> None:
        s = self.sampling
        check_dtype(self.rollout_dtype, "--rollout-dtype")
        check_dtype(self.train_dtype, "--train-dtype")
        checks = [
            (s.max_tokens >= 1, f"--max-tokens must be >= 1, got {s.max_tokens}"),
            (self.samples_per_prompt >= 1, "--samples-per-prompt must be >= 1"),
            (self.num_prompts is None or self.num_prompts >= 1, "--num-prompts must be >= 1"),
            (s.temperature >= 0, f"--temperature must be >= 0, got {s.temperature}"),
            (0 < s.top_p <= 1, f"--top-p must be in (0, 1], got {s.top_p}"),
            (s.top_k == -1 or s.top_k >= 1, f"--top-k must be -1 (off) or >= 1, got {s.top_k}"),
            (self.batch_tokens >= 1, "--batch-tokens must be >= 1"),
            (self.flip_eps is None or self.flip_eps >= 0, "--flip-eps must be >= 0"),
            (s.logprobs_mode in ("processed", "raw"), "--logprobs-mode: processed or raw"),
        ]
        for ok, message in checks:
            if not ok:
                raise ProbeError(message)

    @property
    def setting(self) -> str:
        """Readable name of this rollout/training precision pair."""
        return f"rollout={DTYPE_SHORT[self.rollout_dtype]} | train={DTYPE_SHORT[self.train_dtype]}"

    @property
    def resolved_flip_eps(self) -> float:
        return FLIP_EPS[self.rollout_dtype] if self.flip_eps is None else self.flip_eps

    def out_dir(self, model_name: str) -> Path:
        if self.out is not None:
            return self.out
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name)
        return Path("reports") / f"{safe}-{stamp}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["setting"] = self.setting
        d["flip_eps"] = self.resolved_flip_eps
        return d
