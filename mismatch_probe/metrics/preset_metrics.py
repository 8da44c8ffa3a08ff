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
from mismatch_probe.metrics.batch import TokenBatch, per_batch, valid_float
from mismatch_probe.metrics.config import ISSpec, PresetSpec
from mismatch_probe.metrics.presets import PRESET_PREFIX
from mismatch_probe.metrics.rejection import dropped_seqs, rs_keep
from mismatch_probe.metrics.weights import is_weights


@per_batch
def _clipped(b: TokenBatch, spec: ISSpec) -> np.ndarray:
    """``[N]`` the truncated IS weights clamped to ``[0, U]`` (presets of one IS spec share it)."""
    return np.clip(is_weights(b, spec)[1], 0.0, spec.upper)


def effective_weights(b: TokenBatch, preset: PresetSpec) -> np.ndarray:
    """``[N]`` float64 ``w_eff`` (0 at padding), already clamped to ``[0, U]``."""
    w = valid_float(b, None) if preset.is_spec is None else _clipped(b, preset.is_spec)
    return w * rs_keep(b, preset.rs_specs) if preset.rs_specs else w


class PresetAccumulator:
    """Streams the ``presets/<name>/*`` keys of one preset."""

    def __init__(self, preset: PresetSpec) -> None:
        self.preset = preset
        self.sum_c = self.sum_c2 = 0.0
        self.n_masked = self.n_seq_masked = 0

    def update(self, b: TokenBatch) -> None:
        c = effective_weights(b, self.preset)
        self.sum_c += float(c.sum())
        self.sum_c2 += float((c * c).sum())
        kept = (c != 0.0) | ~b.m
        self.n_masked += int((~kept).sum())
        self.n_seq_masked += int(dropped_seqs(b, kept).sum())

    def merge(self, other: PresetAccumulator) -> None:
        merge_sums(self, other, ("sum_c", "sum_c2", "n_masked", "n_seq_masked"))

    def scalars(self, counts: Counts) -> dict[str, float]:
        p = f"{PRESET_PREFIX}{self.preset.name}"
        return {
            f"{p}/token_masked_fraction": mmean(self.n_masked, counts.tokens),
            f"{p}/seq_masked_fraction": self.n_seq_masked / counts.seqs,
            f"{p}/eff_sample_size": eff_sample_size(self.sum_c, self.sum_c2, counts.tokens),
        }
