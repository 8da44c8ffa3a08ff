"""The terminal report: health checks (table and exact output), histogram, worst tokens."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from mismatch_probe.metrics.presets import PRESET_COLUMNS
from mismatch_probe.metrics.verdicts import FAIL, NA, PASS, evaluate
from mismatch_probe.report import render
from mismatch_probe.report.terminal import histogram, verdict_table
from mismatch_probe.rundir import RunContext
from tests.views import METRICS as VIEW_METRICS
from tests.views import run_view, token

METRICS = {
    "kl": -0.2,
    "chi2_token": 0.5,
    "rollout_is_mean": 1.0,
    "rollout_is_eff_sample_size": 0.25,
    "f_tau_2": 0.0,
    "prob_abs_diff_max": 0.05,
    "token_mult_prob_error": 1.06,
}


def console(color_system: str | None = "standard") -> Console:
    return Console(
        file=io.StringIO(),
        width=100,
        force_terminal=True,
        color_system=color_system,  # type: ignore[arg-type]
    )


def output(c: Console) -> str:
    return c.file.getvalue()  # type: ignore[attr-defined]


def test_verdicts_follow_the_thresholds() -> None:
    verdicts = evaluate(METRICS)
    assert [(v.check.metric, v.status) for v in verdicts] == [
        ("kl", FAIL),  # |-0.2| > 0.1
        ("chi2_token", PASS),
        ("rollout_is_mean", PASS),
        ("rollout_is_eff_sample_size", FAIL),  # 0.25 < 0.3
        ("rollout_is_std", NA),  # IS off: not computed
        ("f_tau_2", PASS),
        ("prob_abs_diff_max", PASS),
        ("token_mult_prob_error", FAIL),  # 1.06 > 1.05 (NeMo-RL)
    ]
    edges = {"kl": 0.1, "chi2_token": 1.0, "rollout_is_mean": 2.0, "rollout_is_std": 1.0}
    edges |= {"rollout_is_eff_sample_size": 0.3, "f_tau_2": 0.01, "prob_abs_diff_max": 0.5}
    edges |= {"token_mult_prob_error": 1.05}
    assert {v.status for v in evaluate(edges)} == {PASS}  # bounds are inclusive
    outside = evaluate({"rollout_is_mean": 0.49, "kl": 0.1001})
    assert [v.status for v in outside if v.value is not None] == [FAIL, FAIL]


def test_verdict_lines_exact_output_in_colour() -> None:
    c = console()
    c.print(verdict_table(evaluate(METRICS)))
    red, green, dim, end = "\x1b[1;31m", "\x1b[32m", "\x1b[2m", "\x1b[0m"
    assert output(c) == (
        f"{red}✘ FAIL{end}  KL(rollout‖train), k1           |x| ≤ 0.1    -0.2          "
        f"{dim}kl (verl)                        {end}\n"
        f"{green}✔ PASS{end}  token χ² = E[ρ²] − 1            ≤ 1          0.5           "
        f"{dim}chi2_token (verl)                {end}\n"
        f"{green}✔ PASS{end}  IS weight mean                  in [0.5, 2]  1             "
        f"{dim}rollout_is_mean (verl)           {end}\n"
        f"{red}✘ FAIL{end}  IS effective sample size        ≥ 0.3        0.25          "
        f"{dim}rollout_is_eff_sample_size (verl){end}\n"
        f"{dim}· n/a {end}  IS weight std                   ≤ 1          not computed  "
        f"{dim}rollout_is_std (verl)            {end}\n"
        f"{green}✔ PASS{end}  tokens with ρ outside [0.5, 2]  ≤ 0.01       0             "
        f"{dim}f_tau_2 (ours)                   {end}\n"
        f"{green}✔ PASS{end}  max |p_train − p_rollout|       ≤ 0.5        0.05          "
        f"{dim}prob_abs_diff_max (ours)         {end}\n"
        f"{red}✘ FAIL{end}  mean exp|log ρ|                 ≤ 1.05       1.06          "
        f"{dim}token_mult_prob_error (NeMo-RL)  {end}\n"
    )


def test_histogram_exact_output() -> None:
    counts = [0] * 58 + [1, 10, 100, 30, 0, 2] + [0] * 57
    c = console(None)
    c.print(histogram({"lo": -3.0, "hi": 3.0, "counts": counts, "underflow": 3, "overflow": 0}))
    assert output(c) == (
        "log-ratio r = log p_train − log p_rollout  (bar ∝ log(1 + tokens))\n"
        "         r < -3.000 │████████████                            │ 3\n"
        "    -0.124 … -0.074 │██████                                  │ 1\n"
        "    -0.074 … -0.025 │████████████████████▊                   │ 10\n"
        "    -0.025 … +0.025 │████████████████████████████████████████│ 100\n"
        "    +0.025 … +0.074 │█████████████████████████████▊          │ 30\n"
        "    +0.074 … +0.124 │                                        │ 0\n"
        "    +0.124 … +0.174 │█████████▌                              │ 2\n"
    )


def test_wide_histogram_is_merged_to_at_most_24_rows() -> None:
    c = console(None)
    c.print(histogram({"lo": -3.0, "hi": 3.0, "counts": [1] * 121}))
    rows = output(c).splitlines()[1:]
    assert len(rows) == 21  # 121 bins, 6 per row
    assert rows[0].split("│")[-1] == " 6" and rows[-1].split("│")[-1] == " 1"


@pytest.fixture
def run() -> tuple[RunContext, None]:
    """The view of a run of 19 tokens: IS on, one preset, the worst tokens in context (one
    whose text looks like markup, one ``](javascript:`` token, one support flip)."""
    worst = (
        token("](javascript:", -1.5, before=" [x", after="alert(2)) ok", seq_pos=(1, 4)),
        token(" sat", 0.9, before="The cat", after="⏎ on", flip=True, seq_pos=(2, 2)),
        token("[bold]x[/bold]", 0.3, after=" cat"),
    )
    metrics = {**VIEW_METRICS, "rollout_is_mean": 1.01, "prob_abs_diff_max": 0.2}
    metrics |= {
        f"presets/token_is/{c}": v for c, v in zip(PRESET_COLUMNS, (0.0, 0.0, 0.99), strict=True)
    }
    config = {"presets": {"token_is": "token TIS at C=2"}}
    return run_view(metrics, worst=worst, config=config), None


def test_full_report_shows_every_part(run: tuple[RunContext, None]) -> None:
    c = console(None)
    render(*run, c)
    text = output(c)
    for part in (
        "  model           tiny-llama\n",
        "  precisions      rollout=bf16 | train=fp32\n",
        "  response tokens 19\n",
        "  responses       3\n",
        "Off-policy",
        "Importance sampling",
        "Extra diagnostics",
        "Presets: what each correction would do",
        "log-ratio r = log p_train − log p_rollout",
        "Worst tokens (largest |log ρ|)",
        "[x⟦](javascript:⟧alert(2)) ok",
        "support flip",
        "⟦[bold]x[/bold]⟧ cat",  # model text is never read as markup
        "The cat⟦ sat⟧⏎ on",
    ):
        assert part in text, part


def test_no_color_keeps_the_words(
    run: tuple[RunContext, None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    c = Console(file=io.StringIO(), width=100, force_terminal=True)
    render(*run, c)
    text = output(c)
    assert "\x1b[31m" not in text and "\x1b[32m" not in text and "\x1b[1;31m" not in text
    assert "✔ PASS" in text and "low-probability tail" in text
