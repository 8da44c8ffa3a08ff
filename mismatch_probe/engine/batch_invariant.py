"""vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``): asked for, and can it run here?

Batch-invariant kernels make a sequence's log-probabilities independent of what else is in the
batch: on a GPU they remove the ``batch`` link of ``--attribute``. vLLM reads the variable from
the environment when the engine starts; ``probe`` also takes it as ``--vllm-arg
VLLM_BATCH_INVARIANT=1`` (then sets it around the engine start, not as an engine argument). The
vLLM CPU backend crashes at its first forward pass in this mode, so it is refused there before
any engine starts. ``run.json`` records whether the mode was on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mismatch_probe.errors import ProbeError

ENV = "VLLM_BATCH_INVARIANT"


def _parse(value: Any, where: str) -> bool:
    """vLLM's reading, ``bool(int(value))``; anything else is an error."""
    try:
        return bool(int(value))
    except (TypeError, ValueError):
        raise ProbeError(f"{where}: {ENV} must be an integer (0 or 1), got {value!r}") from None


def split_args(vllm_args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``--vllm-arg`` values without ``VLLM_BATCH_INVARIANT``, and whether it asked for it."""
    if ENV not in vllm_args:
        return vllm_args, False
    rest = {k: v for k, v in vllm_args.items() if k != ENV}
    return rest, _parse(vllm_args[ENV], "--vllm-arg")


def requested(from_args: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """Asked for by ``--vllm-arg`` or by the environment."""
    return from_args or (ENV in environ and _parse(environ[ENV], "environment"))


def check(from_args: bool) -> bool:
    """Whether the scan runs in batch-invariant mode.

    Raises:
        ProbeError: asked for on a backend that does not support it (the vLLM CPU backend).
    """
    if not requested(from_args):
        return False
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        raise ProbeError(
            f"{ENV}=1: vLLM's batch-invariant mode is not supported by the CPU backend (it "
            "crashes at the first forward pass); unset it or run on a GPU"
        )
    return True


def engine_env(from_args: bool) -> dict[str, str]:
    """``VLLM_BATCH_INVARIANT=1`` for the engine's environment when ``--vllm-arg`` asked for it
    (``rollout.engine`` scopes it to the engine's life)."""
    return {ENV: "1"} if from_args else {}
