"""The routing plots: disagreement by layer, and |log-ratio| by number of differing layers.

Drawn from ``RoutingMetrics`` / ``ReplayComparison`` (bounded size) in the report's figure
style (``report.plots.new_figure`` / ``save``: Agg canvas, no pyplot); matplotlib is imported
inside the functions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mismatch_probe.routing.metrics import ReplayComparison, RoutingMetrics

DISAGREEMENT_PNG = "routing_disagreement.png"
BY_LAYERS_PNG = "routing_logratio_by_layers.png"


def plot_disagreement_by_layer(metrics: RoutingMetrics, path: Path) -> Path:
    """Bars: fraction of response tokens whose expert set differs, per MoE layer."""
    from mismatch_probe.report.plots import new_figure, save

    fig, ax = new_figure()
    x = np.arange(len(metrics.moe_layers))
    ax.bar(x, np.asarray(metrics.layer_disagreement) * 100, color="tab:red", alpha=0.8)
    ax.set_xticks(x, [str(layer) for layer in metrics.moe_layers])
    ax.set_xlabel("MoE layer (decoder layer index)")
    ax.set_ylabel("tokens routed differently (%)")
    subtitle = (
        f"{metrics.tokens} response tokens; {metrics.any_layer_differs:.1%} differ in >= 1 "
        f"layer; mean Jaccard {metrics.mean_jaccard:.3f}"
    )
    return save(fig, path, "Routing disagreement by layer (engine vs trainer)", subtitle)


def plot_logratio_by_differing_layers(
    metrics: RoutingMetrics, path: Path, replay: ReplayComparison | None = None
) -> Path:
    """Mean |log-ratio| of tokens grouped by how many layers route them differently.

    With ``replay``, one bar per replay mode (same tokens, same grouping), so the plot shows
    what forcing the rollout routes (R3) removes in each group.
    """
    from mismatch_probe.report.plots import new_figure, save

    groups = replay.by_differing_layers if replay else {"none": metrics.by_differing_layers}
    fig, ax = new_figure()
    d = np.arange(len(metrics.by_differing_layers))
    width = 0.8 / len(groups)
    for i, (mode, stats) in enumerate(groups.items()):
        values = [s.mean_abs_log_ratio or 0.0 for s in stats]
        ax.bar(d + (i - (len(groups) - 1) / 2) * width, values, width, label=f"replay={mode}")
    counts = [s.tokens for s in metrics.by_differing_layers]
    ax.set_xticks(d, [f"{k}\n({n} tok)" for k, n in zip(d, counts, strict=True)])
    ax.set_xlabel("layers whose routing differs without replay")
    ax.set_ylabel("mean |log-ratio| (nats)")
    ax.legend(fontsize=8)
    subtitle = "r = train_logprob - rollout_logprob; tokens grouped by the no-replay routes"
    return save(fig, path, "|log-ratio| by number of differing layers", subtitle)
