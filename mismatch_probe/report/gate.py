"""``probe check``'s output: a ``gate.Gate`` rendered for the terminal.

The data integrity first, the baseline and what differs, one line per bound (``result_line``,
``increase_line``; under a heading per setting for a matrix run), then a summary naming each
failing setting and metric and the integrity errors that fail the gate (``summary_line``). The
gate's numbers are ``gate.baseline``'s; this module only writes them.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from mismatch_probe.gate.baseline import Gate, IncreaseResult, ParityResult
from mismatch_probe.gate.bounds import BoundResult, shown
from mismatch_probe.report.sections import visible

SYMBOL = {"max": ("≤", ">"), "min": ("≥", "<")}  # (holds, fails)


def result_line(res: BoundResult) -> Text:
    """``✔ PASS  k3_kl = 0.0005 ≤ 0.001 (max)`` or ``✘ FAIL ... > 0.001 (max) by ...``."""
    b = res.bound
    ok, bad = SYMBOL[b.kind]
    head = Text("✔ PASS  ", style="green") if res.passed else Text("✘ FAIL  ", style="bold red")
    value = shown(res.value)  # "none": no layer diverges (first_divergent_layer)
    head.append(f"{b.metric} = {value} {ok if res.passed else bad} {b.limit:g} ({b.kind})")
    if not res.passed:
        times = f", {res.value / b.limit:.3g}× the bound" if b.limit else ""
        head.append(f" by {res.excess:.4g}{times}")
    return head


def _ci(pair: tuple[float, float]) -> str:
    return f"[{pair[0]:.4g}, {pair[1]:.4g}]"


def increase_line(res: IncreaseResult) -> Text:
    """``✔ PASS  k3_kl = 0.005 vs baseline 0.004: ×1.25 ≤ ×1.5 (max increase)``, then the
    intervals when there are, and why a point above the limit still passes (noise)."""
    b = res.bound
    head = Text("✔ PASS  ", style="green") if res.passed else Text("✘ FAIL  ", style="bold red")
    over = "≤" if res.point_passed else ">"
    head.append(
        f"{b.metric} = {res.value:.6g} vs baseline {res.base:.6g}: "
        f"{res.change()} {over} {b.text} (max increase)"
    )
    if not res.point_passed:
        head.append(f" by {res.value - res.limit:.4g}")
    if res.excess_ci is not None and res.head_ci and res.base_ci:
        pct = f"{res.level:.0%}"
        head.append(f"\n        {pct} CI: head {_ci(res.head_ci)}, baseline {_ci(res.base_ci)}; ")
        head.append(f"{b.excess_text()} in {_ci(res.excess_ci)}")
        if not res.point_passed:
            head.append(" (above 0: significant)" if not res.passed else " (includes 0: noise)")
    return head


def parity_line(res: ParityResult) -> Text:
    """``✔ PASS  exact: 0 of 1,536 tokens differ (parity/mismatch_count)`` or the failure with
    the first differing token (``seq_id``, ``position``, both log-probs)."""
    where = f" (setting {visible(res.setting)})" if res.setting is not None else ""
    head = Text("✔ PASS  ", style="green") if res.passed else Text("✘ FAIL  ", style="bold red")
    head.append(
        f"exact{where}: {res.mismatch_count:,} of {res.token_count:,} tokens differ in float32 "
        "(parity/mismatch_count)"
    )
    if res.first is not None:
        f = res.first
        head.append(
            f"; the first: seq_id {f['seq_id']}, position {f['position']}: train_logprob "
            f"{f['train_logprob']!r}, rollout_logprob {f['rollout_logprob']!r}"
        )
    return head


def render_gate(gate: Gate, console: Console) -> None:
    """The data integrity first, the baseline and what differs (if anything), one line per
    bound (under a heading per setting for a matrix run), and a summary naming each failing
    setting and metric, and the integrity errors that fail the gate."""
    from mismatch_probe.report.integrity import integrity_text

    if gate.integrity is not None:
        console.print(integrity_text(gate.integrity, gate.step, gate.accepted), highlight=False)
    if gate.baseline is not None:
        console.print(f"baseline {gate.baseline}", highlight=False, soft_wrap=True)
    for line in gate.differences:
        console.print(Text(f"⚠ {line}", style="yellow"), highlight=False)
    for one in gate.settings:
        indent = ""
        if one.setting is not None:
            mark = Text("✔ " if one.passed else "✘ ", style="green" if one.passed else "bold red")
            console.print(mark + Text(f"setting {visible(one.setting)}", style="bold"))
            indent = "  "
        for res in one.bounds:
            console.print(Text(indent) + result_line(res), highlight=False)
        for inc in one.increases:
            console.print(Text(indent) + increase_line(inc), highlight=False)
        if one.note:
            console.print(Text(f"{indent}· {one.note}", style="dim"), highlight=False)
    for par in gate.parity:
        console.print(parity_line(par), highlight=False, soft_wrap=True)
    console.print(summary_line(gate), highlight=False)


def summary_line(gate: Gate) -> str:
    """``all bounds hold`` (``... in 3 settings``), or how many failed and, for a matrix run,
    each failing setting with its failing metrics; then the integrity errors that fail."""
    results: list[BoundResult | IncreaseResult] = [*gate.bounds, *gate.increases]
    failed = sum(not r.passed for r in results)
    differ = sum(p.mismatch_count for p in gate.parity)
    exact = ""
    if gate.parity:
        plural = "s" if differ != 1 else ""
        exact = f"exact: {differ:,} differing token{plural}" if differ else "exact: bitwise equal"
    if not results:
        text = exact or "no bound evaluated (the metrics cannot be computed)"
    else:
        text = _bounds_summary(gate, failed, len(results)) + (f"; {exact}" if exact else "")
    if gate.integrity_errors:
        names = ", ".join(dict.fromkeys(f.check for f in gate.integrity_errors))
        text += f"; integrity error: {names} (--accept CHECK if it is known and harmless)"
    return text


def _bounds_summary(gate: Gate, failed: int, total: int) -> str:
    many = len(gate.settings) > 1 or gate.settings[0].setting is not None
    where = f" in {len(gate.settings)} setting{'s' if len(gate.settings) > 1 else ''}"
    if not failed:
        return "all bounds hold" + (where if many else "")
    text = f"{failed} of {total} bounds failed"
    if not many:
        return text
    bad = [s for s in gate.settings if not s.passed]
    named = "; ".join(f"{visible(str(s.setting))} ({', '.join(s.failing)})" for s in bad)
    return f"{text}{where}: {len(bad)} setting{'s' if len(bad) > 1 else ''} failed: {named}"
