"""Named correction presets: "what would my correction do to this data?"

Each preset is one of verl's ``RolloutCorrectionConfig`` factory settings (``decoupled_*`` /
``bypass_*``), reduced to the four knobs that decide weights and masks. For every preset the
engine reports the fraction of tokens and of sequences it would mask and the effective sample
size it would leave (``presets/<name>/...`` keys, see ``mismatch_probe.metrics``).

This module is plain data: it imports nothing numeric, so the CLI can list presets cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

# Flat keys of a preset: f"{PRESET_PREFIX}{name}/{column}" for each column.
PRESET_PREFIX = "presets/"
PRESET_COLUMNS = ("token_masked_fraction", "seq_masked_fraction", "eff_sample_size")


@dataclass(frozen=True)
class Preset:
    """The knobs of one preset, in verl's spelling (parsed by ``config.parse_preset``)."""

    rollout_is: str | None
    rollout_is_threshold: str | None
    rollout_rs: str | None = None
    rollout_rs_threshold: str | None = None
    verl_name: str = ""


PRESETS: dict[str, Preset] = {
    "token_is": Preset("token", "2.0", verl_name="decoupled_token_is"),
    "seq_is": Preset("sequence", "2.0", verl_name="decoupled_seq_is"),
    "token_icepop": Preset("token", "0.5_5.0", verl_name="IcePop (rollout_is_threshold L_U)"),
    "seq_is_rs": Preset("sequence", "2.0", "seq_sum_k1", "0.5_2.0", "decoupled_seq_is_rs"),
    "geo_rs": Preset(None, None, "seq_mean_k1", "0.999_1.001", "decoupled_geo_rs"),
    "k3_rs": Preset(None, None, "seq_mean_k3", "0.01", "decoupled_k3_rs"),
    "geo_rs_token_tis": Preset(
        "token", "2.0", "seq_mean_k1", "0.999_1.001", "decoupled_geo_rs_token_tis"
    ),
    "geo_rs_seq_tis": Preset(
        "sequence", "2.0", "seq_mean_k1", "0.999_1.001", "decoupled_geo_rs_seq_tis"
    ),
    "k3_rs_token_tis": Preset("token", "2.0", "seq_mean_k3", "0.01", "decoupled_k3_rs_token_tis"),
    "k3_rs_seq_tis": Preset("sequence", "2.0", "seq_mean_k3", "0.01", "decoupled_k3_rs_seq_tis"),
}
