"""Which metrics a report shows, in which group and order, and how numbers are written.

Shared by the terminal, Markdown and comparison reports so that they agree on names, order and
formatting. Plain data plus two small functions; no rendering here.
"""

from __future__ import annotations

import math
from pathlib import PurePath
from typing import Any

from mismatch_probe.errors import printable
from mismatch_probe.metrics.integrity import POSITIVE_ABOVE
from mismatch_probe.metrics.parity import PARITY_KEYS
from mismatch_probe.metrics.presets import PRESET_COLUMNS, PRESET_PREFIX

# (key, what it means) for the key-metrics table of report.md and the rows of `probe compare`.
KEY_METRICS: tuple[tuple[str, str], ...] = (
    ("num_tokens", "response tokens"),
    ("num_sequences", "responses"),
    ("k3_kl", "KL(rollout‖train), k3 estimator: mean of ρ − 1 − log ρ"),
    ("kl", "KL(rollout‖train), k1 estimator: mean of log p_rollout − log p_train"),
    ("chi2_token", "token χ²: E[ρ²] − 1"),
    ("chi2_seq", "sequence χ²: E[ρ_seq²] − 1"),
    ("log_ratio_abs_mean", "mean |log ρ| per token (nats)"),
    ("log_ratio_abs_max", "max |log ρ| (nats)"),
    ("prob_abs_diff_mean", "mean |p_train − p_rollout|"),
    ("prob_abs_diff_max", "max |p_train − p_rollout|"),
    ("prob_pearson", "Pearson correlation of p_train and p_rollout"),
    ("f_tau_1.1", "share of tokens with max(ρ, 1/ρ) > 1.1"),
    ("f_tau_2", "share of tokens with ρ outside [0.5, 2]"),
    ("rollout_is_eff_sample_size", "IS effective sample size (share of the batch)"),
    ("clip_fraction_0.2", "share of tokens PPO's clip (|ρ − 1| > 0.2) touches at lr 0"),
    ("clip_fraction_0.28", "share of tokens DAPO's upper clip (|ρ − 1| > 0.28) touches at lr 0"),
    ("outlier_share_top1pct", "share of the k3 carried by the top 1% of sequences"),
    ("entropy_mean", "mean training-side entropy per token (nats)"),
    ("seq_log_ratio_slope_per_1k", "slope of the sequence log-ratio sum (nats per 1K tokens)"),
    ("support_flip_fraction", "share of tokens flagged as a support flip"),
)

OFF_POLICY = (
    "kl",
    "k3_kl",
    "chi2_token",
    "chi2_seq",
    "training_ppl",
    "rollout_ppl",
    "ppl_ratio",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
)
IMPORTANCE_SAMPLING = (
    "rollout_is_mean",
    "rollout_is_std",
    "rollout_is_eff_sample_size",
    "rollout_is_min",
    "rollout_is_max",
    "rollout_is_ratio_fraction_high",
    "rollout_is_ratio_fraction_low",
    "rollout_is_oob_ratio",
    "rollout_is_batch_norm_factor",
    "rollout_is_seq_mean",
    "rollout_is_seq_std",
    "rollout_is_seq_max_deviation",
)
DIAGNOSTICS = (
    "log_ratio_abs_mean",
    "log_ratio_abs_max",
    "prob_abs_diff_mean",
    "prob_abs_diff_max",
    "seq_prob_abs_diff_max_mean",
    "seq_prob_abs_diff_max_gt_0.5",
    "prob_pearson",
    "f_tau_1.01",
    "f_tau_1.1",
    "f_tau_1.5",
    "f_tau_2",
    "f_tau_5",
    "f_tau_10",
    "ipo_masked_fraction_0.1",
    "ipo_masked_fraction_0.2",
    "ipo_masked_fraction_0.3",
    "seq_log_ratio_slope_per_1k",
    "support_flip_fraction",
    "support_flip_abs_log_ratio_share",
    "support_flip_k3_share",
    "clip_fraction_0.2",
    "clip_fraction_0.28",
    "outlier_share_top1pct",
    "entropy_mean",
)

# Signed metrics whose value sits near 0 (a sign flip is no "-534%", no "x-4.34"): a change of
# one is a difference, in the PR comment and in the terminal comparison.
SIGNED = frozenset(
    {"kl", "log_ppl_diff", "log_ppl_diff_max", "log_ppl_diff_min", "seq_log_ratio_slope_per_1k"}
)


def rejection_keys(metrics: dict[str, float]) -> tuple[str, ...]:
    """The masked fractions of the configured rejection options (none when RS is off)."""
    return tuple(
        k for k in metrics if k.startswith("rollout_rs_") and k.endswith("masked_fraction")
    )


def metric_groups(metrics: dict[str, float]) -> list[tuple[str, list[str]]]:
    """``[(title, keys)]`` of the grouped tables, keeping only keys present and groups not
    empty; presets have their own table."""
    groups = (
        ("Off-policy", OFF_POLICY),
        ("Importance sampling", IMPORTANCE_SAMPLING),
        ("Rejection sampling", rejection_keys(metrics)),
        ("Extra diagnostics", DIAGNOSTICS),
        ("Parity block", PARITY_KEYS),  # metrics spec section 9, UniRL's names
    )
    out = [(title, [k for k in keys if k in metrics]) for title, keys in groups]
    return [(title, keys) for title, keys in out if keys]


def preset_rows(metrics: dict[str, float], config: dict) -> list[tuple[str, str, list[float]]]:
    """``[(preset, correction, [token masked, seq masked, ESS])]`` for each computed preset, in
    ``PRESETS`` order whatever the order the config was stored in (``metrics.json`` sorts its
    keys), so every renderer lists them alike."""
    from mismatch_probe.metrics.presets import PRESETS

    described = config.get("presets") or {}
    known = list(PRESETS)
    ordered = sorted(described, key=lambda n: (known.index(n) if n in known else len(known), n))
    rows = []
    for name, correction in ((n, described[n]) for n in ordered):
        keys = [f"{PRESET_PREFIX}{name}/{col}" for col in PRESET_COLUMNS]
        if all(k in metrics for k in keys):
            rows.append((name, correction, [metrics[k] for k in keys]))
    return rows


def fmt(key: str, value: float, digits: int = 4) -> str:
    """A metric value for people: counts as integers, everything else to ``digits``
    significant digits."""
    if key.startswith("num_"):
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def prob_text(logprob: float, digits: int) -> str:
    """A token probability from its log-prob, never above 1 and never an overflow: a log-prob
    above 0 (rounding aside) is no log-prob at all and is shown as such (``log p +5``), so a
    report never shows a probability of 148 (the ``positive_logprob`` integrity check says
    why)."""
    if not math.isfinite(logprob):
        return "—"
    if logprob > POSITIVE_ABOVE:
        return f"log p {logprob:+.{digits}g}"
    return f"{math.exp(min(logprob, 0.0)):.{digits}g}"


def show_blank(token: str) -> str:
    """A token made only of spaces shown as ␣ (it would be invisible otherwise)."""
    return token if token.strip(" ") else token.replace(" ", "␣")


# Other control characters as their Unicode pictures (U+2400 + code, ␡ for DEL), C1 controls
# and bidi overrides as U+FFFD: model text can neither hide nor reorder what a report shows.
def visible(text: str) -> str:
    """Model text on one line: newlines and tabs shown as ⏎ and ⇥, every other control
    character (an ANSI escape, a bidi override) escaped as ``\\x1b`` (``errors.printable``).
    Every renderer passes text from a model, a file or a path through this."""
    return printable(text.replace("\r", "").replace("\n", "⏎").replace("\t", "⇥"))


def settings_rows(run: dict[str, Any], label: str, metrics: dict[str, float]) -> list[tuple]:
    """``[(name, value)]``: what was measured, from ``run.json`` (``?`` where it is silent)."""
    if run.get("kind") == "ingest":
        return ingest_rows(run, metrics)
    s, prompts = run.get("sampling", {}), run.get("prompts", {})
    sampling = " ".join(f"{k}={s[k]}" for k in ("temperature", "top_p", "top_k") if k in s)
    return [
        ("model", model_text(run)),
        ("precisions", precisions_text(run, label)),
        ("prompts", f"{prompts.get('count', '?')} from {file_name(prompts.get('path'))}"),
        ("chat template", yes_no(prompts.get("chat"))),
        ("sampling", sampling or "?"),
        ("max tokens", s.get("max_tokens", "?")),
        ("log-probs", s.get("logprobs_mode", "?")),
        ("response tokens", fmt("num_tokens", metrics.get("num_tokens", 0.0))),
        ("responses", fmt("num_sequences", metrics.get("num_sequences", 0.0))),
    ]


def steps_cell(counts: dict[str, Any]) -> str:
    """``3 (1..4)``, plus the steps read whose batches trained on no token."""
    text = f"{counts.get('steps', '?')} ({counts.get('first_step')}..{counts.get('last_step')})"
    untrained = counts.get("steps_without_trained_tokens") or []
    if untrained:
        text += f"; no trained token at step {', '.join(str(s) for s in untrained)}"
    return text


def precisions_text(run: dict[str, Any], label: str) -> str:
    """The setting described, and for a matrix run that it is one of several (all judged in
    the grid of every setting)."""
    settings = run.get("settings")
    if not isinstance(settings, list) or len(settings) < 2:
        return label
    skipped = sum(1 for r in run.get("rollouts") or () if isinstance(r, dict) and r.get("skipped"))
    if not skipped:
        return f"{label} (one of {len(settings)} settings; every setting is judged in the grid)"
    return (
        f"{label} (one of {len(settings)} settings asked for; those that did not run are "
        "listed above, the others judged in the grid)"
    )


def model_text(run: dict[str, Any]) -> str:
    """``SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to float32)``: the model's name and what
    its weights are (``run.json`` model.source, when recorded)."""
    model = run.get("model", {})
    name, source = model.get("name", "?"), model.get("source")
    return f"{name} ({source})" if source else str(name)


def file_name(path: Any) -> str:
    """A path from ``run.json`` by its file name only: no absolute path of the user's machine
    reaches a report or a PR comment."""
    if not isinstance(path, str) or not path:
        return "?"
    return PurePath(path).name or path


def yes_no(value: Any) -> str:
    """A recorded boolean as ``yes`` / ``no`` (``?`` when not recorded)."""
    return {True: "yes", False: "no"}.get(value, "?") if isinstance(value, bool) else "?"


def ingest_rows(run: dict[str, Any], metrics: dict[str, float]) -> list[tuple]:
    """What an ingested run measured: the framework's logs, steps and log-prob fields."""
    source, available, counts = (
        run.get("source", {}),
        run.get("available", {}),
        run.get("counts", {}),
    )
    return [
        ("source", f"{source.get('format', '?')} {file_name(source.get('path'))}"),
        ("format", source.get("format_version", "?")),
        ("steps", steps_cell(counts)),
        ("rollout side", available.get("rollout_logprobs", "?")),
        ("training side", available.get("train_logprobs", "?")),
        ("model", run.get("model", {}).get("name", "not given")),
        ("response tokens", fmt("num_tokens", metrics.get("num_tokens", 0.0))),
        ("responses", fmt("num_sequences", metrics.get("num_sequences", 0.0))),
    ]
