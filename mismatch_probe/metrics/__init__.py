"""The metric engine: verl's rollout-correction metrics, exactly, plus our diagnostics.

Public API::

    from mismatch_probe.metrics import MetricsConfig, compute_metrics, PRESETS
    result = compute_metrics("run/tokens.parquet", MetricsConfig(), setting=None)
    result.flat()          # {name: float}, finite, spec names as keys
    result.to_json_dict()  # flat() + "config" + "curves" (histograms, bins, worst tokens, ...)

Flat key scheme:

* spec names unchanged: ``rollout_is_*``, ``rollout_rs_<option>_*``, ``rollout_rs_*``, ``kl``,
  ``k3_kl``, ``*_ppl``, ``log_ppl_*``, ``ppl_ratio``, ``chi2_token``, ``chi2_seq``, and the
  spec's own diagnostics (``prob_abs_diff_*``, ``prob_pearson``, ``seq_log_ratio_slope_per_1k``,
  ``ipo_masked_fraction_<eps>``);
* ``f_tau_<tau>`` (``f_tau_2`` = share of tokens whose ratio is outside [0.5, 2]);
* the spec's section 6 (NeMo-RL / TorchTitan names, ``parity``): ``token_mult_prob_error``,
  ``seq_mult_prob_error_{max,mean,min}``, ``k3_kl_reverse`` (+ ``k3_kl_reverse_overflow``),
  ``bitwise_identical_fraction``, ``ratio_tokens_different``,
  ``first_token_abs_log_ratio_mean``, ``rest_abs_log_ratio_mean``;
* spec section 7 (``decisions``, ``outliers``, ``entropy``): ``clip_fraction_0.2``,
  ``clip_fraction_0.28``, ``outlier_share_top1pct`` and, when the store has
  ``train_entropy``, ``entropy_mean``; ``threshold_sweep`` and ``outliers`` are lists of records
  beside the flat keys (``to_json_dict()``, ``MetricsResult.tables``);
* counts ``num_tokens``, ``num_sequences``, ``num_valid_sequences``;
* overflow flags ``k3_kl_overflow``, ``ppl_overflow`` (1.0 when the value was capped);
* ``presets/<name>/token_masked_fraction``, ``.../seq_masked_fraction``,
  ``.../eff_sample_size``.

Choices where the spec leaves room (verl's behaviour unless it would give NaN/inf):

* k3 terms are ``expm1(x) - x`` (same value as ``exp(x) - 1 - x``, no cancellation at 1e-9);
* log-probs below -9999 (``-inf`` included) are read as -9999; NaN/+inf is an error; a null
  log-prob marks a padding row; an all-padding sequence is an empty one (counted in S);
* ``k3_kl``, ``*_ppl``, ``ppl_ratio`` (and the sequence-level ``rollout_is_min``) that overflow
  are capped at the largest float64; the first four raise ``k3_kl_overflow``/``ppl_overflow``;
* ``rollout_is_batch_norm_factor`` only with ``batch_normalize`` (as verl);
* thresholds must be finite; a single k1 threshold X < 1 is an error (L = 1/X > U);
* a store holding several ``setting`` values needs ``setting=`` (no silent mixing).

Module map: ``config`` (parsing, validation), ``batch`` (token batches, per-sequence
reductions), ``weights`` (IS), ``rejection`` (RS), ``offpolicy``, ``parity``, ``diagnostics``,
``curves``, ``attribution`` (links between the rungs of ``--attribute``, per setting),
``preset_metrics``, ``decisions`` (clip fractions, threshold sweep), ``outliers``, ``entropy``,
``stream`` (the one-pass ``MetricEngine``), and the rules over the numbers: ``verdicts`` (the
health checks' thresholds, pass/fail) and ``recommend`` (the recommendation rule, spec section
7). Numbers and rules only: the tables that show them are ``report/``'s (``metrics_table``,
``terminal``, ``markdown``); the dense oracle that checks them lives in ``tests/``.
"""

from mismatch_probe.metrics.config import RS_OPTIONS, MetricsConfig
from mismatch_probe.metrics.presets import PRESET_COLUMNS, PRESET_PREFIX, PRESETS, Preset
from mismatch_probe.metrics.stream import MetricsResult, compute_metrics

__all__ = [
    "PRESETS",
    "PRESET_COLUMNS",
    "PRESET_PREFIX",
    "RS_OPTIONS",
    "MetricsConfig",
    "MetricsResult",
    "Preset",
    "compute_metrics",
]
