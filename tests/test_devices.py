"""The training side across devices: the default rule, and a split model's log-probabilities.

No GPU here: the split is forced with ``max_memory`` (the CPU may hold only part of the weights)
and disk offload (the rest is loaded from disk, layer by layer, by Accelerate's hooks). The
log-probabilities must equal the single-device ones exactly: every layer runs the same CPU
kernels on the same float32 weights and the same activations; only where the weights come
from differs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training import devices, rescore

GB = 1 << 30


@pytest.mark.parametrize(
    ("gpus", "model", "expected"),
    [
        ([], 1 * GB, "cpu"),  # no GPU
        ([], 900 * GB, "cpu"),
        ([80 * GB], 16 * GB, "cuda"),  # an 8B model in bf16 fits one H100
        ([80 * GB], 64 * GB, "cuda"),  # exactly FIT_SHARE of the free memory
        ([80 * GB], 65 * GB, "auto"),  # a bit more: split (then CPU)
        ([141 * GB], 280 * GB, "auto"),  # 70B in fp32 on one H200
        ([80 * GB] * 2, 1 * GB, "auto"),  # several GPUs: always split
        ([141 * GB] * 8, 280 * GB, "auto"),
        ([2 * GB], 1 * GB, "cuda"),  # free memory, not total, decides
        ([1 * GB], 1 * GB, "auto"),
    ],
)
def test_default_device_map(gpus: list[int], model: int, expected: str) -> None:
    assert devices.default_device_map(gpus, model) == expected


def test_model_bytes_from_safetensors_header(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    params = sum(p.numel() for p in model.parameters())
    assert devices.parameter_count(tiny_model) == params
    assert devices.model_bytes(tiny_model, "bfloat16") == 2 * params


def test_split_model_scores_like_one_device(
    tiny_model: Path, tiny_tokenizer: object, tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    vocab = len(tiny_tokenizer)  # type: ignore[arg-type]
    requests = [
        rescore.ScoreRequest(rng.integers(0, vocab, p).tolist(), rng.integers(0, vocab, r).tolist())
        for p, r in [(5, 9), (12, 3), (2, 20), (7, 1)]
    ]
    spec = SamplingSpec(temperature=0.9, top_p=0.95, top_k=50)

    whole = rescore.load_model(tiny_model, "float32", "cpu")
    budget = int(0.9 * devices.model_bytes(tiny_model, "float32"))  # not all of it fits
    split = rescore.load_model(
        tiny_model,
        "float32",
        "auto",
        max_memory={"cpu": budget},
        offload_folder=tmp_path / "offload",
    )
    placed = split.probe_device_map
    assert placed["requested"] == "auto" and placed["devices"] == ["cpu", "disk"]
    layers = {name: d for name, d in placed["modules"].items() if ".layers." in name}
    assert set(layers.values()) == {"cpu", "disk"}, placed  # the split runs through the layers
    assert whole.probe_device_map["devices"] == ["cpu"]

    # batch_tokens small enough for several batches, large enough for padded rows
    expected = rescore.rescore(whole, requests, spec, 1e-4, batch_tokens=48)
    got = rescore.rescore(split, requests, spec, 1e-4, batch_tokens=48)
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_array_equal(g.logprobs, e.logprobs)
        np.testing.assert_array_equal(g.support_flip, e.support_flip)
