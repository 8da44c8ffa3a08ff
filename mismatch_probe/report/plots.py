"""The PNG plots of one run, the curve drawers ``compare`` overlays, and a matrix's
``k3_kl`` per setting.

Each plot is a 6.5 x 4 inch figure at 110 dpi (about 715 x 440 px: legible at PR-comment
width, tens of KB), titled with what it shows and with units on its axes. Figures are built
with ``matplotlib.figure.Figure`` on the Agg canvas, never through pyplot, so no global state
or GUI backend is touched; matplotlib is imported inside the functions (``probe --help`` stays
fast).

Everything is drawn from the metrics' curves (bounded size), except the probability scatter of a
small run (at most ``SCATTER_MAX`` tokens), drawn from the token probabilities its view holds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mismatch_probe.metrics import PRESETS
from mismatch_probe.metrics.config import parse_is
from mismatch_probe.metrics.decisions import K3_THRESHOLDS, RATIO_THRESHOLDS
from mismatch_probe.report.png import save_png
from mismatch_probe.report.sections import visible
from mismatch_probe.rundir.context import RunContext

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIGSIZE = (6.5, 4.0)
DPI = 110
TAU_TICKS = (1.001, 1.01, 1.1, 2.0, 10.0, 100.0)
RATIO_TICKS = (0.05, 0.1, 0.2, 0.5, 0.8, 1.0, 1.25, 2.0, 5.0, 10.0, 20.0)
POSITION_TICKS = tuple(2**k for k in range(16))


def new_figure() -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    return fig, fig.subplots()


def panel_count(fig: Figure) -> int:
    """How many panels ``fig`` holds (a twin axis shares its panel's place)."""
    return len({(a.get_position().x0, a.get_position().y0) for a in fig.axes})


def save(fig: Figure, path: Path, title: str, subtitle: str) -> Path:
    """The title over the figure, the subtitle over its one panel (or under the title when
    there are several)."""
    if panel_count(fig) > 1:
        fig.suptitle(f"{title}\n{subtitle}", fontsize=10)
    else:
        fig.suptitle(title, fontsize=11, fontweight="bold")
        fig.axes[0].set_title(subtitle, fontsize=8.5, color="0.35")
    return save_png(fig, path, DPI)


def plain_ticks(axis: Any, ticks: tuple[float, ...]) -> None:
    """Major ticks of ``axis`` (``ax.xaxis``) at ``ticks``, written as plain numbers; no minor
    labels. Ticks outside the view are not drawn, so later curves may widen the axis."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    axis.set_minor_formatter(NullFormatter())


# The largest magnitude a plot draws: a value beyond it (a clamped k3 of 1.8e308) is drawn at
# the bound and labelled with its own value. Matplotlib's log-axis margins overflow float64 (a
# RuntimeWarning on stderr, a collapsed layout) near the float range's end.
DRAW_MAX = 1e100


def drawable(values: Any) -> np.ndarray:
    """``values`` clipped to ``[-DRAW_MAX, DRAW_MAX]`` (NaN stays NaN: matplotlib skips it)."""
    return np.clip(np.asarray(values, dtype=np.float64), -DRAW_MAX, DRAW_MAX)


def log_y(ax: Axes, values: np.ndarray, label: str) -> None:
    """Log y axis when any value is positive (an all-zero run stays linear), and its label.

    When an earlier curve (all zero, drawn first) left the axis linear with fixed limits, the
    switch to log scale re-enables autoscaling: a linear lower limit of 0 kept on a log axis
    would hide every curve."""
    positive = bool(np.any(np.asarray(values) > 0)) or ax.get_yscale() == "log"
    if positive and ax.get_yscale() != "log":
        ax.set_yscale("log")
        ax.autoscale(enable=True, axis="y")
    ax.set_ylabel(f"{label} (log scale)" if positive else label)


# --- curve drawers, shared with compare --------------------------------------------------------


def draw_ratio_hist(ax: Axes, curves: dict[str, Any], label: str | None = None) -> None:
    """Token counts per bin of ``rho = exp(r)``, log x; bins are those of ``log_ratio_hist``."""
    hist = curves["log_ratio_hist"]
    counts = np.asarray(hist["counts"], dtype=float)
    edges = np.exp(np.linspace(hist["lo"], hist["hi"], len(counts) + 1))
    used = np.flatnonzero(counts)
    first, last = (used[0], used[-1] + 1) if len(used) else (0, len(counts))
    ax.stairs(counts[first:last], edges[first : last + 1], label=label, linewidth=1.4)
    ax.set_xscale("log")
    plain_ticks(ax.xaxis, RATIO_TICKS)
    log_y(ax, counts, "tokens per bin")
    ax.set_xlabel("token IS ratio ρ = p_train / p_rollout (log scale)")


def draw_position(
    ax: Axes, curves: dict[str, Any], label: str = "", key: str = "mean_abs_log_ratio"
) -> None:
    """``key`` of each non-empty position bin at the bin's middle position (log2 x)."""
    rows = [b for b in curves["position_bins"] if b["count"]]
    shown = [b for b in rows if b[key] > 0]  # a zero cannot be drawn on the log axis
    mids = [(b["lo"] + (b["hi"] if b["hi"] is not None else 2 * b["lo"])) / 2 for b in shown]
    values = [b[key] for b in shown]
    if rows and not shown:
        label += " (0 at every position)"
    ax.plot(mids, values, marker="o", markersize=4, label=label)
    ax.set_xscale("log", base=2)
    plain_ticks(ax.xaxis, POSITION_TICKS)
    log_y(ax, np.asarray(values), "nats per token")
    ax.set_xlabel("response position (tokens, middle of each bin)")


def draw_f_tau(ax: Axes, curves: dict[str, Any], label: str | None = None) -> None:
    """F(tau) at ``tau - 1`` on a log x axis labelled with tau; zero fractions are left out."""
    points = [(p["tau"], p["fraction"]) for p in curves["f_tau"] if p["fraction"] > 0]
    taus = np.array([t for t, _ in points])
    if label is not None and not points:
        label += " (0 at every τ)"
    ax.plot(taus - 1.0, [f for _, f in points], marker="o", markersize=4, label=label)
    ax.set_xscale("log")
    log_y(ax, np.array([f for _, f in points]), "share of tokens with max(ρ, 1/ρ) > τ")
    if ax.get_yscale() == "linear":  # nothing positive drawn yet
        ax.set_ylim(0.0, 1.0)
    ax.set_xticks([t - 1.0 for t in TAU_TICKS], [f"{t:g}" for t in TAU_TICKS])
    ax.set_xlim(TAU_TICKS[0] - 1.0, TAU_TICKS[-1] - 1.0)
    ax.set_xlabel("τ: ratio threshold (axis spaced by log(τ − 1))")


# --- the six plots of one run ------------------------------------------------------------------


def is_bounds(config: dict[str, Any]) -> tuple[float, tuple[float, float]]:
    """(TIS cap C, IcePop [L, U]): from the run's IS config when it is of that kind, else from
    the ``token_is`` / ``token_icepop`` presets."""
    spec = parse_is("token", config.get("rollout_is_threshold") or "2.0")
    default_tis = parse_is("token", PRESETS["token_is"].rollout_is_threshold)
    default_pop = parse_is("token", PRESETS["token_icepop"].rollout_is_threshold)
    tis = spec if spec is not None and not spec.icepop else default_tis
    pop = spec if spec is not None and spec.icepop else default_pop
    assert tis is not None and pop is not None and pop.lower is not None
    return tis.upper, (pop.lower, pop.upper)


def plot_ratio_hist(fig: Figure, ax: Axes, ctx: RunContext) -> None:
    draw_ratio_hist(ax, ctx.curves)
    cap, (low, high) = is_bounds(ctx.config)
    ax.axvline(cap, color="tab:red", linestyle="--", label=f"TIS cap C = {cap:g}")
    for x in (low, high):
        ax.axvline(x, color="tab:purple", linestyle=":", linewidth=1.5)
    ax.plot([], [], color="tab:purple", linestyle=":", label=f"IcePop [{low:g}, {high:g}]")
    hist = ctx.curves["log_ratio_hist"]
    outside = hist.get("underflow", 0) + hist.get("overflow", 0)
    if outside:
        ax.text(
            0.01,
            0.97,
            f"{outside:,} tokens beyond the axis",
            transform=ax.transAxes,
            va="top",
            fontsize=8,
        )
    ax.margins(x=0.08)
    left, right = ax.get_xlim()  # the bounds stay in view when every ratio is near 1
    ax.set_xlim(min(left, low / 1.25), max(right, cap * 1.25, high * 1.25))
    ax.legend(fontsize=8, loc="upper right")


def plot_probs(fig: Figure, ax: Axes, ctx: RunContext) -> None:
    """Scatter of (p_rollout, p_train) for a small run (its view holds every token's
    probabilities: ``SCATTER_MAX``), 2-D density otherwise."""
    probs = ctx.probs
    if probs is not None:
        ax.scatter(probs.rollout, probs.train, s=5, alpha=0.35, linewidths=0, label="token")
        flip = probs.flip
        if flip.any():
            ax.scatter(
                probs.rollout[flip], probs.train[flip], s=14, color="tab:red", label="support flip"
            )
    else:
        from matplotlib.colors import LogNorm

        counts = np.asarray(ctx.curves["prob_hist2d"]["counts"], dtype=float)
        image = ax.imshow(
            np.ma.masked_equal(counts.T, 0),
            origin="lower",
            extent=(0, 1, 0, 1),
            norm=LogNorm(),
            cmap="viridis",
            aspect="auto",
        )
        fig.colorbar(image, ax=ax, label="tokens per cell")
    ax.plot([0, 1], [0, 1], color="0.3", linewidth=0.8, linestyle="--", label="p_train = p_rollout")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("rollout probability p_rollout (vLLM)")
    ax.set_ylabel("training probability p_train")
    ax.legend(fontsize=8, loc="upper left")


def plot_position(fig: Figure, ax: Axes, ctx: RunContext) -> None:
    draw_position(ax, ctx.curves, "mean |log ρ|", "mean_abs_log_ratio")
    draw_position(ax, ctx.curves, "mean k3 = ρ − 1 − log ρ", "mean_k3")
    ax.legend(fontsize=8)


def plot_seq_length(fig: Figure, ax: Axes, ctx: RunContext) -> None:
    line = ctx.curves["seq_log_ratio_vs_length"]
    length = np.asarray(line["length"], dtype=float)
    ax.scatter(length, line["log_ratio_sum"], s=12, alpha=0.6, label="response")
    xs = np.linspace(0.0, max(float(length.max(initial=0.0)), 1.0), 50)
    slope = line["slope_per_1k"]
    ax.plot(
        xs,
        line["intercept"] + slope * xs / 1000.0,
        color="tab:red",
        label=f"least squares: {slope:+.3g} nats per 1K tokens",
    )
    ax.axhline(0.0, color="0.5", linewidth=0.6)
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("Σ log ρ over the response (nats)")
    ax.legend(fontsize=8)


def plot_f_tau(fig: Figure, ax: Axes, ctx: RunContext) -> None:
    draw_f_tau(ax, ctx.curves)
    zero = [p["tau"] for p in ctx.curves["f_tau"] if p["fraction"] == 0]
    if zero:
        ax.text(
            0.99,
            0.03,
            f"F(τ) = 0 from τ = {min(zero):g} on (not drawn on a log axis)",
            transform=ax.transAxes,
            ha="right",
            fontsize=8,
        )
    ax.axvline(
        1.0, color="tab:red", linestyle="--", linewidth=1, label="τ = 2 (ρ outside [0.5, 2])"
    )
    ax.legend(fontsize=8)


def plot_prob_bins(fig: Figure, ax: Axes, ctx: RunContext) -> None:
    """Mean |log rho| per rollout-probability bin (bars) and the bin's share of all |log rho|."""
    rows = ctx.curves["rollout_prob_bins"]
    x = np.arange(len(rows))
    means = np.array([b["mean_abs_log_ratio"] for b in rows])
    zero = " (0 in every bin)" if not means.any() else ""
    ax.bar(x, means, color="tab:blue", label=f"mean |log ρ| (left axis){zero}")
    log_y(ax, means, "mean |log ρ| per token, nats")
    if means.max(initial=0.0) > 0:  # headroom for the legend above the bars
        ax.set_ylim(top=means.max() * (10.0 if ax.get_yscale() == "log" else 1.4))
    ax.set_xticks(
        x, [f"{b['lo']:g}–{b['hi']:g}" for b in rows], rotation=45, ha="right", fontsize=8
    )
    ax.set_xlabel("rollout probability bin")
    share = ax.twinx()
    shares = [100 * b["abs_log_ratio_share"] for b in rows]
    share.plot(
        x,
        shares,
        color="tab:orange",
        marker="o",
        markersize=4,
        label=f"share of total |log ρ| (right axis){zero}",
    )
    share.set_ylabel("share of total |log ρ| (%)")
    share.set_ylim(0, 1.5 * max(max(shares), 1.0))  # headroom for the legend
    handles = ax.get_legend_handles_labels()[0] + share.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="upper right")


# One panel per threshold scale: U (mean k3 bound) for seq_mean_k3, C (ratio bound) for the rest.
SWEEP_PANELS = (
    ("U: bound on a sequence's mean k3 (log scale)", K3_THRESHOLDS, ("seq_mean_k3",)),
    ("C: ratio bound (log scale)", RATIO_THRESHOLDS, ("token_tis", "token_icepop", "seq_is")),
)
# A distinct marker per family, drawn largest first: a curve lying on another stays visible.
SWEEP_STYLE: dict[str, dict[str, Any]] = {
    "seq_mean_k3": {"marker": "o", "markersize": 7, "color": "tab:red", "zorder": 2},
    "seq_is": {"marker": "o", "markersize": 8, "color": "tab:green", "zorder": 2},
    "token_icepop": {"marker": "s", "markersize": 5.5, "color": "tab:orange", "zorder": 3},
    "token_tis": {"marker": "^", "markersize": 3.5, "color": "tab:blue", "zorder": 4},
}
SWEEP_LINTHRESH = 1e-3


def split_axes(fig: Figure, ax: Axes, ratios: tuple[float, ...]) -> list[Axes]:
    """Replace ``ax`` by one panel per entry of ``ratios`` (side by side, those widths)."""
    grid = ax.get_subplotspec().subgridspec(1, len(ratios), width_ratios=ratios)  # type: ignore[union-attr]
    ax.remove()
    return [fig.add_subplot(grid[0, i]) for i in range(len(ratios))]


def plot_threshold_sweep(fig: Figure, ax: Axes, ctx: RunContext) -> None:
    """Masked share of tokens (solid) and sequences (dashed) per family against its threshold,
    one panel per threshold scale (U for seq_mean_k3, C for the ratio families, both log x),
    the presets' defaults starred; the legend sits below both panels, over no curve."""
    from mismatch_probe.report.decisions import FAMILY_LABELS, preset_marks, sweep_by_family

    by_family = sweep_by_family(ctx.tables.get("threshold_sweep", []))
    marks = preset_marks()
    panels = split_axes(fig, ax, (1.0, 1.6))
    star: dict[str, Any] = {"marker": "*", "markersize": 13, "markeredgecolor": "black"}
    for panel, (xlabel, ticks, families) in zip(panels, SWEEP_PANELS, strict=True):
        for family in families:
            rows = by_family.get(family, [])
            if not rows:
                continue
            style = SWEEP_STYLE[family]
            x = [r["threshold"] for r in rows]
            panel.plot(x, [r["token_fraction"] for r in rows], label=FAMILY_LABELS[family], **style)
            panel.plot(  # the same marker, hollow: a sequence curve on another stays visible
                x,
                [r["seq_fraction"] for r in rows],
                linestyle="--",
                markerfacecolor="none",
                **style,
            )
            for r in rows:
                if (family, r["threshold"]) in marks:
                    panel.plot(
                        r["threshold"],
                        r["token_fraction"],
                        color=style["color"],
                        linestyle="none",
                        zorder=5,
                        **star,
                    )
        panel.set_xscale("log")
        plain_ticks(panel.xaxis, ticks)
        panel.set_yscale("symlog", linthresh=SWEEP_LINTHRESH)
        # a share of 0 drawn just above the bottom spine, not on it
        panel.set_ylim(-0.3 * SWEEP_LINTHRESH, 1.05)
        panel.margins(x=0.08)
        panel.set_xlabel(xlabel, fontsize=8)
    pop = ctx.metrics.get("presets/token_icepop/token_masked_fraction")
    if pop is not None:  # the IcePop preset's bounds are not symmetric: its own value
        panels[1].plot(
            5.0,
            pop,
            marker="D",
            color="tab:orange",
            markeredgecolor="black",
            linestyle="none",
            zorder=5,
            label="token_icepop preset [0.5, 5]",
        )
    panels[0].set_ylabel("share masked or truncated (symlog)")
    panels[1].tick_params(labelleft=False)
    key = panels[1]
    key.plot([], [], color="0.6", linestyle="none", label="a preset's default", **star)
    key.plot([], [], linestyle="--", color="0.4", label="dashed: share of sequences")
    handles = panels[0].get_legend_handles_labels()[0] + key.get_legend_handles_labels()[0]
    fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncols=3)


def plot_seq_weights(fig: Figure, ax: Axes, ctx: RunContext) -> None:
    """Sequences per bin of the sequence IS weight exp(s_i), with the sequence-level bounds."""
    hist = ctx.curves.get("seq_weight_hist") or {"counts": [], "lo": -3.0, "hi": 3.0}
    draw_ratio_hist(ax, {"log_ratio_hist": hist})
    ax.set_xlabel("sequence IS weight exp(Σ log ρ) (log scale)")
    log_y(ax, np.asarray(hist["counts"], dtype=float), "sequences per bin")
    seq_is = parse_is("sequence", PRESETS["seq_is"].rollout_is_threshold)
    assert seq_is is not None
    ax.axvline(
        seq_is.upper, color="tab:red", linestyle="--", label=f"seq_is: TIS cap C = {seq_is.upper:g}"
    )
    spec = PRESETS["seq_is_rs"]
    low, high = (float(x) for x in str(spec.rollout_rs_threshold).split("_"))
    for x in (low, high):
        ax.axvline(x, color="tab:purple", linestyle=":", linewidth=1.5)
    ax.plot(
        [],
        [],
        color="tab:purple",
        linestyle=":",
        label=f"seq_is_rs: {spec.rollout_rs} keeps [{low:g}, {high:g}]",
    )
    outside = hist.get("underflow", 0) + hist.get("overflow", 0)
    if outside:
        ax.text(
            0.01,
            0.97,
            f"{outside:,} sequences beyond the axis",
            transform=ax.transAxes,
            va="top",
            fontsize=8,
        )
    ax.margins(x=0.08)
    ax.legend(fontsize=8, loc="upper right")


def plot_entropy(fig: Figure, ax: Axes, ctx: RunContext) -> None:
    """Mean |log rho| (bars) and mean k3 (line, right axis) per decile of train_entropy."""
    curve = ctx.curves.get("entropy") or {}
    bins = curve.get("bins") or []
    x = np.arange(len(bins))
    means = np.array([b["mean_abs_log_ratio"] for b in bins])
    ax.bar(x, means, color="tab:blue", label="mean |log ρ| (left axis)")
    log_y(ax, means, "mean |log ρ| per token, nats")
    labels = [
        f"{b['lo']:.2g}–{b['hi']:.2g}" if b["hi"] is not None else f"≥{b['lo']:.2g}" for b in bins
    ]
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=7)
    ax.set_xlabel("training-side entropy decile (nats)")
    k3 = ax.twinx()
    k3.plot(
        x,
        [b["mean_k3"] for b in bins],
        color="tab:orange",
        marker="o",
        markersize=4,
        label="mean k3 (right axis)",
    )
    k3.set_ylabel("mean k3 = ρ − 1 − log ρ")
    handles = ax.get_legend_handles_labels()[0] + k3.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="upper left")


def write_k3_by_setting(entries: list[Any], path: Path) -> tuple[Path, str]:
    """``k3_kl`` per setting of a matrix (bars coloured by the setting's verdicts: green when
    none fails), the rule's none-needed bound and any verdict bound on k3_kl drawn."""
    from mismatch_probe.metrics.recommend import NONE_NEEDED_K3
    from mismatch_probe.metrics.verdicts import FAIL, HEALTH_CHECKS, evaluate

    bounds = [(c, b) for c in HEALTH_CHECKS if c.metric == "k3_kl" for b in c.bounds]
    drawn = "the verdict bounds and " if bounds else ""
    title = f"k3_kl per setting (colour: its verdicts), {drawn}the none-needed bound"
    fig, ax = new_figure()
    metric = np.array([e.metrics["k3_kl"] for e in entries], dtype=np.float64)
    values = drawable(metric)
    failing = [sum(v.status == FAIL for v in evaluate(e.metrics)) for e in entries]
    colors = ["tab:green" if n == 0 else "tab:red" for n in failing]
    x = np.arange(len(entries))
    ax.bar(x, values, color=colors)
    for i, n in enumerate(failing):
        said = f"{n} FAIL" if n else "all pass"
        off = f"\n{metric[i]:.3g}, off the scale" if metric[i] != values[i] else ""
        ax.text(i, values[i], said + off, ha="center", va="bottom", fontsize=7)
    ax.axhline(
        NONE_NEEDED_K3,
        color="0.3",
        linestyle="--",
        label=f"none needed below {NONE_NEEDED_K3:g} (recommendation rule)",
    )
    for check, bound in bounds:
        ax.axhline(bound, color="tab:red", linestyle=":", label=f"verdict: {check.label}")
    log_y(ax, values, "k3_kl")
    ax.set_xticks(x, [visible(e.label) for e in entries], rotation=20, ha="right", fontsize=7)
    from matplotlib.patches import Patch

    handles = ax.get_legend_handles_labels()[0]
    handles += [Patch(color="tab:green", label="no verdict fails")]
    handles += [Patch(color="tab:red", label="a verdict fails")]
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    order = "in the grid's order (failing first, then least k3_kl)"
    return save(fig, path, title, f"{len(entries)} settings, {order}"), title


PlotFn = Callable[["Figure", "Axes", RunContext], None]
# name -> (title, drawer); the file is plots/<name>.png.
PLOTS: dict[str, tuple[str, PlotFn]] = {
    "ratio_hist": ("Token IS ratio ρ with the TIS and IcePop bounds", plot_ratio_hist),
    "probs": ("Rollout vs training probability of each token", plot_probs),
    "position": ("Mismatch by response position", plot_position),
    "seq_length": ("Sequence log-ratio sum vs response length", plot_seq_length),
    "f_tau": ("F(τ): share of tokens whose ratio exceeds τ either way", plot_f_tau),
    "prob_bins": ("Mismatch by rollout-probability bin", plot_prob_bins),
    "threshold_sweep": (
        "How much each correction masks (TIS: truncates) as its threshold moves",
        plot_threshold_sweep,
    ),
    "seq_weights": ("Sequence IS weights with the sequence-level bounds", plot_seq_weights),
    "entropy": ("Mismatch by training-side entropy", plot_entropy),
}


def subtitle(ctx: RunContext) -> str:
    model = ctx.run.get("model", {}).get("name", "")
    text = f"{model}  {ctx.label}  ({ctx.metrics.get('num_tokens', 0):,.0f} tokens)".strip()
    return visible(text)  # a model or setting name's control characters, escaped


# Plots drawn only when the run has their data (no empty figure: the report says why instead).
NEEDS: dict[str, Callable[[RunContext], bool]] = {
    "entropy": lambda ctx: bool((ctx.curves.get("entropy") or {}).get("available")),
}


def write_plots(ctx: RunContext, out_dir: Path) -> dict[str, tuple[Path, str]]:
    """Write every plot of ``PLOTS`` whose data the run has as ``out_dir/<name>.png`` (a stale
    one of an earlier run is removed); returns name -> (path, title)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, (title, draw) in PLOTS.items():
        if not NEEDS.get(name, lambda _: True)(ctx):
            (out_dir / f"{name}.png").unlink(missing_ok=True)
            continue
        fig, ax = new_figure()
        draw(fig, ax, ctx)
        written[name] = (save(fig, out_dir / f"{name}.png", title, subtitle(ctx)), title)
    return written
