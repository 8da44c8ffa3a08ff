"""The MoE-routing section of ``report.md`` and the scan summary, read from ``routing.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mismatch_probe.report.markdown import escape, table
from mismatch_probe.routing.plots import BY_LAYERS_PNG, DISAGREEMENT_PNG
from mismatch_probe.routing.stage import ROUTING_JSON


def load(run_dir: Path) -> dict[str, Any]:
    path = run_dir / ROUTING_JSON
    return json.loads(path.read_text()) if path.is_file() else {}


def summary_lines(data: dict[str, Any]) -> list[str]:
    """One line per rollout/training pair: how many tokens route differently, what R3 removes."""
    lines = []
    for label, entry in data.items():
        m = entry["metrics"]
        line = (
            f"routing {label}: {m['any_layer_differs']:.2%} of tokens differ in >= 1 layer, "
            f"mean Jaccard {m['mean_jaccard']:.4f}"
        )
        removed = entry["replay"]["k3_removed"].get("rollout")
        if removed is not None:
            line += f"; R3 removes {removed:.1%} of k3_kl"
        lines.append(line)
    return lines


def routing_markdown(run_dir: Path) -> str:
    """``## MoE routing``: per-layer disagreement, the mismatch split, replay modes, plots."""
    data = load(run_dir)
    if not data:
        return ""
    lines = ["## MoE routing (engine vs trainer)", ""]
    lines += [f"- {escape(line)}" for line in summary_lines(data)] + [""]
    for label, entry in data.items():
        m = entry["metrics"]
        rows = [
            [str(layer), f"{d:.4f}", f"{j:.4f}"]
            for layer, d, j in zip(
                m["moe_layers"], m["layer_disagreement"], m["layer_jaccard"], strict=True
            )
        ]
        lines += [f"### {escape(label)}", ""]
        lines += [*table(["MoE layer", "expert set differs", "mean Jaccard"], rows, "lrr"), ""]
        split = [
            [name, str(s["tokens"]), _num(s["k3_kl"]), _num(s["mean_abs_log_ratio"])]
            for name, s in (
                ("routing agrees in all layers", m["agree"]),
                ("routing differs in >= 1 layer", m["differ"]),
            )
        ]
        split += [
            [f"replay={mode}", str(s["tokens"]), _num(s["k3_kl"]), _num(s["mean_abs_log_ratio"])]
            for mode, s in entry["replay"]["modes"].items()
        ]
        lines += [*table(["tokens", "count", "k3_kl", "mean abs log-ratio"], split, "lrrr"), ""]
    for name in (DISAGREEMENT_PNG, BY_LAYERS_PNG):
        if (run_dir / "plots" / name).is_file():
            lines += [f"![{name}](plots/{name})", ""]
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"
