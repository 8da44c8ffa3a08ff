"""``--layers`` without an engine: the per-layer reduction on crafted streams, ``layers.json``
read back (and refused when malformed), the report section, the plot and the comment line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.layers import (
    NOMINAL_FLOOR,
    LayerSums,
    LogitSums,
    curve,
    first_divergent_layer,
    largest_growth,
    logit_point,
    mark_routing,
    routing_flips,
)
from mismatch_probe.report import layers as report_layers
from mismatch_probe.rundir.layers import first_divergent, read_layers, write_layers


def _sums(scales: list[float], tokens: int = 6, hidden: int = 8) -> LayerSums:
    """Streams whose layer ``i`` differs by exactly ``scales[i]`` relative (one direction)."""
    rng = np.random.default_rng(0)
    train = rng.standard_normal((tokens, len(scales), hidden)).astype(np.float32)
    other = train * (1 + np.asarray(scales, np.float32))[None, :, None]
    sums = LayerSums(len(scales))
    sums.add(other, train, 0)
    sums.add(other, train, 1)
    return sums


def test_relative_difference_and_cosine_per_layer() -> None:
    sums = _sums([1e-4, 1e-3, 0.5])
    np.testing.assert_allclose(sums.mean_rel(), [1e-4, 1e-3, 0.5], rtol=1e-2)
    np.testing.assert_allclose(sums.cos_sum / sums.tokens, 1.0, atol=1e-12)  # parallel streams
    assert sums.tokens == 12 and sums.sequences == 2
    assert all(len(w) == 5 for w in sums.worst)


def test_first_divergent_layer_against_the_floor() -> None:
    floor = np.array([1e-7, 1e-7, 1e-6])
    assert first_divergent_layer(np.array([5e-7, 2e-6, 5e-6]), floor) == 1
    assert first_divergent_layer(np.array([5e-7, 9e-7, 9e-6]), floor) is None
    assert first_divergent_layer(np.array([2e-5, 0, 0]), None) == 0  # nominal floor
    assert first_divergent_layer(np.array([NOMINAL_FLOOR * 9]), None) is None
    assert largest_growth(np.array([1e-3, 2e-3, 1e-1, 2e-1])) == 2
    assert largest_growth(np.array([1e-3])) is None


def _data() -> dict:
    entry = curve(_sums([1e-3, 1e-2]), None, "nominal float32 rounding")
    view = curve(_sums([2e-3, 3e-3]), None, "nominal float32 rounding")
    return {"floor_source": "nominal", "settings": {"rollout=bf16 | train=fp32": entry},
            "views": {"transformers bf16 vs fp32": view}}  # fmt: skip


def test_layers_json_round_trip_and_refusals(tmp_path: Path) -> None:
    data = _data()
    write_layers(tmp_path, data)
    assert read_layers(tmp_path) == json.loads(json.dumps(data))
    assert first_divergent(tmp_path, None) == {"first_divergent_layer": 0}
    (tmp_path / "layers.json").write_text('{"settings": {"x": {"layers": []}}}')
    with pytest.raises(ProbeError, match=r"not a layers\.json"):
        read_layers(tmp_path)
    assert read_layers(tmp_path / "missing") == {}


def test_report_section_plot_and_comment(tmp_path: Path) -> None:
    data = _data()
    plot = report_layers.write_plot(data, tmp_path / "plots")
    assert plot is not None and plot.stat().st_size > 0
    text = report_layers.markdown_section(data, plot, tmp_path)
    assert "## Layers" in text and "(no engine)" in text and "](plots/layers.png)" in text
    line = report_layers.comment_lines(data["settings"]["rollout=bf16 | train=fp32"])
    assert line[0].startswith("**First divergent layer:** 0")
    assert report_layers.markdown_section({}, None, tmp_path) == ""
    assert report_layers.write_plot({}, tmp_path / "plots") is None and not plot.exists()


def test_routing_flips_marked_per_layer(tmp_path: Path) -> None:
    """A token routed to another expert set at layer 1 (same set in another order is no flip)."""
    engine = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [T=2, L=2, K=2]
    train = engine.copy()
    train[0, 0] = [1, 0]  # same experts, other order
    train[1, 1] = [6, 5]
    flips = routing_flips([engine], [train], 2)
    assert flips == [0, 1]
    data = _data()
    entry = data["settings"]["rollout=bf16 | train=fp32"]
    mark_routing(entry, flips)
    assert entry["routing_flip_layers"] == [1] and entry["layers"][1]["routing_flips"] == 1
    text = report_layers.markdown_section(data, None, tmp_path)
    assert "other experts at layers 1" in text


def test_logit_sums_over_the_sampled_tokens_only() -> None:
    """Positions before ``start`` (the prompt's next tokens) are not counted; ``rel`` is the
    RMS-relative difference over the sampled tokens; the worst token is named by its position
    in prompt + response."""
    train = np.array([5.0, -3.0, 2.0, 4.0], np.float32)  # logits of tokens 1..4
    engine = train.copy()
    engine[0] += 100.0  # a prompt token's next-token logit: not sampled
    engine[3] += 0.5
    sums = LogitSums()
    sums.add(engine, train, sequence=7, start=2)
    assert sums.tokens == 2
    np.testing.assert_allclose(sums.rel(), 0.5 / np.sqrt(4.0 + 16.0), rtol=1e-12)
    point = logit_point(sums, 1e-3)
    assert point["divergent"] and point["max_abs"] == 0.5 and point["mean_abs"] == 0.25
    assert point["worst_tokens"][0] == {"sequence": 7, "position": 4, "abs": 0.5}
    assert not logit_point(sums, 0.1)["divergent"]


def test_parts_and_logits_in_the_report(tmp_path: Path) -> None:
    data = _data()
    entry = data["settings"]["rollout=bf16 | train=fp32"]
    entry["parts"] = {"attention": curve(_sums([1e-7, 1e-7]), None, "n", final_norm=False),
                      "mlp": curve(_sums([1e-7, 1e-2]), None, "n", final_norm=False)}  # fmt: skip
    sums = LogitSums()
    sums.add(np.array([1.0, 2.2]), np.array([1.0, 2.0]), 0, 0)
    entry["logits"] = logit_point(sums, 1e-6)
    rows = report_layers.summary_rows(data)
    names = [row[0] for row in rows]
    name = "rollout=bf16 \\| train=fp32"
    assert names[:3] == [name, f"{name} · attention output", f"{name} · MLP output"]
    assert rows[0][-1] == "8.94e-02 (diverges)" and rows[1][1] == "none" and rows[2][1] == "1"
    assert not entry["parts"]["mlp"]["layers"][-1]["after_final_norm"]
    assert report_layers.write_plot(data, tmp_path / "plots") is not None
    write_layers(tmp_path, data)
    assert read_layers(tmp_path)["settings"]["rollout=bf16 | train=fp32"]["logits"]["rel"] > 0
