"""Every name of ``metrics.json``: its definition and where it comes from, in one table.

``NAMES`` holds one ``MetricName`` per flat key *pattern*: a placeholder in angle brackets
stands for each value of one of the metric code's own tables (``PLACEHOLDERS``:
``<option>`` for ``RS_OPTIONS``, ``<tau>`` for ``SPEC_TAUS``, ``<preset>`` for ``PRESETS``,
...), so ``rollout_rs_<option>_mean`` is 17 keys and a new rejection option is documented by
the table it is added to. ``STRUCTURED`` does the same for the keys of ``metrics.json`` that
are records or lists, not numbers (``STRUCTURED_KEYS``).

This table is the one place the words live: the docs site's metrics reference is generated
from it (``docs/gen.py``), and ``tests/test_metric_names.py`` runs ``compute_metrics`` under
every option and checks both ways that the keys it emits are exactly the keys these patterns
expand to. Notation, as in every definition below: ``r = train_logprob - rollout_logprob``
(natural logs, per valid token), ``rho = exp(r)``, ``clampB(x) = clamp(x, -20, 20)``,
``mmean`` the masked mean over valid tokens (verl's ``sum / (count + 1e-8)``), ``mmean_i`` /
``msum_i`` the mean / sum over the valid tokens of sequence ``i``. Plain data: no computation.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from mismatch_probe.metrics.config import RS_OPTIONS
from mismatch_probe.metrics.decisions import CLIP_EPS
from mismatch_probe.metrics.diagnostics import IPO_EPS, SPEC_TAUS
from mismatch_probe.metrics.presets import PRESET_COLUMNS, PRESET_PREFIX, PRESETS

# Where a name (and its formula) comes from: the key of ``MetricName.source``.
SOURCES: dict[str, str] = {
    "verl": "verl's rollout-correction metrics (`verl/trainer/ppo/rollout_corr_helper.py`: "
    "`compute_rollout_correction_and_rejection_mask`, `compute_offpolicy_metrics`; docs "
    "`docs/algo/rollout_corr.md`), same names and formulas",
    "NeMo-RL": "NeMo-RL's training-inference error measures (`token_mult_prob_error`, "
    "`gen_kl_error`, `policy_kl_error`)",
    "TorchTitan": "TorchTitan's bitwise-parity measure",
    "literature": "the mismatch literature (the TIS blog's per-response view, MiniMax-M1's "
    "probability correlation, the MoE routing-replay paper's F(tau), the FP16-vs-BF16 paper's "
    "length slope, IPO / prime-rl's DPPO probability mask)",
    "ours": "mismatch_probe's own",
    "UniRL": "UniRL's fail-closed parity block (UniRL#430/#431), same names",
}

# Placeholder -> the values it stands for, each written as it is in a key.
PLACEHOLDERS: dict[str, tuple[str, ...]] = {
    "<option>": RS_OPTIONS,
    "<k1_option>": tuple(option for option in RS_OPTIONS if option.endswith("_k1")),
    "<tau>": tuple(f"{tau:g}" for tau in SPEC_TAUS),
    "<ipo_eps>": tuple(f"{eps:g}" for eps in IPO_EPS),
    "<clip_eps>": tuple(f"{eps:g}" for eps in CLIP_EPS),
    "<preset>": tuple(PRESETS),
}

# The groups of the reference, in the order it shows them.
GROUPS = (
    "Counts",
    "Importance sampling",
    "Rejection sampling",
    "Off-policy",
    "Diagnostics",
    "Other frameworks and bitwise measures",
    "From numbers to decisions",
    "Presets",
    "Multi-turn",
)


@dataclass(frozen=True)
class MetricName:
    """One flat key pattern of ``metrics.json``.

    Args:
        pattern: the key, placeholders (``PLACEHOLDERS``) in angle brackets.
        definition: what the number is, in the module notation.
        source: a key of ``SOURCES``.
        group: one of ``GROUPS``.
        when: the condition under which the key is present ("" = always).
    """

    pattern: str
    definition: str
    source: str
    group: str
    when: str = ""

    def names(self) -> tuple[str, ...]:
        """Every concrete key this pattern stands for (each placeholder by each of its values)."""
        names = [self.pattern]
        for placeholder, values in PLACEHOLDERS.items():
            if placeholder in self.pattern:
                names = [n.replace(placeholder, v) for n in names for v in values]
        return tuple(names)

    def regex(self) -> re.Pattern[str]:
        """Matches exactly the keys of ``names()``."""
        return _compiled(self.pattern)


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    alternation = {p: "|".join(map(re.escape, v)) for p, v in PLACEHOLDERS.items()}
    parts = re.split(r"(<[a-z0-9_]+>)", pattern)
    return re.compile(
        "".join(f"(?:{alternation[p]})" if p in alternation else re.escape(p) for p in parts)
    )


IS_ON = "IS on (`--rollout-is token`, the default, or `sequence`)"
ICEPOP = "an `L_U` (IcePop) `--rollout-is-threshold`"
RS_ON = "`--rollout-rs` names options"
K1_RS = (
    "`--rollout-rs` names the k1 option (`<k1_option>`: `token_k1`, `seq_sum_k1`, `seq_mean_k1`)"
)
FLIP = "the store has `support_flip` (every scan)"
TRAJ = "the sequences store holds multi-turn trajectories (a scan of a multi-turn prompts file)"
_RS = "rollout_rs_<option>"
_RS_WHEN = "`--rollout-rs` names the option"
_IS, _RSG, _OFF, _DIAG = GROUPS[1], GROUPS[2], GROUPS[3], GROUPS[4]
_OTHER, _DEC = GROUPS[5], GROUPS[6]


def _is(pattern: str, definition: str, when: str = IS_ON) -> MetricName:
    return MetricName(pattern, definition, "verl", _IS, when)


def _rs(suffix: str, definition: str, when: str = _RS_WHEN) -> MetricName:
    return MetricName(f"{_RS}_{suffix}", definition, "verl", _RSG, when)


NAMES: tuple[MetricName, ...] = (
    MetricName("num_tokens", "valid response tokens (mask 1)", "ours", GROUPS[0]),
    MetricName(
        "num_sequences", "sequences (responses), empty ones included: `S`", "ours", GROUPS[0]
    ),
    MetricName("num_valid_sequences", "sequences with at least one valid token", "ours", GROUPS[0]),
    # --- 1. importance-sampling weights (verl's rollout_is_*) ------------------------------------
    _is(
        "rollout_is_mean",
        "`mmean(w)`: the mean IS weight after truncation (TIS: `w = min(raw_w, C)`; IcePop: "
        "`raw_w` inside `[L, U]`, else 0), with `raw_w = exp(clampB(r))` per token, or "
        "`exp(clampB(msum_i(r)))` on every token of sequence i at sequence level",
    ),
    _is(
        "rollout_is_max",
        "token level: max of `w` over valid tokens; sequence level: `exp(min(max_i s_i, 20))`, "
        "`s_i = msum_i(r)`",
    ),
    _is(
        "rollout_is_min",
        "token level: min of `w` over valid tokens; sequence level: `exp(min_i s_i)` (not "
        "clamped; capped at the largest float64)",
    ),
    _is(
        "rollout_is_ratio_fraction_high",
        "token level: `mmean(raw_w > U)`; sequence level: the share of sequences with "
        "`s_i > log U` (U = C for TIS)",
    ),
    _is(
        "rollout_is_ratio_fraction_low",
        "token level: `mmean(raw_w < L)`; sequence level: the share of sequences with "
        "`s_i < log L` (L = 1/C for TIS)",
    ),
    _is(
        "rollout_is_std",
        "`sqrt(max(0, mmean(c^2) - mmean(c)^2))` with `c = clamp(w, 0, U)`; 0 with fewer than "
        "two valid tokens",
    ),
    _is(
        "rollout_is_eff_sample_size",
        "`1 / mmean((c / (mmean(c) + 1e-8))^2)`, `c` as for `rollout_is_std`: the share of the "
        "batch the weighted sample is worth, at most 1 (equal weights give 1 up to the rounding "
        "of the 1e-8, clamped); 0 when every weight is 0 (where verl divides by 0)",
    ),
    _is("rollout_is_seq_mean", "mean over sequences of `q_i = mmean_i(w)`"),
    _is("rollout_is_seq_std", "unbiased standard deviation over sequences of `q_i`"),
    _is("rollout_is_seq_max", "max over sequences of `q_i`"),
    _is("rollout_is_seq_min", "min over sequences of `q_i`"),
    _is("rollout_is_seq_max_deviation", "`max_i abs(q_i - 1)`"),
    _is(
        "rollout_is_seq_fraction_high",
        "share of sequences with `q'_i > U`, `q'_i = mmean_i(raw_w)` (before truncation)",
    ),
    _is("rollout_is_seq_fraction_low", "share of sequences with `q'_i < L`"),
    _is("rollout_is_oob_ratio", "`mmean(raw_w < L or raw_w > U)`: the share IcePop zeroes", ICEPOP),
    _is(
        "rollout_is_batch_norm_factor",
        "the batch normalisation factor: token level `mmean(w)`, sequence level the mean over "
        "valid sequences of `mmean_i(w)`; 1.0 when that mean is at most 1e-8 (skipped)",
        "`--batch-normalize`",
    ),
    # --- 2. rejection sampling (verl's rollout_rs_*) --------------------------------------------
    _rs(
        "mean",
        "`mmean` of the option's token statistic on `rs = clampB(r)`: `k1 = -rs`, "
        "`k2 = rs^2 / 2`, `k3 = exp(rs) - 1 - rs`; a sequence option (`seq_sum_*`: `msum_i`, "
        "`seq_mean_*`: `mmean_i`, `seq_max_*`: max over the sequence's valid tokens) broadcasts "
        "its sequence value to the sequence's tokens",
    ),
    _rs(
        "max",
        "max of the statistic: over valid sequences' values `v_i` (sequence options) or "
        "valid tokens (token options)",
    ),
    _rs("min", "min of the statistic, over the same values as `_max`"),
    _rs(
        "fraction_high",
        "share above the upper threshold (`log U` for k1, `U` for k2/k3): of valid sequences "
        "(sequence options) or `mmean(stat > Uth)` (token options)",
    ),
    _rs(
        "fraction_low",
        "share below the lower threshold `log L`; 0 for k2/k3 options (no lower test)",
    ),
    _rs("std", "`rollout_is_std`'s formula on the statistic clamped to `[log L (or 0), Uth]`"),
    _rs(
        "seq_mean",
        "mean over valid sequences of `v_i`: the sequence statistic (sequence options) or "
        "`mmean_i` of the token statistic (token options)",
    ),
    _rs("seq_std", "unbiased standard deviation of `v_i` over valid sequences"),
    _rs("seq_max", "max of `v_i` over valid sequences"),
    _rs("seq_min", "min of `v_i` over valid sequences"),
    _rs("seq_max_deviation", "`max_i abs(v_i)`"),
    _rs("seq_fraction_high", "share of valid sequences with `v_i > Uth`"),
    MetricName(
        "rollout_rs_<k1_option>_seq_fraction_low",
        "share of valid sequences with `v_i < log L`",
        "verl",
        _RSG,
        K1_RS,
    ),
    _rs("masked_fraction", "`mmean(1 - keep)` for this option alone"),
    _rs(
        "seq_masked_fraction",
        "share of valid sequences with at least one valid token this option drops",
    ),
    MetricName(
        "rollout_rs_masked_fraction",
        "`mmean(1 - keep)`, `keep` the AND of every option's mask",
        "verl",
        _RSG,
        RS_ON,
    ),
    MetricName(
        "rollout_rs_seq_masked_fraction",
        "share of all sequences with at least one valid token dropped by the combined mask",
        "verl",
        _RSG,
        RS_ON,
    ),
    # --- 3. off-policy (verl's compute_offpolicy_metrics) ---------------------------------------
    MetricName(
        "kl",
        "`mmean(rollout_lp - train_lp)`: the k1 estimator of KL(rollout ‖ train); can be negative",
        "verl",
        _OFF,
    ),
    MetricName(
        "k3_kl",
        "`mmean(exp(r) - r - 1)`: the k3 estimator of KL(rollout ‖ train), the headline number "
        "(NeMo-RL's `gen_kl_error`); capped at the largest float64 on overflow",
        "verl",
        _OFF,
    ),
    MetricName("k3_kl_overflow", "1.0 when `k3_kl` was capped, else 0.0", "ours", _OFF),
    MetricName(
        "training_ppl", "mean over sequences of `exp(-mmean_i(train_lp))` (capped)", "verl", _OFF
    ),
    MetricName("training_log_ppl", "mean over sequences of `-mmean_i(train_lp)`", "verl", _OFF),
    MetricName(
        "rollout_ppl", "mean over sequences of `exp(-mmean_i(rollout_lp))` (capped)", "verl", _OFF
    ),
    MetricName("rollout_log_ppl", "mean over sequences of `-mmean_i(rollout_lp)`", "verl", _OFF),
    MetricName("ppl_overflow", "1.0 when a perplexity or `ppl_ratio` was capped", "ours", _OFF),
    MetricName(
        "log_ppl_diff",
        "mean over sequences of `d_i = mmean_i(rollout_lp) - mmean_i(train_lp)`",
        "verl",
        _OFF,
    ),
    MetricName("log_ppl_abs_diff", "mean over sequences of `abs(d_i)`", "verl", _OFF),
    MetricName("log_ppl_diff_max", "max over sequences of `d_i`", "verl", _OFF),
    MetricName("log_ppl_diff_min", "min over sequences of `d_i`", "verl", _OFF),
    MetricName("ppl_ratio", "mean over sequences of `exp(d_i)` (capped)", "verl", _OFF),
    MetricName(
        "chi2_token",
        "`mmean(exp(clampB(r))^2) - 1`: the token χ², the variance a token IS correction pays",
        "verl",
        _OFF,
    ),
    MetricName(
        "chi2_seq",
        "mean over sequences of `exp(2 clampB(msum_i(r))) - 1`: the sequence χ²",
        "verl",
        _OFF,
    ),
    # --- 4. diagnostics from the literature -------------------------------------------------
    MetricName("log_ratio_abs_mean", "`mmean(abs(r))` (nats)", "ours", _DIAG),
    MetricName("log_ratio_abs_max", "max `abs(r)` over valid tokens (nats)", "ours", _DIAG),
    MetricName(
        "prob_abs_diff_mean", "`mmean(abs(exp(train_lp) - exp(rollout_lp)))`", "literature", _DIAG
    ),
    MetricName(
        "prob_abs_diff_max",
        "max `abs(exp(train_lp) - exp(rollout_lp))` over valid tokens",
        "literature",
        _DIAG,
    ),
    MetricName(
        "seq_prob_abs_diff_max_mean",
        "mean over sequences of each response's max `abs(dp)` (0 for an empty one)",
        "literature",
        _DIAG,
    ),
    MetricName(
        "seq_prob_abs_diff_max_gt_0.5",
        "share of sequences whose max `abs(dp)` exceeds 0.5",
        "literature",
        _DIAG,
    ),
    MetricName(
        "prob_pearson",
        "Pearson correlation of the valid tokens' `exp(train_lp)` and "
        "`exp(rollout_lp)` (1.0 when both are constant and equal)",
        "literature",
        _DIAG,
    ),
    MetricName(
        "f_tau_<tau>",
        "F(τ): share of valid tokens with `max(rho, 1/rho) > τ` "
        "(`f_tau_2`: the ratio leaves [0.5, 2])",
        "literature",
        _DIAG,
    ),
    MetricName(
        "seq_log_ratio_slope_per_1k",
        "least-squares slope of `msum_i(r)` against "
        "response length in thousands of tokens (nats per 1K tokens)",
        "literature",
        _DIAG,
    ),
    MetricName(
        "ipo_masked_fraction_<ipo_eps>",
        "share of valid tokens with `abs(exp(train_lp) - exp(rollout_lp)) > eps`: what the "
        "IPO / DPPO probability-difference mask drops",
        "literature",
        _DIAG,
    ),
    MetricName(
        "support_flip_fraction",
        "share of valid tokens flagged as a support flip (the "
        "top-k/top-p boundary within `--flip-eps` of flipping)",
        "ours",
        _DIAG,
        FLIP,
    ),
    MetricName(
        "support_flip_abs_log_ratio_share",
        "share of the run's total `abs(r)` carried by flagged tokens (0 when the total is 0)",
        "ours",
        _DIAG,
        FLIP,
    ),
    MetricName(
        "support_flip_k3_share",
        "share of the run's total k3 (`exp(rs) - 1 - rs`, "
        "`rs = clampB(r)`) carried by flagged tokens",
        "ours",
        _DIAG,
        FLIP,
    ),
    # --- 6. other frameworks' names and bitwise measures ------------------------------------
    MetricName(
        "token_mult_prob_error",
        "`mmean(exp(clampB(abs(r))))`; 1.0 is identity, NeMo-RL's docs flag above 1.05",
        "NeMo-RL",
        _OTHER,
    ),
    MetricName(
        "seq_mult_prob_error_max",
        "max over valid sequences of `mmean_i(exp(clampB(abs(r))))`",
        "NeMo-RL",
        _OTHER,
    ),
    MetricName(
        "seq_mult_prob_error_mean", "mean of the same over valid sequences", "NeMo-RL", _OTHER
    ),
    MetricName(
        "seq_mult_prob_error_min", "min of the same over valid sequences", "NeMo-RL", _OTHER
    ),
    MetricName(
        "k3_kl_reverse",
        "`mmean(exp(-r) + r - 1)`: k3 with the ratio inverted "
        "(NeMo-RL's `policy_kl_error`); capped on overflow",
        "NeMo-RL",
        _OTHER,
    ),
    MetricName("k3_kl_reverse_overflow", "1.0 when `k3_kl_reverse` was capped", "ours", _OTHER),
    MetricName(
        "bitwise_identical_fraction",
        "share of valid tokens with `train_lp == "
        "rollout_lp` exactly, as stored (float32); 1.0 is what batch-invariant kernels "
        "reach",
        "ours",
        _OTHER,
    ),
    MetricName(
        "ratio_tokens_different", "share of valid tokens with `abs(r) > 1e-6`", "TorchTitan", _OTHER
    ),
    MetricName(
        "first_token_abs_log_ratio_mean",
        "mean `abs(r)` over the first valid token of each valid sequence",
        "ours",
        _OTHER,
    ),
    MetricName(
        "rest_abs_log_ratio_mean", "mean `abs(r)` over every other valid token", "ours", _OTHER
    ),
    # the parity block (spec 9): a fixed contract, UniRL's names
    MetricName("parity/token_count", "valid tokens", "UniRL", _OTHER),
    MetricName(
        "parity/torch_equal_fp32",
        "1.0 when every valid token's two log-probs are bitwise equal in float32, else 0.0",
        "UniRL",
        _OTHER,
    ),
    MetricName(
        "parity/mismatch_count",
        "valid tokens whose float32 log-probs differ (`probe check --exact` fails on any)",
        "UniRL",
        _OTHER,
    ),
    MetricName(
        "parity/max_absdiff_fp32",
        "max `abs(train_lp - rollout_lp)` over valid tokens, in float32",
        "UniRL",
        _OTHER,
    ),
    MetricName("parity/k3_mean", "`k3_kl`, under its name in the block", "UniRL", _OTHER),
    MetricName(
        "parity/k3_max",
        "the largest per-token `exp(r) - r - 1` (the terms whose mean is `k3_kl`); capped on "
        "overflow like `k3_kl`",
        "UniRL",
        _OTHER,
    ),
    # --- 7. from numbers to decisions -------------------------------------------------------
    MetricName(
        "clip_fraction_<clip_eps>",
        "share of valid tokens with `abs(rho - 1) > eps`, "
        "`rho = exp(clampB(r))`: what PPO/GRPO's clip (0.2; DAPO's upper 0.28) already "
        "touches at learning rate 0",
        "ours",
        _DEC,
    ),
    MetricName(
        "outlier_share_top1pct",
        "share of the run's total `msum_i(k3)` carried by the top 1% of sequences (at least one)",
        "ours",
        _DEC,
    ),
    MetricName(
        "entropy_mean",
        "mean `train_entropy` (nats) over valid tokens",
        "ours",
        _DEC,
        "the store has `train_entropy` (a scan; not an ingested run)",
    ),
    # --- presets ----------------------------------------------------------------------------
    MetricName(
        f"{PRESET_PREFIX}<preset>/{PRESET_COLUMNS[0]}",
        "`mmean(w_eff == 0)`, "
        "`w_eff = w * keep`: `w` the preset's truncated IS weight (1 without IS), `keep` "
        "its rejection mask (1 without RS); the tokens it rejects or IcePop zeroes",
        "ours",
        GROUPS[7],
        "the preset is evaluated (`--preset`; default: every preset)",
    ),
    MetricName(
        f"{PRESET_PREFIX}<preset>/{PRESET_COLUMNS[1]}",
        "share of all sequences with at least one token of `w_eff == 0`",
        "ours",
        GROUPS[7],
        "the preset is evaluated",
    ),
    MetricName(
        f"{PRESET_PREFIX}<preset>/{PRESET_COLUMNS[2]}",
        "`rollout_is_eff_sample_size`'s "
        "formula on `c = clamp(w_eff, 0, U)` (no clamp without IS): a pure rejection "
        "preset leaves `1 - token_masked_fraction`, a preset that changes nothing 1",
        "ours",
        GROUPS[7],
        "the preset is evaluated",
    ),
    # --- multi-turn -------------------------------------------------------------------------
    MetricName(
        "rerender_trajectory_fraction",
        "share of trajectories whose ids differ anywhere "
        "when the chat template re-renders the final conversation",
        "ours",
        GROUPS[8],
        TRAJ,
    ),
    MetricName(
        "rerender_token_fraction",
        "generated tokens whose re-rendered id differs or has "
        "no aligned counterpart, over the generated tokens of those trajectories",
        "ours",
        GROUPS[8],
        TRAJ,
    ),
)

# The keys of metrics.json that are not flat numbers (``STRUCTURED_KEYS``), in words.
STRUCTURED: dict[str, str] = {
    "config": "the metric options used: `rollout_is`, `rollout_is_threshold`, `rollout_rs`, "
    "`rollout_rs_threshold`, `batch_normalize`, and `presets` (name -> what it corrects)",
    "curves": "what the plots draw: histograms of the ratio and log-ratio, the mismatch by "
    "position, by rollout-probability bin, per sequence against its length, F(τ) on a fine "
    "grid, the sequence IS weights, the entropy deciles, the worst tokens",
    "threshold_sweep": "a list of `{family, threshold, token_fraction, seq_fraction}`: how much "
    "token TIS (`rho > C`), token IcePop (outside `[1/C, C]`), sequence IS (`q'_i > C`) for C "
    "in 1.2 .. 10 and `seq_mean_k3` RS (`mmean_i(k3) > U` for U in 1e-4 .. 0.1) would mask",
    "outliers": "the 20 sequences of largest `msum_i(k3)`: `setting, seq_id, prompt_id, "
    "sample_id, tokens, seq_k3_sum, share, worst_position, worst_abs_log_ratio` and the "
    "`command` that re-scans that prompt",
    "recommendation": "the report's one-sentence advice, by the rule the report states: "
    "`{outcome, preset, reason, masked_token_fraction, ess, closest}`",
    "per_turn": "multi-turn runs: one row per turn index, `turn, sequences, tokens, k3_kl, kl, "
    "abs_log_ratio_mean, token_mult_prob_error, first_token_abs_log_ratio_mean, "
    "context_tokens_mean` (each the run-level definition restricted to the turn's tokens)",
    "store": "the token store these metrics were computed from: its row count and each Parquet "
    "part's size and footer SHA-256 (`store.fingerprint`); a report reuses `metrics.json` only "
    "while the store still matches",
    "first_divergent_layer": "`probe scan --layers`: the first decoder layer (0-based) whose "
    "mean RMS-relative difference of the residual stream, engine against training, exceeds 10x "
    "the float32 floor at that layer; null when none does (key absent without `--layers`; the "
    "whole curve is in `layers.json`)",
}


def lookup(key: str) -> MetricName | None:
    """The ``NAMES`` row whose pattern matches the flat key ``key`` exactly, or None."""
    return next((n for n in NAMES if n.regex().fullmatch(key)), None)
