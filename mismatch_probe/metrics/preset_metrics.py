"""What each preset would do to this data: masked fractions and the effective sample size left.

A preset's effective weight per valid token is ``w_eff = w * keep``: ``w`` the truncated IS weight
(1 when the preset has no IS), ``keep`` the rejection mask (1 when it has no RS). A token is
*masked* when ``w_eff == 0`` (rejected, or zeroed by IcePop; TIS weights are never 0).

Keys, for each preset name P:

* ``presets/P/token_masked_fraction = mmean(w_eff == 0)``;
* ``presets/P/seq_masked_fraction``: fraction of all sequences with at least one masked token;
* ``presets/P/eff_sample_size``: the IS formula of the spec on ``c = clamp(w_eff, 0, U)``
  (U the preset's IS bound; no clamp without IS), so a pure RS preset leaves
  ``ESS = 1 - token_masked_fraction`` and a preset that changes nothing leaves 1.
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.metrics.accum import Counts, eff_sample_size, merge_sums, mmean
from mismatch_probe.metrics.batch import TokenBatch, count, per_batch, valid_float
from mismatch_probe.metrics.config import ISSpec, PresetSpec
from mismatch_probe.metrics.presets import PRESET_PREFIX
from mismatch_probe.metrics.rejection import dropped_seqs, rs_keep, rs_seq_keep
from mismatch_probe.metrics.weights import is_stats, is_weights, weight_sums


def effective_weights(b: TokenBatch, preset: PresetSpec) -> np.ndarray:
    """``[N]`` float64 ``w_eff`` (0 at padding), already in ``[0, U]`` (``is_weights``)."""
    w = valid_float(b, None) if preset.is_spec is None else is_weights(b, preset.is_spec)[1]
    return w * rs_keep(b, preset.rs_specs) if preset.rs_specs else w


@per_batch
def _seq_weights(b: TokenBatch, spec: ISSpec | None) -> tuple[np.ndarray, ...]:
    """``[S_b]`` per sequence: ``msum_i(w)``, ``msum_i(w^2)`` and the valid tokens whose
    weight is 0 (IcePop's); ``w = 1`` per valid token without IS."""
    if spec is None:
        return b.n, b.n, np.zeros(b.num_seqs)
    stats = is_stats(b, spec)
    return stats.seg_w, stats.seg_w2, stats.seg_zeros


class PresetAccumulator:
    """Streams the ``presets/<name>/*`` keys of one preset."""

    def __init__(self, preset: PresetSpec) -> None:
        self.preset = preset
        self.sum_c = self.sum_c2 = 0.0
        self.n_masked = self.n_seq_masked = 0
        # every rejection option keeps or drops whole sequences: computed per sequence
        self.by_sequence = all(spec.aggregation != "token" for spec in preset.rs_specs)

    def update(self, b: TokenBatch) -> None:
        if self.by_sequence:
            self._update_sequences(b)
            return
        c = effective_weights(b, self.preset)
        self.sum_c += float(c.sum())
        self.sum_c2 += float((c * c).sum())
        kept = (c != 0.0) | ~b.m
        self.n_masked += count(~kept)
        self.n_seq_masked += count(dropped_seqs(b, kept))

    def _update_sequences(self, b: TokenBatch) -> None:
        """The same sums from per-sequence ones: a dropped sequence masks all its tokens, a
        kept one those of weight 0."""
        spec = self.preset.is_spec
        w_sum, w2_sum, zeros = _seq_weights(b, spec)
        if self.preset.rs_specs:
            dropped = (b.n > 0) & ~rs_seq_keep(b, self.preset.rs_specs)
            self.sum_c += float(w_sum[~dropped].sum())
            self.sum_c2 += float(w2_sum[~dropped].sum())
        else:
            dropped = np.zeros(b.num_seqs, dtype=bool)
            sums = weight_sums(b, spec) if spec is not None else (float(count(b.m)),) * 2
            self.sum_c += sums[0]
            self.sum_c2 += sums[1]
        self.n_masked += int(b.n[dropped].sum() + zeros[~dropped].sum())
        self.n_seq_masked += count(dropped | (zeros > 0))

    def merge(self, other: PresetAccumulator) -> None:
        merge_sums(self, other, ("sum_c", "sum_c2", "n_masked", "n_seq_masked"))

    def scalars(self, counts: Counts) -> dict[str, float]:
        p = f"{PRESET_PREFIX}{self.preset.name}"
        return {
            f"{p}/token_masked_fraction": mmean(self.n_masked, counts.tokens),
            f"{p}/seq_masked_fraction": self.n_seq_masked / counts.seqs,
            f"{p}/eff_sample_size": eff_sample_size(self.sum_c, self.sum_c2, counts.tokens),
        }
