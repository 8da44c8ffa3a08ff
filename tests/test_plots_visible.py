"""Every plot a matrix run's report and a comparison write shows each of its series: toggling a
series off changes pixels inside its axes. The run's first setting is the identity (fp32/fp32:
every log-ratio 0), which used to leave ``plots/settings/compare_f_tau.png`` empty (the linear
limit 0 kept on the log axis drawn next). A series with nothing to draw says so in its legend
label (``(0 at every τ)``) and is the only one allowed to leave no pixel.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.figure
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.container import Container
from matplotlib.lines import Line2D

from mismatch_probe.gate.compare import load_comparison
from mismatch_probe.pipeline.publish import publish
from mismatch_probe.report.compare import write_comparison
from mismatch_probe.rundir import load_report
from tests.test_report_fixtures import Seq, make_run, matrix_run

IDENTITY = "rollout=fp32 | train=fp32"
BF16 = "rollout=bf16 | train=fp32"
FP8 = "rollout=bf16,kv=fp8 | train=fp32"
ZERO_MARK = "(0 "  # a label saying the series is zero everywhere (nothing drawable on log axes)


def spread_seqs(scale: float, n: int = 6) -> list[Seq]:
    """``n`` responses of 12 tokens whose log-ratios spread over orders of magnitude (times
    ``scale``), at rollout probabilities from 0.02 to 0.9: every curve has points."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        probs = rng.uniform(0.02, 0.9, 12)
        r = scale * rng.choice([-1.0, 1.0], 12) * 10.0 ** rng.uniform(-3, 0.3, 12)
        lp = np.log(probs)
        train = np.minimum(lp + r, -1e-4)  # a probability stays below 1
        out.append(Seq([f"t{i}" for i in range(12)], lp.tolist(), train.tolist(), [False] * 12))
    return out


def identity_seqs(n: int = 6) -> list[Seq]:
    lp = [math.log(0.3)] * 12
    return [Seq([f"t{i}" for i in range(12)], lp, lp, [False] * 12) for _ in range(n)]


def record_figures(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every figure saved from now on, with the file name it is saved to (a list filled in)."""
    saved: list[tuple[str, Any]] = []
    original = matplotlib.figure.Figure.savefig

    def record(fig: Any, fname: Any, *args: Any, **kwargs: Any) -> Any:
        name = kwargs["metadata"]["Title"]  # report.png.save_png draws into memory, titled
        saved.append((name, fig))
        return original(fig, fname, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return saved


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    return record_figures(monkeypatch)


def _pixels(fig: Any) -> np.ndarray:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _inside(ax: Any, image: np.ndarray) -> np.ndarray:
    box = ax.get_window_extent()
    height = image.shape[0]
    rows = slice(height - int(box.y1) + 1, height - int(box.y0) - 1)
    return image[rows, int(box.x0) + 1 : int(box.x1) - 1]


def series(ax: Any) -> list[tuple[str, list[Any]]]:
    """The legend-labelled series of ``ax`` that have data to draw."""
    out = []
    for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
        artists = list(handle) if isinstance(handle, Container) else [handle]
        if isinstance(handle, Line2D) and len(handle.get_xdata()) == 0:
            assert ZERO_MARK in label or not label.startswith(("mean", "share")), label
            continue  # a legend proxy (e.g. for axvline pairs) or a zero series
        out.append((label, artists))
    return out


def invisible_series(fig: Any) -> list[str]:
    """Labels of the series that change no pixel inside their axes (legends hidden)."""
    for ax in fig.axes:
        if ax.get_legend() is not None:
            ax.get_legend().set_visible(False)
    bad = []
    for ax in fig.axes:
        for label, artists in series(ax):
            if ZERO_MARK in label:
                continue
            shown = _inside(ax, _pixels(fig))
            for a in artists:
                a.set_visible(False)
            hidden = _inside(ax, _pixels(fig))
            for a in artists:
                a.set_visible(True)
            if not (shown != hidden).any() or not _in_view(ax, artists):
                bad.append(label)
    return bad


def _in_view(ax: Any, artists: list[Any]) -> bool:
    """A log axis has a positive lower limit (a 0 kept from a linear axis squeezes every curve
    against the top edge), and each point of a line lies inside the view limits."""
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    if (ax.get_yscale() == "log" and min(y0, y1) <= 0) or (
        ax.get_xscale() == "log" and min(x0, x1) <= 0
    ):
        return False
    for a in artists:
        if isinstance(a, Line2D) and len(a.get_xdata()):
            xs, ys = np.asarray(a.get_xdata(), float), np.asarray(a.get_ydata(), float)
            if a.get_transform() != ax.transData:  # axvline: x in data, y in axes coordinates
                ys = np.full_like(xs, min(y0, y1))
            ok = (
                (min(y0, y1) <= ys)
                & (ys <= max(y0, y1))
                & (min(x0, x1) <= xs)
                & (xs <= max(x0, x1))
            )
            if not ok.all():
                return False
    return True


def check_all(figures: list[tuple[str, Any]], expected: set[str]) -> None:
    names = {name for name, _ in figures}
    assert expected <= names, sorted(expected - names)
    failures = {name: invisible_series(fig) for name, fig in figures}
    assert {name: bad for name, bad in failures.items() if bad} == {}
    # a figure without a visible series says in its legend that its data is zero everywhere
    empty = [(name, fig) for name, fig in figures if not any(_drawn(ax) for ax in fig.axes)]
    unexplained = [name for name, fig in empty if not _says_zero(fig)]
    assert unexplained == []


def _drawn(ax: Any) -> bool:
    return any(ZERO_MARK not in label for label, _ in series(ax))


def _says_zero(fig: Any) -> bool:
    return any(ZERO_MARK in label for ax in fig.axes for label in ax.get_legend_handles_labels()[1])


def test_matrix_report_plots_show_every_series(
    tmp_path: Path, figures: list[tuple[str, Any]]
) -> None:
    settings = {IDENTITY: identity_seqs(), BF16: spread_seqs(0.004), FP8: spread_seqs(0.6)}
    run = matrix_run(tmp_path / "m", settings)
    publish(*load_report(run))
    run_plots = {f"{n}.png" for n in ("ratio_hist", "probs", "position", "seq_length", "f_tau")}
    overlays = {f"compare_{n}.png" for n in ("ratio_hist", "position", "f_tau")}
    check_all(figures, run_plots | {"prob_bins.png"} | overlays)


def test_compare_plots_show_every_series(tmp_path: Path, figures: list[tuple[str, Any]]) -> None:
    """The first run's F(tau) is 0 at every tau (the identity), as in the issue."""
    first = make_run(tmp_path / "fp32", identity_seqs(), setting=IDENTITY)
    second = make_run(tmp_path / "bf16", spread_seqs(0.05), setting=BF16)
    write_comparison(load_comparison([first, second]), tmp_path / "cmp")
    check_all(figures, {f"compare_{n}.png" for n in ("ratio_hist", "position", "f_tau")})


def test_compare_of_matrix_runs_plots_show_every_series(
    tmp_path: Path, figures: list[tuple[str, Any]]
) -> None:
    """Two matrix runs, the identity first in both: one set of overlays per paired setting."""
    base = matrix_run(tmp_path / "base", {IDENTITY: identity_seqs(), BF16: spread_seqs(0.004)})
    head = matrix_run(tmp_path / "head", {IDENTITY: identity_seqs(), BF16: spread_seqs(0.02)})
    write_comparison(load_comparison([base, head]), tmp_path / "cmp")
    assert len(figures) == 6  # 3 overlays x 2 settings
    check_all(figures, {f"compare_{n}.png" for n in ("ratio_hist", "position", "f_tau")})
