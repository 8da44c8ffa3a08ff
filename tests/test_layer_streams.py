"""``probe scan --layers`` on the real vLLM engine (the session pool) and real transformers.

The engine's streams come from forward hooks on vLLM's decoder layers (``engine.layers``,
registered with ``LLM.apply_model``); the training side's from transformers' hidden states.
One module fixture captures, with the pool's float32 engine, the streams of a few prompts as
they are, then with one norm weight of the last layer scaled inside the engine only (through
``apply_model``, restored after), then with the bfloat16 engine; once more in a multiprocess
engine. One end-to-end scan checks ``layers.json``, and ``probe layers`` runs on it again.

Tolerances:

* fp32 on both sides: the relative difference of a stream is float32 rounding through the
  layers: ``REORDER_ULPS`` ulps per layer and one for the embedding, relative to the stream's
  norm (the largest seen: 1.4e-6, under the 5.7e-6 this gives for two layers).
* The perturbation scales a norm weight by ``1 + 2^-4``: a relative change of 6% of that
  norm's output, far above any rounding, and nothing before the layer can see it.
* bf16 against fp32 diverges at layer 0 by physics (8 significand bits: relative rounding
  2^-8 per value) and the difference grows from layer to layer.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.engine import layers as engine_layers
from mismatch_probe.metrics.layers import (
    DIVERGENCE_FACTOR,
    NOMINAL_FLOOR,
    LayerComparison,
    LayerSums,
    first_divergent_layer,
    floor_of,
    logit_floor,
)
from mismatch_probe.pipeline.layers import OWN_FLOOR
from mismatch_probe.training import rescore
from mismatch_probe.training.layers import hidden_streams, layer_parts

from .cli_runner import run_probe_err
from .conftest import encoded_prompts
from .tolerances import EPS, REORDER_ULPS

pytestmark = pytest.mark.engine

PERTURBED_LAYER = 1  # the tiny model's last layer (compared after the final norm)
SCALE = 1 + 2.0**-4


def _scale_norm(layer: int, factor: float, model: Any) -> None:
    """Scale decoder layer ``layer``'s post-attention norm weight (``apply_model``)."""
    weight = model.model.layers[layer].post_attention_layernorm.weight
    weight.data.mul_(factor)


def _captured(llm: Any, ids: list[list[int]]) -> list[dict[str, np.ndarray]]:
    engine_layers.run_on_model(llm, engine_layers.install)
    try:
        return engine_layers.capture(llm, ids)
    finally:
        engine_layers.run_on_model(llm, engine_layers.remove)


@pytest.fixture(scope="module")
def streams(engines: Any, tiny_model: Path, tiny_tokenizer: Any) -> dict[str, Any]:
    ids = [list(p.token_ids) for p in encoded_prompts(tiny_tokenizer)[:3]]
    llm = engines.get("float32", "processed")
    plain = _captured(llm, ids)
    engine_layers.run_on_model(llm, partial(_scale_norm, PERTURBED_LAYER, SCALE))
    try:
        perturbed = _captured(llm, ids)
    finally:
        engine_layers.run_on_model(llm, partial(_scale_norm, PERTURBED_LAYER, 1 / SCALE))
    bf16 = _captured(engines.get("bfloat16", "processed"), ids)
    model = rescore.load_model(tiny_model, "float32")
    train_all = [layer_parts(model, seq) for seq in ids]
    assert all(  # layer_parts' stream is hidden_streams'
        np.array_equal(t["stream"], hidden_streams(model, seq))
        for t, seq in zip(train_all, ids, strict=True)
    )
    prompts = encoded_prompts(tiny_tokenizer)[:3]
    every = {"plain": plain, "perturbed": perturbed, "bf16": bf16, "train": train_all}
    return {
        **{name: [c["stream"] for c in found] for name, found in every.items()},
        "all": every,
        "prompts": prompts,
    }


def _sums(engine: list[np.ndarray], train: list[np.ndarray]) -> LayerSums:
    sums = LayerSums(train[0].shape[1])
    for i, (a, b) in enumerate(zip(engine, train, strict=True)):
        sums.add(a, b, i)
    return sums


def test_fused_add_rmsnorm_hook_matches_transformers(streams: dict[str, Any]) -> None:
    """``hidden_states + residual`` of each vLLM decoder layer is transformers' hidden state
    after that layer (the last after the final norm), in shape and content; another layer's
    state is far off (the hooks hold the right layer)."""
    layers = streams["train"][0].shape[1]
    bound = REORDER_ULPS * EPS["float32"] * (layers + 1)
    for engine, train in zip(streams["plain"], streams["train"], strict=True):
        assert engine.shape == train.shape and engine.dtype == np.float32
        rel = np.linalg.norm(engine - train, axis=-1) / np.linalg.norm(train, axis=-1)
        assert rel.max() < bound
        swapped = np.linalg.norm(engine[:, 0] - train[:, 1], axis=-1)
        assert (swapped / np.linalg.norm(train[:, 1], axis=-1)).min() > 1e-2


def test_fp32_stays_at_the_floor(streams: dict[str, Any]) -> None:
    sums = _sums(streams["plain"], streams["train"])
    assert np.all(sums.mean_rel() < NOMINAL_FLOOR * DIVERGENCE_FACTOR)
    assert first_divergent_layer(sums.mean_rel(), None) is None
    assert np.all(sums.cos_sum / sums.tokens > 1 - 1e-9)


def test_perturbed_norm_is_the_first_divergent_layer(streams: dict[str, Any]) -> None:
    floor, source = floor_of(_sums(streams["plain"], streams["train"]))
    assert source == "measured" and floor is not None
    perturbed = _sums(streams["perturbed"], streams["train"])
    assert first_divergent_layer(perturbed.mean_rel(), floor) == PERTURBED_LAYER
    earlier = perturbed.mean_rel()[:PERTURBED_LAYER]
    assert np.all(earlier <= floor[:PERTURBED_LAYER])  # the very same numbers as unperturbed
    for plain, moved in zip(streams["plain"], streams["perturbed"], strict=True):
        np.testing.assert_array_equal(plain[:, :PERTURBED_LAYER], moved[:, :PERTURBED_LAYER])


def test_bf16_engine_grows_layer_by_layer(streams: dict[str, Any]) -> None:
    floor, _ = floor_of(_sums(streams["plain"], streams["train"]))
    mean = _sums(streams["bf16"], streams["train"]).mean_rel()
    assert first_divergent_layer(mean, floor) == 0  # precision: from the first layer on
    assert mean[0] > EPS["bfloat16"] / 4  # bf16 rounding, not float32's
    assert np.all(np.diff(mean) > 0)


def test_precision_view_without_engine(streams: dict[str, Any], tiny_model: Path) -> None:
    """transformers bf16 against fp32 alone: diverges at layer 0 at bf16's rounding, of the
    same order as the bf16 engine's curve."""
    from types import SimpleNamespace

    from mismatch_probe.engine.rollout import Rollout
    from mismatch_probe.pipeline import layers
    from mismatch_probe.pipeline.config import ScanConfig
    from mismatch_probe.pipeline.timing import Timer

    ids = [list(p.token_ids) for p in streams["prompts"]]
    rollouts = [Rollout(i, i, 0, seq, [], [], "stop", "") for i, seq in enumerate(ids)]
    cfg = ScanConfig(model=tiny_model, layers=True, train_dtypes=("float32", "bfloat16"))
    prep = SimpleNamespace(model_dir=tiny_model, attribution_devices={})
    run = SimpleNamespace(rollouts=rollouts, layers=object())
    from mismatch_probe.pipeline.rescoring import load_model

    views = layers.precision_views(cfg, prep, [run], Timer(), load_model)  # type: ignore[arg-type]
    assert list(views) == ["transformers bfloat16 vs float32"]
    mean = views["transformers bfloat16 vs float32"].stream.mean_rel()
    engine = _sums(streams["bf16"], streams["train"]).mean_rel()
    assert first_divergent_layer(mean, None) == 0
    assert np.all(mean > engine / 10) and np.all(mean < engine * 10)


def _compared(name: str, streams: dict[str, Any]) -> LayerComparison:
    every = streams["all"]
    sums = LayerComparison.of(every[name][0], every["train"][0])
    for i, (a, b) in enumerate(zip(every[name], every["train"], strict=True)):
        sums.add(a, b, i)
    return sums


def test_attention_mlp_and_logits_match_transformers_in_fp32(streams: dict[str, Any]) -> None:
    """Each layer's attention and MLP outputs (hooks on vLLM's and transformers' ``self_attn``
    and ``mlp``) and the next-token logits (the engine's logits processor, transformers' LM
    head) agree in float32 to rounding; another layer's output is far off."""
    layers = streams["train"][0].shape[1]
    bound = REORDER_ULPS * EPS["float32"] * (layers + 1)
    for engine, train in zip(streams["all"]["plain"], streams["all"]["train"], strict=True):
        assert set(engine) == set(train) == {"stream", "attention", "mlp", "logit"}
        for part in ("attention", "mlp"):
            assert engine[part].shape == train[part].shape == train["stream"].shape
            diff = np.linalg.norm(engine[part] - train[part], axis=-1)
            assert (diff / np.linalg.norm(train[part], axis=-1)).max() < bound
            swapped = np.linalg.norm(engine[part][:, 0] - train[part][:, 1], axis=-1)
            assert (swapped / np.linalg.norm(train[part][:, 1], axis=-1)).min() > 1e-2
        assert engine["logit"].shape == (len(train["stream"]) - 1,)
        scale = np.abs(train["logit"]).max()
        assert scale > 0 and np.abs(engine["logit"] - train["logit"]).max() < bound * scale
    sums = _compared("plain", streams)
    assert set(sums.parts) == {"attention", "mlp"} and sums.logits is not None
    assert sums.logits.rel() < bound


def test_perturbed_norm_moves_the_mlp_not_the_attention(streams: dict[str, Any]) -> None:
    """The post-attention norm of layer 1 feeds that layer's MLP, not its attention: the MLP
    curve diverges first at layer 1, the attention curve nowhere; the logits diverge."""
    plain, moved = _compared("plain", streams), _compared("perturbed", streams)
    for part, first in (("mlp", PERTURBED_LAYER), ("attention", None)):
        floor, _ = floor_of(plain.parts[part])
        assert first_divergent_layer(moved.parts[part].mean_rel(), floor) == first
    assert plain.logits is not None and moved.logits is not None
    assert moved.logits.rel() > DIVERGENCE_FACTOR * logit_floor(plain.logits)[0]
    bf16 = _compared("bf16", streams)
    assert bf16.logits is not None and bf16.logits.rel() > EPS["bfloat16"] / 4


@pytest.fixture(scope="module")
def scanned(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """An identity scan with ``--layers --layers-sequences 1`` (exit code, stderr)."""
    out = tmp_path_factory.mktemp("layers") / "run"
    args = ["scan", "--model", str(tiny_model), "--num-prompts", "2", "--max-tokens", "8"]
    args += ["--rollout-dtype", "float32", "--layers", "--layers-sequences", "1"]
    with pytest.MonkeyPatch.context() as monkeypatch:
        code, err = _probe([*args, "--out", str(out)], monkeypatch)
    return out, code, err


def _probe(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    import contextlib
    import io
    import sys

    from mismatch_probe import cli

    monkeypatch.setattr(sys, "argv", ["probe", *args])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, err.getvalue()


def test_scan_writes_layers_json(scanned: tuple[Path, int, str]) -> None:
    """End to end: an identity scan measures its own floor and diverges nowhere;
    ``--layers-sequences`` bounds what is compared."""
    out, code, err = scanned
    assert code == 0, err
    data = json.loads((out / "layers.json").read_text())
    (entry,) = data["settings"].values()
    assert data["floor_source"].startswith("measured")
    assert entry["first_divergent_layer"] is None and entry["sequences"] == 1
    assert [row["layer"] for row in entry["layers"]] == [0, 1]
    assert entry["layers"][-1]["after_final_norm"]
    assert json.loads((out / "metrics.json").read_text())["first_divergent_layer"] is None
    assert (out / "plots" / "layers.png").stat().st_size > 0
    assert "## Layers" in (out / "report.md").read_text()
    assert set(entry["parts"]) == {"attention", "mlp"}
    assert entry["parts"]["mlp"]["first_divergent_layer"] is None
    assert not entry["parts"]["mlp"]["layers"][-1]["after_final_norm"]
    logits = entry["logits"]
    assert 0 < logits["tokens"] <= 8 and not logits["divergent"]  # the sampled tokens
    # the identity setting is the others' floor: itself judged against float32 rounding
    assert entry["floor_source"] == OWN_FLOOR and logits["floor"] == NOMINAL_FLOOR
    assert logits["rel"] < REORDER_ULPS * EPS["float32"] * (len(entry["layers"]) + 1)
    report = (out / "report.md").read_text()
    assert "attention output" in report and "this setting is the others' floor" in report


def test_probe_layers_on_an_existing_scan(
    scanned: tuple[Path, int, str], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``probe layers RUN``: the engine started again from ``run.json``, the stored tokens
    compared; the same floor-level identity, now on both sequences."""
    out, code, _ = scanned
    assert code == 0
    (out / "layers.json").unlink()
    code, err = run_probe_err(["layers", str(out)], monkeypatch, capsys)
    assert code == 0, err
    (entry,) = json.loads((out / "layers.json").read_text())["settings"].values()
    assert entry["sequences"] == 2 and entry["first_divergent_layer"] is None
    bound = REORDER_ULPS * EPS["float32"] * (len(entry["layers"]) + 1)
    assert all(row["mean_rel"] < bound for row in entry["layers"])
    assert "## Layers" in (out / "report.md").read_text()


def test_layers_refused_out_of_eager_mode(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = ["scan", "--model", str(tiny_model), "--layers", "--out", str(tmp_path / "r")]
    code, err = run_probe_err([*args, "--vllm-arg", "enforce_eager=false"], monkeypatch, capsys)
    assert code == 2 and "eager mode" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_multiprocess_engine_captures_the_same_streams(
    streams: dict[str, Any], tiny_model: Path
) -> None:
    """The hooks in vLLM's multiprocess engine (worker process: the hook functions pickled,
    the captures back through msgpack) give the in-process engine's streams."""
    from mismatch_probe.engine import rollout
    from mismatch_probe.sampling import SamplingSpec
    from mismatch_probe.settings import RolloutSetting

    from .conftest import TINY_CONTEXT

    extra = {"kv_cache_memory_bytes": 128 << 20}
    kwargs = rollout.engine_kwargs(
        tiny_model, RolloutSetting("float32"), SamplingSpec(), TINY_CONTEXT, extra
    )
    env = {**rollout.engine_env(kwargs=kwargs), **engine_layers.ENGINE_ENV}
    env[rollout.MULTIPROCESSING_ENV] = "1"
    assert rollout.engine_mode(env) == rollout.MULTIPROCESS
    ids = [list(streams["prompts"][0].token_ids)]
    with rollout.engine(kwargs, env) as llm:
        (captured,) = _captured(llm, ids)
    got = captured["stream"]
    bound = REORDER_ULPS * EPS["float32"] * (got.shape[1] + 1)
    rel = np.linalg.norm(got - streams["plain"][0], axis=-1)
    assert (rel / np.linalg.norm(streams["plain"][0], axis=-1)).max() < bound
    plain = streams["all"]["plain"][0]
    assert set(captured) == set(plain) == {"stream", "attention", "mlp", "logit"}
    scale = np.abs(plain["logit"]).max()
    assert np.abs(captured["logit"] - plain["logit"]).max() < bound * scale
