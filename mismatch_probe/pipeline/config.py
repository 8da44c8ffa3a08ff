"""``ScanConfig``: every setting of a scan, validated once when built, then passed down."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from mismatch_probe.engine.args import check_reserved
from mismatch_probe.errors import ProbeError
from mismatch_probe.option_rules import check_choices, check_options
from mismatch_probe.sampling import FLIP_EPS, SamplingSpec
from mismatch_probe.settings import (
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REPLAY_MODES,
    RolloutSetting,
    Setting,
    parse_on_off,
    rollout_settings,
    settings,
    split_list,
)
from mismatch_probe.training.devices import DEVICE_MAPS

# The list options, given as comma-separated text: field -> (option name, parser).
LIST_OPTIONS: dict[str, tuple[str, Callable[[str, str], tuple[Any, ...]]]] = {
    "rollout_dtypes": ("rollout_dtype", split_list),
    "train_dtypes": ("train_dtype", split_list),
    "kv_cache_dtypes": ("kv_cache_dtype", split_list),
    "quantizations": ("quantization", split_list),
    "lm_head_fp32": ("lm_head_fp32", parse_on_off),
    "routing_replay": ("routing_replay", split_list),
}


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
    ray_timeout: float = 10.0  # seconds a Ray cluster has to answer (--ray ADDRESS)
    resume: bool = False  # sharded: skip the finished shards of the same --out
    verbose: bool = False  # the engines' logs on the terminal instead of a log file
    layers: bool = False  # compare both sides' residual streams layer by layer (issue 36)
    layers_sequences: int | None = None  # --layers: only the first K sequences (None: all)

    def __post_init__(self) -> None:
        s = self.sampling
        check_options(
            {
                "--max-tokens": s.max_tokens,
                "--samples-per-prompt": self.samples_per_prompt,
                "--num-prompts": self.num_prompts,
                "--temperature": s.temperature,
                "--top-p": s.top_p,
                "--top-k": s.top_k,
                "--batch-tokens": self.batch_tokens,
                "--flip-eps": self.flip_eps,
                "--shards": self.shards,
                "--ray-timeout": self.ray_timeout,
            }
        )
        check_choices(self.rollout_dtypes, DTYPES, "--rollout-dtype")
        check_choices(self.train_dtypes, DTYPES, "--train-dtype")
        check_choices(self.kv_cache_dtypes, KV_CACHE_DTYPES, "--kv-cache-dtype")
        check_choices(self.quantizations, QUANTIZATIONS, "--quantization")
        check_choices(self.lm_head_fp32, (False, True), "--lm-head-fp32")
        check_choices(self.routing_replay, REPLAY_MODES, "--routing-replay")
        if self.train_device_map is not None:
            check_choices((self.train_device_map,), DEVICE_MAPS, "--train-device-map")
        checks = [
            (
                self.prompt_ids is None or self.num_prompts is None,
                "--prompt-id and --num-prompts: give one or the other",
            ),
            (
                self.prompt_ids is None or (bool(self.prompt_ids) and min(self.prompt_ids) >= 0),
                f"--prompt-id must be >= 0, got {self.prompt_ids}",
            ),
            (s.logprobs_mode in ("processed", "raw"), "--logprobs-mode: processed or raw"),
            (not self.resume or self.out is not None, "--resume needs the --out of the run"),
            (not self.resume or self.sharded, "--resume applies to a sharded scan (--shards)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ProbeError(message)
        # The keys probe sets itself; the values' types are checked against vLLM's own engine
        # arguments once the path checks have passed (``scan.prepare``: vLLM is imported there).
        check_reserved(self.vllm_args)

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

    @classmethod
    def from_options(
        cls,
        *,
        temperature: float,
        top_p: float,
        top_k: int,
        max_tokens: int,
        seed: int,
        logprobs_mode: str | None,
        vllm_arg: list[str] | None,
        **options: Any,
    ) -> ScanConfig:
        """The one way ``probe scan``'s options become a config: the options as the command
        line gives them (the ``scan`` command's parameters, by name): lists as comma-separated
        text (``rollout_dtype="bfloat16,float16"``, ``lm_head_fp32="off,on"``), ``--vllm-arg``
        as ``key=value`` items (``VLLM_BATCH_INVARIANT`` taken out of them), the sampling
        options apart. ``logprobs_mode=None``: the default mode, or raw with ``attribute``
        (every rung of attribution needs raw log-probabilities). Every other option is the
        field of the same name.

        Raises:
            ProbeError: a malformed list or ``--vllm-arg``, or any check of ``__post_init__``.
        """
        from mismatch_probe.engine.batch_invariant import split_args
        from mismatch_probe.engine.rollout import parse_engine_args

        if logprobs_mode is None:
            logprobs_mode = "raw" if options.get("attribute") else SamplingSpec().logprobs_mode
        sampling = SamplingSpec(temperature, top_p, top_k, max_tokens, seed, logprobs_mode)  # type: ignore[arg-type]
        engine_args, invariant = split_args(parse_engine_args(vllm_arg or []))
        prompt_id = options.pop("prompt_id", None)  # repeatable: the prompts' store prompt_id
        lists: dict[str, Any] = {
            field: parse(options.pop(name), f"--{name.replace('_', '-')}")
            for field, (name, parse) in LIST_OPTIONS.items()
        }
        return cls(
            sampling=sampling,
            vllm_args=engine_args,
            batch_invariant=invariant,
            prompt_ids=tuple(prompt_id) if prompt_id else None,
            **lists,
            **options,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("model", "prompts", "out"):  # resolved: the run can be found again
            if d[name] is not None:
                d[name] = str(Path(d[name]).resolve())
        d["settings"] = [s.name for s in self.settings()]
        return d
