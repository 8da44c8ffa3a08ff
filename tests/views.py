"""Views built directly (``rundir.RunContext`` instances), for the tests of a renderer: what it
is handed, written by hand, no token store, no Parquet file.

``run_view`` fills what a test leaves out with a small, valid run: one setting, a log-ratio
histogram of 19 tokens, no worst token, no outlier, a clean integrity, no preset.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mismatch_probe.metrics.integrity import Integrity
from mismatch_probe.rundir import RunContext, WorstToken

SETTING = "rollout=bf16 | train=fp32"
RUN: dict[str, Any] = {
    "setting": SETTING,
    "model": {"name": "tiny-llama"},
    "prompts": {"path": "/data/p.jsonl", "count": 2, "chat": False},
    "sampling": {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 16,
        "logprobs_mode": "raw",
    },
}
METRICS: dict[str, float] = {
    "num_tokens": 19.0,
    "num_sequences": 3.0,
    "k3_kl": 0.0123,
    "kl": -0.0045,
    "chi2_token": 0.031,
    "prob_abs_diff_max": 0.2,
    "f_tau_2": 0.0,
}
HIST = {"lo": -3.0, "hi": 3.0, "counts": [0] * 59 + [2, 15, 2] + [0] * 59}
RECOMMENDATION = {"outcome": "none_needed", "reason": "None needed: no verdict fails."}


def token(
    text: str,
    log_ratio: float,
    before: str = "",
    after: str = "",
    flip: bool | None = False,
    seq_pos: tuple[int, int] = (0, 0),
    rollout: float = 0.4,
) -> WorstToken:
    """A worst token: its text in context, ``r``, the rollout probability ``rollout``."""
    lp = math.log(rollout)
    return WorstToken(*seq_pos, text, before, after, log_ratio, lp, lp + log_ratio, flip)


def run_view(
    metrics: dict[str, float] | None = None,
    run: dict[str, Any] | None = None,
    **fields: Any,
) -> RunContext:
    """A ``RunContext`` of ``metrics`` (``METRICS`` by default) and ``run`` (``RUN``); any other
    field of the view by name (``worst``, ``tables``, ``config``, ``integrity``, ...)."""
    base: dict[str, Any] = {
        "run_dir": Path("runs") / "run",
        "run": RUN if run is None else run,
        "metrics": METRICS if metrics is None else metrics,
        "config": {"presets": {}},
        "curves": {"log_ratio_hist": HIST},
        "worst": (),
        "tables": {"threshold_sweep": [], "outliers": [], "recommendation": RECOMMENDATION},
        "integrity": Integrity(),
    }
    return RunContext(**{**base, **fields})
