"""The one order of a precision matrix's settings, in every output.

The scan's terminal summary, ``probe report``'s terminal, ``report.md``, ``report.html`` and the
PR comment list a matrix's settings in this order: the settings that fail more health checks
(``verdicts.HEALTH_CHECKS``) first, then the least mismatch (``k3_kl``), then by name. What needs
attention is at the top; among settings that pass, the cheapest correction is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from mismatch_probe.metrics.verdicts import FAIL, evaluate

T = TypeVar("T")


def setting_key(name: str, metrics: Mapping[str, float]) -> tuple[int, float, str]:
    """The sort key of one setting: (minus its failing checks, its ``k3_kl``, its name); a
    setting without a finite ``k3_kl`` sorts after those with one."""
    failing = sum(v.status == FAIL for v in evaluate(dict(metrics)))
    k3 = metrics.get("k3_kl")
    k3 = float(k3) if k3 is not None and not math.isnan(k3) else math.inf
    return (-failing, k3, name)


def in_setting_order(
    items: Iterable[T], name: Callable[[T], str], metrics: Callable[[T], Mapping[str, float]]
) -> list[T]:
    """``items`` (entries, judged settings, (name, metrics) pairs) sorted by ``setting_key``."""
    return sorted(items, key=lambda item: setting_key(name(item), metrics(item)))
