"""The rules of the values an option takes, shared by every config that takes the option
(``pipeline.config.ScanConfig``, ``ingest.records.IngestConfig``): one table, checked once when
a config is built."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from mismatch_probe.errors import ProbeError

# The rules of each option that takes one value: option -> (does the value hold, what a valid
# value is). ``check_options`` first
# refuses a float that is not finite (the engine rejects infinity only after it has started; NaN
# passes every comparison), then applies the rule. None (an unset optional value) passes.
OPTION_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "--max-tokens": (lambda v: v >= 1, ">= 1"),
    "--samples-per-prompt": (lambda v: v >= 1, ">= 1"),
    "--num-prompts": (lambda v: v >= 1, ">= 1"),
    "--temperature": (lambda v: v >= 0, ">= 0"),
    "--top-p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "--top-k": (lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"),
    "--batch-tokens": (lambda v: v >= 1, ">= 1"),
    "--flip-eps": (lambda v: v >= 0, ">= 0"),
    "--shards": (lambda v: v >= 1, ">= 1"),
    "--ray-timeout": (lambda v: v > 0, "> 0 seconds"),
}


def check_options(values: Mapping[str, Any]) -> None:
    """Each ``option -> value`` against ``OPTION_RULES`` (see there); one line on the first
    value that fails."""
    for option, value in values.items():
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ProbeError(f"{option} must be a finite number, got {value}")
        holds, valid = OPTION_RULES[option]
        if not holds(value):
            raise ProbeError(f"{option} must be {valid}, got {value}")


def check_choices(values: tuple[Any, ...], allowed: tuple[Any, ...], option: str) -> None:
    if not values:
        raise ProbeError(f"{option}: give at least one value")
    for value in values:
        if value not in allowed:
            choices = ", ".join(map(str, allowed))
            raise ProbeError(f"{option}: unknown value {value!r}; choose from {choices}")
