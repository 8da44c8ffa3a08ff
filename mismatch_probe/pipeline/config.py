"""``ScanConfig``: every setting of a scan, validated once when built, then passed down."""

from __future__ import annotations

import math
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
from mismatch_probe.training.devices import DEVICE_MAPS

# Support-flip margin by dtype: about one unit in the last place of a probability near 1, so a
# boundary within either side's rounding error counts as a possible flip.
FLIP_EPS = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 8e-3}
# The float options, which must be finite numbers (the engine rejects infinity only after it
# has started; NaN passes every comparison): option -> its value in a config.
FLOAT_OPTIONS = {
    "--temperature": lambda cfg: cfg.sampling.temperature,
    "--top-p": lambda cfg: cfg.sampling.top_p,
    "--flip-eps": lambda cfg: cfg.flip_eps,
}


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
    prompt_ids: tuple[int, ...] | None = None  # only these prompts (their store prompt_id)
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
    force: bool = False  # write into an --out that holds a run already
    attribute: bool = False  # score the same tokens at every rung (attribution spec)
    stale_model: Path | None = None  # --attribute: a later checkpoint (the staleness rung)
    batch_invariant: bool = False  # --vllm-arg VLLM_BATCH_INVARIANT=1 (set around engine starts)
    train_device_map: str | None = None  # devices.DEVICE_MAPS; None: devices.default_device_map
    shards: int = 1  # > 1: a sharded scan (sharding.py), one part of the store per shard
    ray: str | None = None  # run the shards as Ray tasks: "local" or a cluster address
    resume: bool = False  # sharded: skip the finished shards of the same --out
    verbose: bool = False  # the engines' logs on the terminal instead of a log file

    def __post_init__(self) -> None:
        s = self.sampling
        for option, value in FLOAT_OPTIONS.items():
            number = value(self)
            if number is not None and not math.isfinite(number):
                raise ProbeError(f"{option} must be a finite number, got {number}")
        _check_all(self.rollout_dtypes, DTYPES, "--rollout-dtype")
        _check_all(self.train_dtypes, DTYPES, "--train-dtype")
        _check_all(self.kv_cache_dtypes, KV_CACHE_DTYPES, "--kv-cache-dtype")
        _check_all(self.quantizations, QUANTIZATIONS, "--quantization")
        _check_all(self.lm_head_fp32, (False, True), "--lm-head-fp32")
        _check_all(self.routing_replay, REPLAY_MODES, "--routing-replay")
        if self.train_device_map is not None:
            _check_all((self.train_device_map,), DEVICE_MAPS, "--train-device-map")
        checks = [
            (s.max_tokens >= 1, f"--max-tokens must be >= 1, got {s.max_tokens}"),
            (self.samples_per_prompt >= 1, "--samples-per-prompt must be >= 1"),
            (self.num_prompts is None or self.num_prompts >= 1, "--num-prompts must be >= 1"),
            (
                self.prompt_ids is None or self.num_prompts is None,
                "--prompt-id and --num-prompts: give one or the other",
            ),
            (
                self.prompt_ids is None or (bool(self.prompt_ids) and min(self.prompt_ids) >= 0),
                f"--prompt-id must be >= 0, got {self.prompt_ids}",
            ),
            (s.temperature >= 0, f"--temperature must be >= 0, got {s.temperature}"),
            (0 < s.top_p <= 1, f"--top-p must be in (0, 1], got {s.top_p}"),
            (s.top_k == -1 or s.top_k >= 1, f"--top-k must be -1 (off) or >= 1, got {s.top_k}"),
            (self.batch_tokens >= 1, "--batch-tokens must be >= 1"),
            (self.flip_eps is None or self.flip_eps >= 0, "--flip-eps must be >= 0"),
            (s.logprobs_mode in ("processed", "raw"), "--logprobs-mode: processed or raw"),
            (self.shards >= 1, f"--shards must be >= 1, got {self.shards}"),
            (not self.resume or self.out is not None, "--resume needs the --out of the run"),
            (not self.resume or self.sharded, "--resume applies to a sharded scan (--shards)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ProbeError(message)
        if self.vllm_args:
            from mismatch_probe.engine.args import check_engine_args

            check_engine_args(self.vllm_args)

    @property
    def sharded(self) -> bool:
        """A scan split into shards (``--shards N`` with N > 1, or run on Ray)."""
        return self.shards > 1 or self.ray is not None

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
        for name in ("model", "prompts", "out"):  # resolved: the run can be found again
            if d[name] is not None:
                d[name] = str(Path(d[name]).resolve())
        d["settings"] = [s.name for s in self.settings()]
        return d
