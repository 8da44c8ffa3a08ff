"""A refit run rendered: the weight audit and the links (terminal, Markdown, HTML, PR comment),
and ``probe check``'s verdict on it. Renders the ``refit.json`` view it is handed (read by
``rundir.refit``); ``write_refit_reports`` writes ``report.md`` and ``report.html``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape as rich_escape
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


def _expert_note(audit: dict[str, Any]) -> str:
    """What the audit found about prepacked MoE experts ('' where nothing)."""
    names = audit.get("experts_not_repacked") or []
    if not names:
        return ""
    return (
        f"{len(names)} mismatched expert tensor(s) hold the checkpoint's values in the "
        "checkpoint's layout, not prepacked, while the CPU kernel reads them as prepacked (vLLM "
        "does not re-run the experts' prepack on a weight update)"
    )


def link_rows(data: dict[str, Any]) -> list[list[str]]:
    """One row per link: name, what it compares, tokens, k3_kl, kl, max |diff|."""
    rows = []
    found = data.get("links", {})
    order = [n for n in LINK_MEANING if n in found] + sorted(set(found) - set(LINK_MEANING))
    for name, link in ((n, found[n]) for n in order):  # refit.json's keys may come sorted
        rows.append([name, LINK_MEANING.get(name, ""), str(link.get("tokens", 0)),
                     _number(link.get("k3_kl", 0)), _number(link.get("kl", 0)),
                     _number(link.get("max_abs", 0))])  # fmt: skip
    return rows


HEADERS = ["link", "compares", "tokens", "k3_kl", "kl", "max |diff|"]


def render_refit(data: dict[str, Any], console: Any) -> None:
    """The refit run on the terminal: every setting's audit and links."""
    from mismatch_probe.rundir.refit import refit_settings

    parts = refit_settings(data)
    for part in parts:
        _render_setting(part, console, len(parts) > 1)


def _render_setting(data: dict[str, Any], console: Any, named: bool) -> None:
    setting = rich_escape(f" [{data.get('setting')}]") if named else ""
    console.print(
        f"[bold]probe refit[/bold]{setting} {data.get('from')} -> {data.get('to')} "
        f"(--method {data.get('method')}, {data.get('engine_mode')} engine, "
        f"rollout {data.get('rollout_dtype')}, training {data.get('train_dtype')})"
    )
    audit = data.get("audit", {})
    console.print(f"weight audit: {_audit_line(audit)}")
    for key in ("mismatched", "missing", "unexpected"):
        names = audit.get(key) or []
        for name in names[:10]:
            console.print(f"  {key}: {name}", markup=False, highlight=False)
        if len(names) > 10:
            console.print(f"  {key}: +{len(names) - 10} more (all in refit.json)")
    note = _expert_note(audit)
    if note:
        console.print(f"  {note}")
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
    """The refit section of a report (Markdown), also the PR comment's body: one section per
    setting of a run of several."""
    from mismatch_probe.rundir.refit import refit_settings

    parts = refit_settings(data)
    return "\n".join(_setting_markdown(p, len(parts) > 1) for p in parts)


def _setting_markdown(data: dict[str, Any], named: bool) -> str:
    audit = data.get("audit", {})
    title = f"## Refit: {escape(str(data.get('setting')))}" if named else "## Refit"
    lines = [
        title,
        "",
        f"{_code(str(data.get('from')))} -> {_code(str(data.get('to')))}, "
        f"method `{data.get('method')}`, {data.get('engine_mode')} engine, "
        f"rollout {data.get('rollout_dtype')}, KV cache {data.get('kv_cache_dtype', 'auto')}, "
        f"training {data.get('train_dtype')}.",
        "",
        f"**Weight audit:** {escape(_audit_line(audit))}.",
        "",
    ]
    for key in ("mismatched", "missing", "unexpected"):
        names = audit.get(key) or []
        if names:
            shown = ", ".join(_code(n) for n in names[:20])
            more = f" (+{len(names) - 20} more, all in refit.json)" if len(names) > 20 else ""
            lines += [f"- {key}: {shown}{more}", ""]
    note = _expert_note(audit)
    if note:
        lines += [f"{escape(note)}.", ""]
    headers = [h.replace("|", "\\|") for h in HEADERS]  # a pipe would end the cell
    lines += [*table(headers, link_rows(data), "llrrrr"), ""]
    return "\n".join(lines)


def refit_title(data: dict[str, Any]) -> str:
    return f"Refit report: {data.get('from')} -> {data.get('to')}"


def refit_html(data: dict[str, Any]) -> str:
    """``report.html`` of a refit run: its Markdown section as one self-contained page."""
    from mismatch_probe.report.html import render_html

    return render_html(refit_markdown(data), Path("."), refit_title(data))


def write_refit_reports(data: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """``report.md`` and ``report.html`` of the refit view ``data`` into ``out_dir``."""
    from mismatch_probe import store
    from mismatch_probe.report.html import write_html

    report = out_dir / store.REPORT_FILE
    store.write_text(report, refit_markdown(data))
    return {
        "report": report,
        "html": write_html(refit_markdown(data), report, refit_title(data), {}),
    }


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
        console.print(f"  {failure}", markup=False, highlight=False)
