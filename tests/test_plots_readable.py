"""Plots a reader can read: the threshold sweep's two scales on their own panels with every curve
visible, and no matplotlib warning on stderr for a store of extreme log-probs (views and crafted
stores, no engine)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from mismatch_probe.metrics.decisions import K3_THRESHOLDS, RATIO_THRESHOLDS
from mismatch_probe.report.plots import new_figure, plot_threshold_sweep
from mismatch_probe.rundir.context import Entry
from tests.views import METRICS, RECOMMENDATION, run_view


def sweep_rows(token: float, seq: float) -> list[dict[str, float | str]]:
    """Every family's sweep, each with the same shares (curves lying on one another)."""
    grid = [(f, t) for f in ("token_tis", "token_icepop", "seq_is") for t in RATIO_THRESHOLDS]
    grid += [("seq_mean_k3", u) for u in K3_THRESHOLDS]
    return [
        {"family": f, "threshold": t, "token_fraction": token, "seq_fraction": seq} for f, t in grid
    ]


def drawn_sweep(rows: list[dict[str, float | str]]) -> tuple[object, list[object]]:
    tables = {"threshold_sweep": rows, "outliers": [], "recommendation": RECOMMENDATION}
    fig, ax = new_figure()
    plot_threshold_sweep(fig, ax, run_view(tables=tables))
    fig.canvas.draw()  # the layout applied, as when saved
    return fig, [a for a in fig.axes if a.lines]


@pytest.mark.parametrize("share", [0.0, 0.25])
def test_threshold_sweep_gives_each_scale_its_own_panel(share: float) -> None:
    fig, (left, right) = drawn_sweep(sweep_rows(share, share))
    xs = [{float(x) for x in line.get_xdata()} for line in left.lines]
    assert set().union(*xs) == set(K3_THRESHOLDS)  # U only
    xs = [{float(x) for x in line.get_xdata()} for line in right.lines]
    assert set().union(*xs) == set(RATIO_THRESHOLDS)  # C only
    assert left.get_xscale() == right.get_xscale() == "log"
    # two lines per family (tokens solid, sequences dashed), three ratio families on the right
    assert len([line for line in left.lines if len(line.get_xdata()) > 1]) == 2
    assert len([line for line in right.lines if len(line.get_xdata()) > 1]) == 6
    for ax in (left, right):
        lo, hi = ax.get_ylim()
        assert lo < share <= hi or (share == 0.0 and lo < 0.0)  # a zero share above the spine
        x_lo, x_hi = ax.get_xlim()
        for line in ax.lines:
            x = np.asarray(line.get_xdata(), dtype=float)
            assert np.all((x > x_lo) & (x < x_hi))  # no marker on the frame
        assert ax.get_legend() is None  # the key is below the panels, over no curve
    assert len(fig.legends) == 1  # type: ignore[attr-defined]
    # curves with equal shares stay visible: each ratio family its own marker or size
    looks = {
        (line.get_marker(), line.get_markersize())
        for line in right.lines
        if len(line.get_xdata()) > 1
    }
    assert len(looks) == 3  # (solid and dashed lines of a family share theirs)


def entries(k3: list[float]) -> list[Entry]:
    return [
        Entry(f"rollout=s{i} | train=fp32", {**METRICS, "k3_kl": v}, {}) for i, v in enumerate(k3)
    ]


@pytest.mark.parametrize(
    "k3", [[1.7976931348623157e308, 7.2e86, 0.0], [1e300, 1e-300], [math.inf, 0.0]]
)
def test_k3_by_setting_warns_of_nothing_at_extreme_values(tmp_path: Path, k3: list[float]) -> None:
    from mismatch_probe.report.plots import write_k3_by_setting

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path, _ = write_k3_by_setting(entries(k3), tmp_path / "k3.png")
    assert path.stat().st_size > 0


def test_report_of_extreme_logprobs_prints_no_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A matrix whose clamped k3 reaches the float range's end (a -3e38 placeholder log-prob):
    ``probe report`` writes every plot and nothing on stderr names a warning."""
    from tests.cli_runner import run_probe
    from tests.test_report_fixtures import Seq, matrix_run, uniform_seqs

    n = 40
    far = [Seq(["a"] * n, [-200.0] * n, [-1e-9] * n, [False] * n)]
    placeholder = [
        Seq(["a", "b", "c"], [-1e30, -0.5, -3e38], [-0.1, -1e30, -0.2], [True, True, False]),
        Seq(["x", "y"], [-0.7, -80.0], [-0.7, -1e-8], [False, False]),
    ]
    settings = {
        "rollout=fp16 | train=fp32": uniform_seqs(0.0, [3]),
        "rollout=fp32 | train=fp32": far,
        "rollout=bf16 | train=fp32": placeholder,
    }
    run = matrix_run(tmp_path / "m", settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = run_probe(["report", str(run)], monkeypatch, capsys)
    assert code == 0, err
    assert [str(w.message) for w in caught] == []
    assert "Warning" not in err
    assert (run / "plots" / "settings" / "k3_by_setting.png").exists()


def test_trend_of_an_overflowing_log_prob_warns_of_nothing(tmp_path: Path) -> None:
    """An ingested step whose training log-prob is 800 (exp overflows): the trend plot is drawn
    without a matplotlib warning (the values beyond ``DRAW_MAX`` drawn at it)."""
    from mismatch_probe.ingest import IngestConfig, run_ingest
    from tests.ingest_fixtures import synthetic_steps, write_prime_rl

    data = synthetic_steps([1, 2], seqs=3)
    data[2][1].train[0] = 800.0
    src = write_prime_rl(tmp_path / "src", data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_ingest(IngestConfig("prime-rl", src, tmp_path / "run"))
    assert [str(w.message) for w in caught] == []
    assert (result.out / "plots" / "trend.png").stat().st_size > 0
