"""``probe ingest``'s output: the terminal report of the ingested run (with its trend), then
what was read."""

from __future__ import annotations

from typing import Any


def render_ingest(result: Any, console: Any) -> None:
    """``probe ingest``'s output: the terminal report (with the trend), then what was read."""
    from mismatch_probe.report import render

    render(result.report, None, console)
    counts, source = result.run.get("counts", {}), result.run.get("source", {})
    untrained = counts.get("steps_without_trained_tokens") or []
    note = f" (no trained token at step {', '.join(map(str, untrained))})" if untrained else ""
    console.print(
        f"ingested {source.get('format')} {source.get('path')}: {counts.get('steps')} steps "
        f"({counts.get('first_step')}..{counts.get('last_step')}){note}, "
        f"{counts.get('sequences'):,} sequences, {counts.get('tokens'):,} tokens -> {result.out}",
        highlight=False,
        soft_wrap=True,
    )
