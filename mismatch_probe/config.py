"""``ScanConfig``: every setting of a scan, validated once when built, then passed down."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.settings import (
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REPLAY_MODES,
    RolloutSetting,
    Setting,
    rollout_settings,
    settings,
)

# Support-flip margin by dtype: about one unit in the last place of a probability near 1, so a
# boundary within either side's rounding error counts as a possible flip.
FLIP_EPS = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 8e-3}


def _check_all(values: tuple[Any, ...], allowed: tuple[Any, ...], option: str) -> None:
    if not values:
        raise ProbeError(f"{option}: give at least one value")
    for value in values:
        if value not in allowed:
            choices = ", ".join(map(str, allowed))
            raise ProbeError(f"{option}: unknown value {value!r}; choose from {choices}")


@dataclass(frozen=True)
class ScanConfig:
    """One ``probe scan``. ``model=None`` and ``prompts=None`` mean the embedded defaults."""

    model: Path | None = None
    prompts: Path | None = None
    num_prompts: int | None = None
    samples_per_prompt: int = 1
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    rollout_dtypes: tuple[str, ...] = ("bfloat16",)
    train_dtypes: tuple[str, ...] = ("float32",)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    quantizations: tuple[str, ...] = ("none",)
    lm_head_fp32: tuple[bool, ...] = (False,)
    routing_replay: tuple[str, ...] = ("none",)  # MoE: none (own routes), rollout (R3)
    same_tokens: bool = False  # later rollout settings score the first one's tokens
    strict: bool = False  # a setting the backend cannot run is an error, not a skip
    chat: bool | None = None  # None: on when the tokenizer has a chat template
    out: Path | None = None
    vllm_args: dict[str, Any] = field(default_factory=dict)
    batch_tokens: int = 2048
    flip_eps: float | None = None  # None: FLIP_EPS[rollout dtype]
    verbose: bool = False  # the engines' logs on the terminal instead of a log file

    def __post_init__(self) -> None:
        s = self.sampling
        _check_all(self.rollout_dtypes, DTYPES, "--rollout-dtype")
        _check_all(self.train_dtypes, DTYPES, "--train-dtype")
        _check_all(self.kv_cache_dtypes, KV_CACHE_DTYPES, "--kv-cache-dtype")
        _check_all(self.quantizations, QUANTIZATIONS, "--quantization")
        _check_all(self.lm_head_fp32, (False, True), "--lm-head-fp32")
        _check_all(self.routing_replay, REPLAY_MODES, "--routing-replay")
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

    def rollout_settings(self) -> list[RolloutSetting]:
        return rollout_settings(
            self.rollout_dtypes, self.kv_cache_dtypes, self.quantizations, self.lm_head_fp32
        )

    def settings(self) -> list[Setting]:
        return settings(self.rollout_settings(), self.train_dtypes, self.routing_replay)

    def flip_eps_for(self, setting: Setting) -> float:
        """The support-flip margin: the coarser of the two sides' dtypes, unless given."""
        if self.flip_eps is not None:
            return self.flip_eps
        return max(FLIP_EPS[setting.rollout.dtype], FLIP_EPS[setting.train_dtype])

    def rescoring_spec(self) -> SamplingSpec:
        """Forced continuations (``same_tokens``) give raw prefill log-probs: rescore raw."""
        return replace(self.sampling, logprobs_mode="raw") if self.same_tokens else self.sampling

    def out_dir(self, model_name: str) -> Path:
        if self.out is not None:
            return self.out
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name)
        return Path("reports") / f"{safe}-{stamp}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["settings"] = [s.name for s in self.settings()]
        return d
