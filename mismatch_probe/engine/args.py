"""``--vllm-arg`` checked before any engine starts: what probe sets itself is refused, and every
other argument must be one of vLLM's engine arguments with a value of its type.

vLLM takes ``LLM(**kwargs)`` and fails (or, worse, silently wins over probe's own settings) only
once the engine starts. Here each key is looked up in vLLM's ``EngineArgs`` dataclass (and the
few extra parameters of ``LLM.__init__``) and each value is checked against the field's type
annotation, so ``--vllm-arg max_num_seqs=abc`` is one line naming the argument, and
``--vllm-arg dtype=float32`` cannot relabel an fp32 engine as "rollout=bf16".
"""

from __future__ import annotations

import difflib
import json
import math
import types
import typing
from collections import abc
from typing import Any

from mismatch_probe.errors import ProbeError

# Engine arguments probe sets from its own options (``rollout.engine_kwargs`` and a setting's
# ``engine_overrides``): argument -> what to use instead. A test keeps this in step with them.
RESERVED: dict[str, str] = {
    "model": "--model",
    "tokenizer": "--model (the tokenizer comes with the checkpoint)",
    "dtype": "--rollout-dtype",
    "kv_cache_dtype": "--kv-cache-dtype",
    "quantization": "--quantization",
    "hf_overrides": "--lm-head-fp32 (probe sets hf_overrides for it)",
    "logprobs_mode": "--logprobs-mode",
    "seed": "--seed",
    "max_model_len": "--max-tokens (probe sets it from the longest prompt plus --max-tokens)",
    "generation_config": "--temperature, --top-p, --top-k and --max-tokens (probe passes every "
    "sampling parameter explicitly)",
    "enable_return_routed_experts": "--routing-replay (probe sets it for MoE route capture)",
}


def check_reserved(args: dict[str, Any]) -> None:
    """Refuse a key probe sets from its own options (no vLLM import: checked with the config).

    Raises:
        ProbeError: one line naming the ``--vllm-arg`` and the option to use instead.
    """
    for key in args:
        if key in RESERVED:
            raise ProbeError(f"--vllm-arg {key}: probe sets {key} itself; use {RESERVED[key]}")


def check_engine_args(args: dict[str, Any]) -> None:
    """Refuse a reserved key, an unknown key, or a value of the wrong type (imports vLLM for
    its engine arguments' types when ``args`` is not empty).

    Raises:
        ProbeError: one line naming the ``--vllm-arg`` and what to do instead.
    """
    check_reserved(args)
    if not args:
        return
    hints = engine_arg_types()
    for key, value in args.items():
        if key not in hints:
            near = difflib.get_close_matches(key, list(hints), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ProbeError(f"--vllm-arg {key}: vLLM has no engine argument {key!r}{hint}")
        if not fits(value, hints[key]):
            shown = json.dumps(value) if not isinstance(value, str) else value
            raise ProbeError(f"--vllm-arg {key}={shown}: expected {describe(hints[key])}")


def engine_arg_types() -> dict[str, Any]:
    """Every argument ``vllm.LLM`` accepts -> its type (``Any`` where it is not known)."""
    import dataclasses
    import inspect

    from mismatch_probe.engine.process import import_vllm_quietly

    import_vllm_quietly()  # the first vLLM import of a scan given --vllm-arg: keep it quiet
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    hints: dict[str, Any] = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
    for name, param in inspect.signature(LLM.__init__).parameters.items():
        if name not in hints and param.kind is param.KEYWORD_ONLY:
            hints[name] = Any
    return hints


def fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value can be ``hint``; True where the type is not one JSON can check
    (a config class, a callable): vLLM converts and checks those itself."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Annotated:
        return fits(value, args[0])
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    checks = {
        type(None): lambda v: v is None,
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: (
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        ),
        str: lambda v: isinstance(v, str),
    }
    base = origin or hint
    if base in checks:
        return bool(checks[base](value))
    if base in (list, tuple, set, frozenset, abc.Sequence):
        return isinstance(value, list)
    if base in (dict, abc.Mapping):
        return isinstance(value, dict)
    # A JSON value is never a function; Any or a config class: vLLM builds and checks it.
    return base is not abc.Callable


WORDS = {
    type(None): "null",
    bool: "true or false",
    int: "an integer",
    float: "a finite number",
    str: "a string",
    list: "a JSON list",
    tuple: "a JSON list",
    set: "a JSON list",
    dict: "a JSON object",
}


def describe(hint: Any) -> str:
    """``int | None`` -> ``an integer or null``; a Literal -> ``one of 'a', 'b'``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Annotated:
        return describe(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(arg) for arg in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    base = origin or hint
    return WORDS.get(base, getattr(base, "__name__", str(base)))
