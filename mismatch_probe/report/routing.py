"""The MoE-routing part of the reports: the ``report.md`` section, the summary lines and the two
routing plots, drawn from the view's ``routing`` (``routing.json``: handed over by the scan's
finishing step, read back and checked by ``rundir.routing`` for ``probe report``).

``{label: {"settings": {mode: setting}, "metrics": RoutingMetrics, "replay":
ReplayComparison}}`` (``routing/metrics.py``), one entry per rollout/training pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe import store
from mismatch_probe.report.markdown import escape, table
from mismatch_probe.report.plots import new_figure, save

DISAGREEMENT_PNG = "routing_disagreement.png"
BY_LAYERS_PNG = "routing_logratio_by_layers.png"


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


def routing_markdown(data: dict[str, Any], plots: dict[str, Path]) -> str:
    """``## MoE routing``: per-layer disagreement, the mismatch split, replay modes, and the
    ``plots`` written (``write_routing_plots``)."""
    if not data:
        return ""
    lines = ["## MoE routing (engine vs trainer)", ""]
    lines += [f"- {escape(line)}" for line in summary_lines(data)] + [""]
    lines += _sections(data)
    for path in plots.values():
        lines += [f"![{path.name}]({store.PLOTS_DIR}/{path.name})", ""]
    return "\n".join(lines)


def _sections(data: dict[str, Any]) -> list[str]:
    """A ``###`` section per rollout/training pair: disagreement by layer, the split."""
    lines: list[str] = []
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
    return lines


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def write_routing_plots(data: dict[str, Any], plots: Path) -> dict[str, Path]:
    """The two routing plots of the first rollout/training pair of ``data`` (``routing.json``)
    in ``plots``; a dense run's directory loses any routing plots an earlier MoE run left
    there."""
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
    layers, percent, subtitle = _disagreement_values(metrics)
    fig, ax = new_figure()
    x = np.arange(len(layers))
    ax.bar(x, percent, color="tab:red", alpha=0.8)
    ax.set_xticks(x, layers)
    ax.set_xlabel("MoE layer (decoder layer index)")
    ax.set_ylabel("tokens routed differently (%)")
    return save(fig, path, "Routing disagreement by layer (engine vs trainer)", subtitle)


def plot_logratio_by_differing_layers(
    metrics: dict[str, Any], replay: dict[str, Any], path: Path
) -> Path:
    """Mean |log-ratio| of tokens grouped by how many layers route them differently, one bar
    per replay mode (same tokens, same grouping): what forcing the rollout routes (R3) removes
    in each group."""
    groups, counts = _by_layers_values(metrics, replay)
    fig, ax = new_figure()
    d = np.arange(len(counts))
    width = 0.8 / max(len(groups), 1)
    for i, (mode, values) in enumerate(groups.items()):
        ax.bar(d + (i - (len(groups) - 1) / 2) * width, values, width, label=f"replay={mode}")
    ax.set_xticks(d, [f"{k}\n({n} tok)" for k, n in zip(d, counts, strict=True)])
    ax.set_xlabel("layers whose routing differs without replay")
    ax.set_ylabel("mean |log-ratio| (nats)")
    ax.legend(fontsize=8)
    subtitle = "r = train_logprob - rollout_logprob; tokens grouped by the no-replay routes"
    return save(fig, path, "|log-ratio| by number of differing layers", subtitle)


def _disagreement_values(metrics: dict[str, Any]) -> tuple[list[str], np.ndarray, str]:
    """(layer labels, percent of tokens routed differently per layer, subtitle)."""
    layers = [str(int(layer)) for layer in metrics["moe_layers"]]
    percent = np.asarray(metrics["layer_disagreement"], dtype=np.float64) * 100
    if percent.shape != (len(layers),):
        raise ValueError("one disagreement value per MoE layer")
    subtitle = (
        f"{int(metrics['tokens'])} response tokens; {float(metrics['any_layer_differs']):.1%} "
        f"differ in >= 1 layer; mean Jaccard {float(metrics['mean_jaccard']):.3f}"
    )
    return layers, percent, subtitle


def _by_layers_values(
    metrics: dict[str, Any], replay: dict[str, Any]
) -> tuple[dict[str, list[float]], list[int]]:
    """({replay mode: mean |log-ratio| per differing-layer count}, tokens per count)."""
    groups = replay.get("by_differing_layers") or {"none": metrics["by_differing_layers"]}
    counts = [int(s["tokens"]) for s in metrics["by_differing_layers"]]
    values = {
        str(mode): [float(s["mean_abs_log_ratio"] or 0.0) for s in stats]
        for mode, stats in groups.items()
    }
    if any(len(v) != len(counts) for v in values.values()):
        raise ValueError("one value per differing-layer count")
    return values, counts
