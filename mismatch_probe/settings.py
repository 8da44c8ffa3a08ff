"""Precision settings: what one rollout engine and one training forward run with.

A scan runs the cross product of the requested precision choices. Each ``RolloutSetting``
(dtype, KV-cache dtype, weight quantization, FP32 LM head) gets its own engine and samples its
own tokens; each ``Setting`` pairs a rollout setting with a training dtype and is rescored once.
Names are short and readable, e.g. ``rollout=bf16,kv=fp8 | train=fp32``; a default choice
(``kv=auto``, no quantization, model-dtype head) is left out of the name.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mismatch_probe.errors import ProbeError

DTYPES = ("float32", "float16", "bfloat16")
DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("none", "fp8")
REPLAY_MODES = ("none", "rollout")
ON_OFF = {"off": False, "on": True}


@dataclass(frozen=True)
class RolloutSetting:
    """How the rollout engine runs."""

    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    quantization: str = "none"
    lm_head_fp32: bool = False

    @property
    def name(self) -> str:
        parts = [f"rollout={DTYPE_SHORT[self.dtype]}"]
        parts += [f"{key}={value}" for key, value in self._non_default().items()]
        return ",".join(parts)

    def _non_default(self) -> dict[str, str]:
        labels = {
            "kv": self.kv_cache_dtype if self.kv_cache_dtype != "auto" else None,
            "quant": self.quantization if self.quantization != "none" else None,
            "head": "fp32" if self.lm_head_fp32 else None,
        }
        return {k: v for k, v in labels.items() if v is not None}

    def engine_overrides(self) -> dict[str, Any]:
        """vLLM engine arguments for this setting (on top of the scan's own)."""
        overrides: dict[str, Any] = {"dtype": self.dtype}
        for key, (active, make) in _ENGINE_OVERRIDES.items():
            if active(self):
                overrides[key] = make(self)
        return overrides


# engine argument -> (is it set for this setting?, its value)
_ENGINE_OVERRIDES: dict[str, tuple[Callable[[RolloutSetting], bool], Callable[..., Any]]] = {
    "kv_cache_dtype": (lambda s: s.kv_cache_dtype != "auto", lambda s: s.kv_cache_dtype),
    "quantization": (lambda s: s.quantization != "none", lambda s: s.quantization),
    "hf_overrides": (lambda s: s.lm_head_fp32, lambda s: {"head_dtype": "float32"}),
}


@dataclass(frozen=True)
class Setting:
    """A rollout setting paired with a training dtype: one column of the comparison."""

    rollout: RolloutSetting
    train_dtype: str = "float32"
    replay: str = "none"  # MoE routing replay in the training forward ("rollout": R3)

    @property
    def name(self) -> str:
        replay = f",replay={self.replay}" if self.replay != "none" else ""
        return f"{self.rollout.name} | train={DTYPE_SHORT[self.train_dtype]}{replay}"


def split_list(text: str, option: str) -> tuple[str, ...]:
    """``"a, b,a"`` -> ``("a", "b")``: order kept, duplicates dropped (values checked by the
    config); an empty element (``"a,,b"``, ``"a,"``) is an error, not dropped."""
    values = [v.strip() for v in text.split(",")]
    if "" in values and text.strip():
        raise ProbeError(f"{option}: empty element in {text!r}")
    return tuple(dict.fromkeys(v for v in values if v))


def parse_on_off(text: str, option: str) -> tuple[bool, ...]:
    """``"off,on"`` -> ``(False, True)``."""
    values = split_list(text, option)
    bad = [v for v in values if v not in ON_OFF]
    if bad or not values:
        raise ProbeError(f"{option}: expected off, on or off,on, got {text!r}")
    return tuple(ON_OFF[v] for v in values)


def rollout_settings(
    dtypes: Sequence[str],
    kv_cache_dtypes: Sequence[str] = ("auto",),
    quantizations: Sequence[str] = ("none",),
    lm_head_fp32: Sequence[bool] = (False,),
) -> list[RolloutSetting]:
    """The cross product, in the order the choices were given (first = the reference)."""
    product = itertools.product(dtypes, kv_cache_dtypes, quantizations, lm_head_fp32)
    return [RolloutSetting(*combo) for combo in product]


def settings(
    rollouts: Sequence[RolloutSetting],
    train_dtypes: Sequence[str],
    replays: Sequence[str] = ("none",),
) -> list[Setting]:
    return [Setting(r, t, m) for r in rollouts for t in train_dtypes for m in replays]
