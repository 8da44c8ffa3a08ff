"""A refit run rendered: the weight audit and the links (terminal, Markdown, PR comment), and
``probe check``'s verdict on it. Renders the ``refit.json`` view it is handed."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from mismatch_probe.gate.refit import RefitGate
from mismatch_probe.report.md import escape, table

LINK_MEANING = {
    "stale_prefix_cache": "the cache as the refit left it vs after reset_prefix_cache",
    "refit": "refitted engine (cache reset) vs a fresh engine on B",
    "engine_vs_train": "fresh engine on B vs the transformers forward on B",
    "cache_salt": "a cache_salt of B's weight version vs after the reset",
}


def _code(text: str) -> str:
    """A name as inline code (its own backticks dropped)."""
    return f"`{text.replace('`', '')}`"


def _number(value: Any) -> str:
    return f"{float(value):.3g}"


def _audit_line(audit: dict[str, Any]) -> str:
    counts = ", ".join(f"{len(audit.get(k) or [])} {k}" for k in ("mismatched", "missing",
                                                                  "unexpected"))  # fmt: skip
    control = audit.get("negative_control") or {}
    verdict = "named" if control.get("named") else "NOT named: the audit is broken"
    return (
        f"{len(audit.get('tensors') or [])} engine tensors: {counts}; negative control "
        f"{control.get('tensor') or '-'}: {verdict}"
    )


def link_rows(data: dict[str, Any]) -> list[list[str]]:
    """One row per link: name, what it compares, tokens, k3_kl, kl, max |diff|."""
    rows = []
    for name, link in data.get("links", {}).items():
        rows.append([name, LINK_MEANING.get(name, ""), str(link.get("tokens", 0)),
                     _number(link.get("k3_kl", 0)), _number(link.get("kl", 0)),
                     _number(link.get("max_abs", 0))])  # fmt: skip
    return rows


HEADERS = ["link", "compares", "tokens", "k3_kl", "kl", "max |diff|"]


def render_refit(data: dict[str, Any], console: Any) -> None:
    """The refit run on the terminal."""
    console.print(
        f"[bold]probe refit[/bold] {data.get('from')} -> {data.get('to')} "
        f"(--method {data.get('method')}, {data.get('engine_mode')} engine, "
        f"{data.get('rollout_dtype')})"
    )
    console.print(f"weight audit: {_audit_line(data.get('audit', {}))}")
    for key in ("mismatched", "missing", "unexpected"):
        for name in (data.get("audit", {}).get(key) or [])[:10]:
            console.print(f"  {key}: {name}")
    grid = Table(*HEADERS)
    for row in link_rows(data):
        grid.add_row(*row)
    console.print(grid)
    cached = data.get("cache", {}).get("warm_cached_tokens") or []
    console.print(f"after the refit, {sum(cached)} prompt tokens of {len(cached)} sequences "
                  "were read from the prefix cache")  # fmt: skip
    if cached and not any(cached):
        console.print("no cached block was read: the refit cleared the cache, or no prompt is "
                      "longer than a cache block")  # fmt: skip


def refit_markdown(data: dict[str, Any]) -> str:
    """The refit section of a report (Markdown), also the PR comment's body."""
    audit = data.get("audit", {})
    lines = [
        "## Refit",
        "",
        f"{_code(str(data.get('from')))} -> {_code(str(data.get('to')))}, "
        f"method `{data.get('method')}`, {data.get('engine_mode')} engine, "
        f"rollout {data.get('rollout_dtype')}, training {data.get('train_dtype')}.",
        "",
        f"**Weight audit:** {escape(_audit_line(audit))}.",
        "",
    ]
    for key in ("mismatched", "missing", "unexpected"):
        names = audit.get(key) or []
        if names:
            lines += [f"- {key}: " + ", ".join(_code(n) for n in names[:20]), ""]
    lines += [*table(HEADERS, link_rows(data), "llrrrr"), ""]
    return "\n".join(lines)


def refit_comment(data: dict[str, Any], gate: RefitGate) -> str:
    """The PR comment of a refit run: the verdict, then the section."""
    head = "passed" if gate.passed else "failed"
    body = [f"### probe refit: {head}", ""]
    body += [f"- {escape(f)}" for f in gate.failures]
    return "\n".join([*body, "", refit_markdown(data)])


def render_refit_gate(gate: RefitGate, console: Any) -> None:
    """``probe check``'s verdict on a refit run."""
    if gate.passed:
        console.print(f"refit check passed (audit clean, links <= {gate.max_link:g})")
        return
    console.print("[bold red]refit check failed[/bold red]")
    for failure in gate.failures:
        console.print(f"  {failure}")
