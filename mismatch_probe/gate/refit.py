"""``probe check`` on a refit run: the weight audit and the gated links of ``refit.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GATED_LINKS = ("refit", "stale_prefix_cache")
DEFAULT_MAX_LINK = 1e-6
AUDIT_LISTS = ("mismatched", "missing", "unexpected")


@dataclass(frozen=True)
class RefitGate:
    """The verdict: ``failures`` one line each (empty: passed)."""

    failures: list[str] = field(default_factory=list)
    max_link: float = DEFAULT_MAX_LINK

    @property
    def passed(self) -> bool:
        return not self.failures


def gate_refit(data: dict[str, Any], max_link: float = DEFAULT_MAX_LINK) -> RefitGate:
    """Fail on any mismatched, missing or unexpected tensor, on a broken audit (its negative
    control not named), and on a gated link whose ``k3_kl`` is above ``max_link``; every
    setting of a run of several, each failure prefixed by its setting's name."""
    parts = data.get("settings")
    if not isinstance(parts, list):
        return RefitGate(_failures(data, max_link), max_link)
    failures = [f"[{p.get('setting', '?')}] {f}" for p in parts for f in _failures(p, max_link)]
    return RefitGate(failures, max_link)


def _failures(data: dict[str, Any], max_link: float) -> list[str]:
    """One setting's failures."""
    audit = data.get("audit", {})
    failures = []
    for key in AUDIT_LISTS:
        names = audit.get(key) or []
        if names:
            shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
            failures.append(f"audit: {len(names)} {key} tensor(s): {shown}")
    control = audit.get("negative_control") or {}
    if not control.get("named", False):
        failures.append(
            f"audit broken: the negative control ({control.get('tensor') or 'no tensor'}, "
            "perturbed on purpose) was not named as mismatched"
        )
    fresh = audit.get("fresh_vs_checkpoint_mismatched") or []
    if fresh:
        failures.append(
            f"audit broken: the fresh engine itself differs from the checkpoint in {len(fresh)} "
            f"tensor(s) by the name mapping ({', '.join(fresh[:3])})"
        )
    elif audit.get("broken") and control.get("named", False):
        failures.append("audit broken (refit.json says so)")
    for name in GATED_LINKS:
        link = data.get("links", {}).get(name)
        if link is None:
            failures.append(f"link {name}: not measured")
        elif float(link.get("k3_kl", 0.0)) > max_link:
            failures.append(f"link {name}: k3_kl {link['k3_kl']:.3g} > --max-link {max_link:g}")
    return failures
