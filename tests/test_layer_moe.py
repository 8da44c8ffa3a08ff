"""``--layers`` on a tiny MoE model with the real engine: the layer where the two sides route a
token to different experts is marked in ``layers.json`` and the report.

One float32 Qwen3-MoE engine (2 layers, 8 experts, top-2; prefill-replay route capture, eager)
for the module. Decoder layer 1's post-attention norm weight is tilted inside the engine only
(through ``apply_model``: a factor per channel, so the router's input changes direction, not
just scale; the norm feeds that layer's router and experts and nothing before it), then the
engine's routes and layer captures are taken and the engine discarded. Against the float32
trainer's own routes: layer 1 routes many tokens to other experts; layer 0 sees the very same
input as without the tilt (its engine routes are bitwise those of the untilted engine), so its
flips are only float32's rounding near ties (at most ``TIE_SHARE`` of the tokens, as
``test_routing_engine``'s float32 pair).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.engine import layers as engine_layers
from mismatch_probe.engine import rollout
from mismatch_probe.engine.routing import capture_routes, engine_setup
from mismatch_probe.metrics.layers import (
    DIVERGENCE_FACTOR,
    NOMINAL_FLOOR,
    first_divergent_layer,
    routing_flips,
)
from mismatch_probe.pipeline import layers
from mismatch_probe.report import layers as report_layers
from mismatch_probe.routing import routing_shape
from mismatch_probe.routing.replay import forced_routes
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.settings import RolloutSetting, Setting
from mismatch_probe.training import rescore
from mismatch_probe.training.routing import TrainRouting
from tests.conftest import encoded_prompts

pytestmark = pytest.mark.engine

TILTED = 1  # the decoder layer whose post-attention norm is tilted in the engine
SPEC = SamplingSpec(max_tokens=16)
TIE_SHARE = 0.01  # float32 on both sides: routes differ only at near-ties
SETTING = Setting(RolloutSetting("float32"), "float32")


def _tilt(layer: int, factors: np.ndarray, model: Any) -> None:
    """Scale layer ``layer``'s post-attention norm weight channel by channel (``apply_model``)."""
    import torch

    weight = model.model.layers[layer].post_attention_layernorm.weight
    weight.data.mul_(torch.as_tensor(factors, dtype=weight.dtype))


@pytest.fixture(scope="module", autouse=True)
def no_dense_engine(engines: Any) -> None:
    """The session pool's in-process engine (dense tiny model) closed first: alive, it keeps
    vLLM's process-wide parallel groups, made without the expert-parallel group a MoE needs."""
    engines.close()


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from mismatch_probe.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("layers-moe") / "qwen3_moe", arch="qwen3_moe")
    config = AutoConfig.from_pretrained(model)
    shape = routing_shape(config)
    assert shape is not None
    prompts = encoded_prompts(AutoTokenizer.from_pretrained(model))[:4]
    setup = engine_setup()
    kwargs = {
        "model": str(model),
        "dtype": "float32",
        "generation_config": "vllm",
        "seed": 0,
        "max_model_len": 512,
        "kv_cache_memory_bytes": 64 << 20,
        "disable_log_stats": True,
        **setup.kwargs,
        **engine_layers.ENGINE_KWARGS,
    }
    env = rollout.engine_env({**setup.env, **engine_layers.ENGINE_ENV})
    factors = np.random.default_rng(0).uniform(0.2, 1.8, config.hidden_size)
    with rollout.engine(kwargs, env) as llm:
        rolls = rollout.generate(llm, prompts, SPEC, 1)
        plain = capture_routes(llm, rolls, shape, setup.capture_path)
        engine_layers.run_on_model(llm, partial(_tilt, TILTED, factors))
        routes = capture_routes(llm, rolls, shape, setup.capture_path)
        found = layers.capture_run(llm, rolls, range(len(rolls)))
    trainer = rescore.load_model(model, "float32")
    requests = [rescore.ScoreRequest(r.prompt_ids, r.response_ids) for r in rolls]
    routing = TrainRouting(trainer, requests, shape, forced_routes("none", routes))
    rescore.rescore(trainer, requests, SPEC, 1e-4, 512, batch_context=routing.batch)
    try:
        compared = layers.compare_run(trainer, rolls, found)
    finally:
        found.discard()
    train_routes = list(routing.recorded)
    pair = {SETTING: (routes, train_routes)}
    data = layers.finish({SETTING: compared}, {SETTING: 0}, routes=pair)
    return {
        "data": data,
        "compared": compared,
        "plain": plain,
        "routes": routes,
        "train": train_routes,
    }


def test_the_routing_flip_layer_is_marked(moe: dict[str, Any], tmp_path: Path) -> None:
    entry = moe["data"]["settings"][SETTING.name]
    flips = [row["routing_flips"] for row in entry["layers"]]
    tokens = sum(len(r) for r in moe["routes"])
    assert flips == routing_flips(moe["routes"], moe["train"], 2)
    assert flips[TILTED] > 0.2 * tokens  # the tilted router sends many tokens elsewhere
    assert flips[0] <= TIE_SHARE * tokens  # before it: float32 rounding near ties only
    assert entry["routing_flip_layers"] == [i for i, n in enumerate(flips) if n > 0]
    assert TILTED in entry["routing_flip_layers"]
    for before, after in zip(moe["plain"], moe["routes"], strict=True):  # layer 0: untouched
        np.testing.assert_array_equal(before[:, :TILTED], after[:, :TILTED])
    marked = ", ".join(map(str, entry["routing_flip_layers"]))
    text = report_layers.markdown_section(moe["data"], None, tmp_path)
    assert f"routed to other experts at layers {marked}." in text


def test_the_tilted_layer_is_the_first_divergent_one(moe: dict[str, Any]) -> None:
    """The same tilt in the streams: the float32 engine is the identity setting, the others'
    floor, so its own curve is judged against float32 rounding (``OWN_FLOOR``): layer 0 at the
    floor, layer 1 far above; the MoE block's output (``mlp``) diverges at layer 1, the
    attention output nowhere; the sampled tokens' logits move."""
    entry = moe["data"]["settings"][SETTING.name]
    assert entry["floor_source"] == layers.OWN_FLOOR
    assert entry["first_divergent_layer"] == TILTED
    assert entry["parts"]["mlp"]["first_divergent_layer"] == TILTED
    assert entry["parts"]["attention"]["first_divergent_layer"] is None
    assert entry["logits"]["divergent"]
    compared = moe["compared"]
    assert first_divergent_layer(compared.stream.mean_rel(), None) == TILTED
    assert compared.logits is not None
    assert compared.logits.rel() > DIVERGENCE_FACTOR * NOMINAL_FLOOR
