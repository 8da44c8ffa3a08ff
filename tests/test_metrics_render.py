"""The rich tables of ``probe metrics``, compared on exact output (trailing spaces stripped)."""

from __future__ import annotations

import io

from rich.console import Console

from mismatch_probe.metrics import MetricsConfig, MetricsResult
from mismatch_probe.report.metrics_table import render_metrics

EXPECTED = """\
Data
┏━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━┓
┃ metric                 ┃       value ┃
┡━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━┩
│ num_tokens             │        1200 │
└────────────────────────┴─────────────┘
Importance sampling (token TIS 2)
┏━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━┓
┃ metric                  ┃      value ┃
┡━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━┩
│ rollout_is_mean         │    1.00123 │
└─────────────────────────┴────────────┘
Rejection sampling (token_k1 2)
┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━┓
┃ metric                              ┃ value ┃
┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━┩
│ rollout_rs_token_k1_masked_fraction │ 0.025 │
└─────────────────────────────────────┴───────┘
Off-policy
┏━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━┓
┃ metric       ┃                 value ┃
┡━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━┩
│ kl           │              -0.00012 │
│ k3_kl        │          1.79769e+308 │
└──────────────┴───────────────────────┘
Diagnostics
┏━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━┓
┃ metric              ┃          value ┃
┡━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━┩
│ f_tau_2             │            0.5 │
└─────────────────────┴────────────────┘
Presets: what each correction would do
┏━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━┳━━━━━━━━━┓
┃ preset   ┃ correction              ┃ tokens masked ┃ seqs masked ┃     ESS ┃
┡━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━╇━━━━━━━━━┩
│ token_is │ token TIS 2             │             0 │           0 │ 0.99875 │
│ geo_rs   │ seq_mean_k1 0.999_1.001 │          0.75 │    0.333333 │    0.25 │
└──────────┴─────────────────────────┴───────────────┴─────────────┴─────────┘
"""


def test_render_exact_output() -> None:
    cfg = MetricsConfig(
        rollout_rs="token_k1", rollout_rs_threshold="2", presets=("token_is", "geo_rs")
    )
    scalars = {
        "num_tokens": 1200.0,
        "rollout_is_mean": 1.0012345678,
        "rollout_rs_token_k1_masked_fraction": 0.025,
        "kl": -0.00012,
        "k3_kl": 1.79769e308,
        "f_tau_2": 0.5,
        "presets/token_is/token_masked_fraction": 0.0,
        "presets/token_is/seq_masked_fraction": 0.0,
        "presets/token_is/eff_sample_size": 0.99875,
        "presets/geo_rs/token_masked_fraction": 0.75,
        "presets/geo_rs/seq_masked_fraction": 1 / 3,
        "presets/geo_rs/eff_sample_size": 0.25,
    }
    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=False)
    render_metrics(MetricsResult(cfg, scalars, {}), console)
    assert "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n" == EXPECTED


def test_render_without_presets_or_is() -> None:
    cfg = MetricsConfig(rollout_is=None, presets=())
    buf = io.StringIO()
    render_metrics(MetricsResult(cfg, {"kl": 0.5}, {}), Console(file=buf, width=100))
    assert "Off-policy" in buf.getvalue() and "Presets" not in buf.getvalue()
