"""The MoE-routing part of the reports: the ``report.md`` section, the summary lines and the two
routing plots, all drawn from ``routing.json`` (``store.ROUTING_METRICS_FILE``, written by the
routing stage), so ``probe report`` redraws them from the run directory alone.

``routing.json``: ``{label: {"settings": {mode: setting}, "metrics": RoutingMetrics,
"replay": ReplayComparison}}`` (``routing/metrics.py``), one entry per rollout/training pair.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.report.markdown import escape, table
from mismatch_probe.report.plots import new_figure, save

DISAGREEMENT_PNG = "routing_disagreement.png"
BY_LAYERS_PNG = "routing_logratio_by_layers.png"


def load(run_dir: Path) -> dict[str, Any]:
    """``routing.json`` of ``run_dir`` ({} for a dense model's run)."""
    path = run_dir / store.ROUTING_METRICS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        data = None
    if not _well_formed(data):
        raise ProbeError(f"{path} is not a routing.json written by probe scan")
    return dict(data)


def _well_formed(data: Any) -> bool:
    """The shape every renderer below relies on."""
    keys = {"metrics": ("layer_disagreement", "by_differing_layers"), "replay": ("modes",)}
    return isinstance(data, dict) and all(
        isinstance(entry, dict)
        and all(isinstance(entry.get(part), dict) for part in keys)
        and all(k in entry[part] for part, names in keys.items() for k in names)
        for entry in data.values()
    )


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
        if (run_dir / store.PLOTS_DIR / name).is_file():
            lines += [f"![{name}]({store.PLOTS_DIR}/{name})", ""]
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def write_routing_plots(run_dir: Path) -> dict[str, Path]:
    """The two routing plots of the first rollout/training pair of ``routing.json``; a dense
    run's directory loses any routing plots an earlier MoE run left there."""
    plots = run_dir / store.PLOTS_DIR
    data = load(run_dir)
    if not data:
        for name in (DISAGREEMENT_PNG, BY_LAYERS_PNG):
            (plots / name).unlink(missing_ok=True)
        return {}
    entry = next(iter(data.values()))
    plots.mkdir(parents=True, exist_ok=True)
    return {
        "plot_routing_disagreement": plot_disagreement_by_layer(
            entry["metrics"], plots / DISAGREEMENT_PNG
        ),
        "plot_routing_by_layers": plot_logratio_by_differing_layers(
            entry["metrics"], entry["replay"], plots / BY_LAYERS_PNG
        ),
    }


def plot_disagreement_by_layer(metrics: dict[str, Any], path: Path) -> Path:
    """Bars: fraction of response tokens whose expert set differs, per MoE layer."""
    fig, ax = new_figure()
    x = np.arange(len(metrics["moe_layers"]))
    ax.bar(x, np.asarray(metrics["layer_disagreement"]) * 100, color="tab:red", alpha=0.8)
    ax.set_xticks(x, [str(layer) for layer in metrics["moe_layers"]])
    ax.set_xlabel("MoE layer (decoder layer index)")
    ax.set_ylabel("tokens routed differently (%)")
    subtitle = (
        f"{metrics['tokens']} response tokens; {metrics['any_layer_differs']:.1%} differ in >= 1 "
        f"layer; mean Jaccard {metrics['mean_jaccard']:.3f}"
    )
    return save(fig, path, "Routing disagreement by layer (engine vs trainer)", subtitle)


def plot_logratio_by_differing_layers(
    metrics: dict[str, Any], replay: dict[str, Any], path: Path
) -> Path:
    """Mean |log-ratio| of tokens grouped by how many layers route them differently, one bar
    per replay mode (same tokens, same grouping): what forcing the rollout routes (R3) removes
    in each group."""
    groups = replay.get("by_differing_layers") or {"none": metrics["by_differing_layers"]}
    fig, ax = new_figure()
    d = np.arange(len(metrics["by_differing_layers"]))
    width = 0.8 / len(groups)
    for i, (mode, stats) in enumerate(groups.items()):
        values = [s["mean_abs_log_ratio"] or 0.0 for s in stats]
        ax.bar(d + (i - (len(groups) - 1) / 2) * width, values, width, label=f"replay={mode}")
    counts = [s["tokens"] for s in metrics["by_differing_layers"]]
    ax.set_xticks(d, [f"{k}\n({n} tok)" for k, n in zip(d, counts, strict=True)])
    ax.set_xlabel("layers whose routing differs without replay")
    ax.set_ylabel("mean |log-ratio| (nats)")
    ax.legend(fontsize=8)
    subtitle = "r = train_logprob - rollout_logprob; tokens grouped by the no-replay routes"
    return save(fig, path, "|log-ratio| by number of differing layers", subtitle)
