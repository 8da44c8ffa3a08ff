"""Training-side routing on tiny MoE models (transformers only, no engine).

Recording must put every (row, column) of a right-padded batch at its request and position;
forcing a model's own routes must change nothing; forcing one route must change exactly the
log-probabilities that depend on it; forced weights come from the training router's logits.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.routing import routing_shape
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.training import rescore
from mismatch_probe.training.routing import ROUTER_WEIGHTS, TrainRouting, router_modules
from tests.tolerances import ulp_bound

SPEC = SamplingSpec(temperature=0.7)  # no top-k/top-p: random tokens keep finite log-probs
# (prompt length, response length): different lengths, so batches are padded in both directions
LENGTHS = [(7, 20), (12, 5), (3, 30), (9, 1), (5, 0), (10, 14)]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mismatch_probe.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe") / request.param, arch=request.param)


@pytest.fixture(scope="module")
def requests_() -> list[rescore.ScoreRequest]:
    rng = np.random.default_rng(0)
    return [
        rescore.ScoreRequest(rng.integers(5, 380, p).tolist(), rng.integers(5, 380, r).tolist())
        for p, r in LENGTHS
    ]


def shape_of(path: Path) -> Any:
    from transformers import AutoConfig

    return routing_shape(AutoConfig.from_pretrained(path))


def score(model: Any, reqs: Any, routing: TrainRouting | None, batch_tokens: int) -> np.ndarray:
    ctx = routing.batch if routing is not None else None
    out = rescore.rescore(model, reqs, SPEC, 1e-4, batch_tokens, batch_context=ctx)
    return np.concatenate([s.logprobs for s in out]).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replaying_own_routes_changes_nothing(moe_model: Path, requests_: Any, dtype: str) -> None:
    model = rescore.load_model(moe_model, dtype)
    shape = shape_of(moe_model)
    own = TrainRouting(model, requests_, shape)
    plain = score(model, requests_, None, 64)
    recorded = score(model, requests_, own, 64)
    forced = TrainRouting(model, requests_, shape, forced=own.recorded)
    replayed = score(model, requests_, forced, 64)
    np.testing.assert_array_equal(recorded, plain)  # recording alone changes nothing
    # replayed routes recompute the expert weights and reorder the expert sum: a few ulps
    assert np.abs(replayed - plain).max() <= ulp_bound(plain, dtype=dtype)
    for mine, again in zip(own.recorded, forced.recorded, strict=True):
        np.testing.assert_array_equal(mine, again)
    assert [r.shape for r in own.recorded] == [(p + r - 1, 2, 2) for p, r in LENGTHS]


def test_batched_recording_matches_one_at_a_time(moe_model: Path, requests_: Any) -> None:
    model = rescore.load_model(moe_model, "float32")
    shape = shape_of(moe_model)
    batched, single = TrainRouting(model, requests_, shape), TrainRouting(model, requests_, shape)
    score(model, requests_, batched, 1 << 16)  # one batch, padded to the longest (36 columns)
    score(model, requests_, single, 1)  # one request per batch
    for a, b in zip(batched.recorded, single.recorded, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("layer", "changed"), [(1, "one token"), (0, "that token onwards")])
def test_forcing_one_route_changes_what_depends_on_it(
    moe_model: Path, requests_: Any, layer: int, changed: str
) -> None:
    """Request 2 (P = 3) gets a different layer-``layer`` route at column 10 (it predicts
    response token 8). In the last layer only that token's log-prob can change; in layer 0
    the change reaches every later token through attention. Other rows are untouched."""
    model = rescore.load_model(moe_model, "float32")
    shape = shape_of(moe_model)
    own = TrainRouting(model, requests_, shape)
    plain = score(model, requests_, own, 1 << 16)
    forced = [r.copy() for r in own.recorded]
    column, target = 10, 10 - (3 - 1)
    current = set(forced[2][column, layer].tolist())
    forced[2][column, layer] = sorted(set(range(8)) - current)[:2]
    replayed = score(model, requests_, TrainRouting(model, requests_, shape, forced), 1 << 16)
    start = sum(r for _, r in LENGTHS[:2])  # first response token of request 2
    delta = np.abs(replayed - plain)
    moved = np.flatnonzero(delta > ulp_bound(plain)) - start  # changed beyond rounding
    if changed == "one token":
        assert moved.tolist() == [target]
    else:
        assert moved.min() == target and moved.max() > target
        assert np.all((moved >= target) & (moved < LENGTHS[2][1]))


ROUTERS = {"Qwen3MoeTopKRouter": "qwen3_moe", "MixtralTopKRouter": "mixtral"}


@pytest.mark.parametrize(("router", "norm", "expected"), [
    ("Qwen3MoeTopKRouter", True, [1 / 3, 2 / 3]),
    ("Qwen3MoeTopKRouter", False, [0.1, 0.2]),
    ("MixtralTopKRouter", None, [1 / 3, 2 / 3]),  # Mixtral always renormalises
])  # fmt: skip
def test_forced_weights_by_hand(router: str, norm: bool | None, expected: list[float]) -> None:
    """Logits ln(1, 2, 3, 4): probabilities 0.1 .. 0.4; forcing experts {0, 1} weights them
    0.1 and 0.2, renormalised to 1/3 and 2/3 where the model renormalises."""
    import torch

    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    module = type("Router", (), {"norm_topk_prob": norm})()
    weights = ROUTER_WEIGHTS[router](module, logits, torch.tensor([[0, 1]]))
    np.testing.assert_allclose(weights.numpy(), [expected], rtol=1e-6)
    own = ROUTER_WEIGHTS[router](module, logits, torch.tensor([[3, 2]]))
    total = 0.7 if norm is not False else 1.0
    np.testing.assert_allclose(own.numpy(), [[0.4 / total, 0.3 / total]], rtol=1e-6)


def test_forced_routes_are_checked(moe_model: Path, requests_: Any) -> None:
    model = rescore.load_model(moe_model, "float32")
    shape = shape_of(moe_model)
    good = [np.tile(np.int16([0, 1]), (p + r - 1, 2, 1)) for p, r in LENGTHS]  # experts 0, 1
    with pytest.raises(ProbeError, match="shape"):
        TrainRouting(model, requests_, shape, forced=[g[1:] for g in good])
    with pytest.raises(ProbeError, match="outside"):
        TrainRouting(model, requests_, shape, forced=[g + 7 for g in good])
    with pytest.raises(ProbeError, match="forced routes for"):
        TrainRouting(model, requests_, shape, forced=good[1:])


def test_dense_model_has_no_routers(tmp_path: Path) -> None:
    from mismatch_probe.models.tiny import build_tiny_model
    from mismatch_probe.routing import RoutingShape

    model = rescore.load_model(build_tiny_model(tmp_path / "llama"), "float32")
    with pytest.raises(ProbeError, match="expected routers in layers"):
        router_modules(model, RoutingShape((0, 1), 2, 8, 2))
    assert math.isfinite(score(model, [rescore.ScoreRequest([5, 6], [7])], None, 64)[0])
