"""``--layers``: the report section, the terminal lines and ``plots/layers.png``.

Renders what ``layers.json`` holds (handed over as ``RunContext.layers``): per setting its
``first_divergent_layer`` and mean relative difference per layer against the floor; the
training-side precision views (``views``: transformers at two dtypes, no engine) beside them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch_probe.report.md import escape, table

PLOT_FILE = "layers.png"
NOTE = (
    "Residual stream after every decoder layer, engine against training, on the same token ids "
    "(the last layer after the final norm), then each layer's attention and MLP outputs (before "
    "the residual add) and, as the last point, the logits of the sampled tokens (RMS-relative "
    "difference over the response tokens). A layer diverges at 10x the floor; a precision gap "
    "diverges at layer 0 by physics: read the curve's growth."
)


PART_LABELS = {"attention": "attention output", "mlp": "MLP output"}


def _curves(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every curve: the settings, then the views (labelled as such)."""
    curves = dict(data.get("settings", {}))
    curves.update({f"{name} (no engine)": v for name, v in data.get("views", {}).items()})
    return curves


def _layer(value: Any) -> str:
    return "none" if value is None else str(value)


def _logits_cell(entry: dict[str, Any]) -> str:
    point = entry.get("logits")
    if not point:
        return "—"
    return f"{point['rel']:.2e}" + (" (diverges)" if point["divergent"] else "")


def _row(name: str, entry: dict[str, Any], logits: str) -> list[str]:
    means = [row["mean_rel"] for row in entry["layers"]]
    return [
        escape(name),
        _layer(entry["first_divergent_layer"]),
        _layer(entry["largest_growth_layer"]),
        f"{means[0]:.2e}" if means else "—",
        f"{means[-1]:.2e}" if means else "—",
        logits,
    ]


def summary_rows(data: dict[str, Any]) -> list[list[str]]:
    """``[curve, first divergent layer, largest growth, layer 0, last layer, sampled-token
    logits]`` per curve (the residual stream), then a row per part of it (attention and MLP
    outputs, where both sides expose them)."""
    rows = []
    for name, entry in _curves(data).items():
        rows.append(_row(name, entry, _logits_cell(entry)))
        for part, part_entry in entry.get("parts", {}).items():
            rows.append(_row(f"{name} · {PART_LABELS.get(part, part)}", part_entry, "—"))
    return rows


HEADER = [
    "curve",
    "first divergent layer",
    "largest growth",
    "mean rel. diff layer 0",
    "last",
    "sampled-token logits",
]


def markdown_section(data: dict[str, Any], plot: Path | None, base: Path) -> str:
    """``## Layers``: the note, one row per curve, the floor's source, the plot."""
    if not data.get("settings"):
        return ""
    lines = ["## Layers", "", escape(NOTE), ""]
    lines += [*table(HEADER, summary_rows(data), "lrrrrr"), ""]
    source = str(data.get("floor_source", "?"))
    own = [  # the identity setting: the others' floor, itself judged against float32 rounding
        f"{name}: {entry['floor_source']}"
        for name, entry in data["settings"].items()
        if entry.get("floor_source", source) != source
    ]
    lines += [f"Floor: {escape('; '.join([source, *own]))}.", ""]
    for name, entry in data["settings"].items():  # MoE: where the sides routed differently
        if "routing_flip_layers" in entry:
            marked = ", ".join(map(str, entry["routing_flip_layers"])) or "none"
            lines += [f"{escape(name)}: a token routed to other experts at layers {marked}.", ""]
    if plot is not None:
        lines += [f"![layers]({plot.relative_to(base).as_posix()})", ""]
    return "\n".join(lines)


def comment_lines(curve: dict[str, Any] | None, data: dict[str, Any] | None = None) -> list[str]:
    """The pull-request comment's line (nothing without ``--layers``): the reported setting's
    first divergent layer (what ``probe check --min first_divergent_layer=N`` gates) and, for a
    matrix run (``data``: its ``layers.json`` with several settings), every setting's."""
    if curve is None:
        return []
    lines = [
        f"**First divergent layer:** {_layer(curve['first_divergent_layer'])} "
        f"(largest growth at layer {_layer(curve['largest_growth_layer'])}; `layers.json`)",
        "",
    ]
    settings = (data or {}).get("settings", {})
    if len(settings) > 1:
        each = "; ".join(
            f"{escape(name)}: {_layer(entry['first_divergent_layer'])}"
            for name, entry in settings.items()
        )
        lines[0] += f"; per setting: {each}"
    return lines


def render(data: dict[str, Any], console: Any) -> None:
    """The terminal lines: one per curve."""
    if not data.get("settings"):
        return
    from rich.table import Table

    view = Table(title="Layers (first divergent layer, engine against training)")
    for name in HEADER:
        view.add_column(name)
    for row in summary_rows(data):
        view.add_row(*row)
    console.print(view)


def write_plot(data: dict[str, Any], plots_dir: Path) -> Path | None:
    """``plots/layers.png``: mean relative difference per layer, one curve per setting (views
    dashed), log scale, the floor drawn; a stale one is removed without ``--layers``."""
    path = plots_dir / PLOT_FILE
    if not data.get("settings"):
        path.unlink(missing_ok=True)
        return None
    from matplotlib.figure import Figure

    from mismatch_probe.report.plots import DPI, FIGSIZE, save

    plots_dir.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    ax = fig.subplots()
    views = set(data.get("views", {}))
    logits_at = None  # the curve's last point: the sampled tokens' logits, one step past it
    for name, entry in _curves(data).items():
        layers = [row["layer"] for row in entry["layers"]]
        means = [max(row["mean_rel"], 1e-12) for row in entry["layers"]]
        if entry.get("logits"):
            logits_at = len(layers)
            layers, means = [*layers, logits_at], [*means, max(entry["logits"]["rel"], 1e-12)]
        style = "--" if name.removesuffix(" (no engine)") in views else "-"
        ax.plot(layers, means, style, marker="o", label=name)
    every = list(data["settings"].values())  # the floor the settings are judged against
    same = [e for e in every if e.get("floor_source") == data.get("floor_source")]
    first = (same or every)[0]
    layers = [row["layer"] for row in first["layers"]]
    ax.plot(layers, first["floor"], ":", color="grey", label="floor")
    ax.plot(layers, [10 * f for f in first["floor"]], ":", color="black", label="10x floor")
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer (the last after the final norm), then the sampled-token logits")
    ax.set_ylabel("mean RMS-relative difference")
    ticks = layers if logits_at is None else [*layers, logits_at]
    ax.set_xticks(ticks, [*map(str, layers), *([] if logits_at is None else ["logits"])])
    ax.legend(fontsize=7)
    source = str(data.get("floor_source", "?"))
    return save(fig, path, "Where in the network the sides part", f"floor: {source}")
