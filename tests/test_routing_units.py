"""Routing without an engine: shapes, metrics by hand, the store, native layouts, step layouts."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from mismatch_probe import store
from mismatch_probe.engine.routing import (
    StepRecorder,
    engine_setup,
    normalize_native,
)
from mismatch_probe.errors import ProbeError
from mismatch_probe.routing import RoutingShape, is_moe, routing_shape
from mismatch_probe.routing.metrics import (
    analyze_run,
    compare_replay,
    differing,
    jaccard,
    mismatch_stats,
    routing_metrics,
)
from mismatch_probe.routing.replay import check_replay, forced_routes, parse_replay_modes
from mismatch_probe.routing.store import read_routing, routing_table, write_routing
from tests.tolerances import ulp_bound

LN2 = math.log(2.0)

# 3 tokens, 2 layers, top-2. token 0: same sets (order differs); token 1: layer 0 differs
# ({0,1} vs {0,2}, Jaccard 1/3); token 2: both differ ({4,5} vs {4,6}: 1/3; {6,7} vs {0,1}: 0).
ROLLOUT = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[4, 5], [6, 7]]], np.int16)
TRAIN = np.array([[[1, 0], [2, 3]], [[0, 2], [2, 3]], [[4, 6], [0, 1]]], np.int16)
R = np.array([0.0, LN2, -LN2])  # k3: 0, 1 - ln2, ln2 - 1/2


# --- shapes ------------------------------------------------------------------------------------


def test_routing_shape_follows_the_config_rules() -> None:
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

    qwen = Qwen3MoeConfig(
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
        decoder_sparse_step=2,
    )  # fmt: skip
    assert routing_shape(qwen) == RoutingShape((1, 3), 2, 8, 4)  # (i + 1) % 2 == 0, not 0
    assert routing_shape(MixtralConfig(num_hidden_layers=3)) == RoutingShape((0, 1, 2), 2, 8, 3)
    assert routing_shape(LlamaConfig()) is None
    assert is_moe(qwen) and not is_moe(LlamaConfig())


def test_dense_model_with_replay_is_a_one_line_error() -> None:
    from transformers import LlamaConfig

    with pytest.raises(ProbeError) as err:
        check_replay(LlamaConfig(), parse_replay_modes("none,rollout"))
    assert str(err.value) == (
        "--routing-replay rollout needs a mixture-of-experts model; llama is dense"
    )
    assert check_replay(LlamaConfig(), ("none",)) is None


def test_replay_modes() -> None:
    routes = [np.zeros((3, 2, 2), np.int16)]
    assert parse_replay_modes(" none , rollout") == ("none", "rollout")
    assert forced_routes("none", routes) is None
    assert forced_routes("rollout", routes) is routes
    for bad in ("", "r2", "none,none"):
        with pytest.raises(ProbeError):
            parse_replay_modes(bad)


def test_engine_setup_on_this_backend() -> None:
    setup = engine_setup()
    assert setup.capture_path == "prefill_replay"  # no V2 runner on the CPU backend
    assert setup.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert setup.kwargs["distributed_executor_backend"] == "uni"
    assert setup.kwargs["enable_prefix_caching"] is False
    assert engine_setup("native_decode").kwargs == {"enable_return_routed_experts": True}
    with pytest.raises(ProbeError):
        engine_setup("decode_magic")


# --- metrics by hand ---------------------------------------------------------------------------


def test_differing_and_jaccard() -> None:
    assert differing(ROLLOUT, TRAIN).tolist() == [[False, False], [True, False], [True, True]]
    np.testing.assert_allclose(jaccard(ROLLOUT, TRAIN), [[1, 1], [1 / 3, 1], [1 / 3, 0]])


def test_routing_metrics_by_hand() -> None:
    m = routing_metrics(ROLLOUT, TRAIN, R, moe_layers=(0, 1))
    assert m.tokens == 3
    np.testing.assert_allclose(m.layer_disagreement, [2 / 3, 1 / 3])
    np.testing.assert_allclose(m.layer_jaccard, [5 / 9, 2 / 3])
    assert m.mean_jaccard == pytest.approx(11 / 18)
    assert m.any_layer_differs == pytest.approx(2 / 3)
    assert m.mean_differing_layers == pytest.approx(1.0)
    assert (m.agree.tokens, m.agree.k3_kl, m.agree.mean_abs_log_ratio) == (1, 0.0, 0.0)
    assert m.differ.tokens == 2
    assert m.differ.k3_kl == pytest.approx(0.25)  # ((1 - ln2) + (ln2 - 1/2)) / 2
    assert m.differ.mean_abs_log_ratio == pytest.approx(LN2)
    by = [(s.tokens, s.k3_kl) for s in m.by_differing_layers]
    assert by[0] == (1, 0.0)
    assert by[1][0] == 1 and by[1][1] == pytest.approx(1 - LN2)
    assert by[2][0] == 1 and by[2][1] == pytest.approx(LN2 - 0.5)


def test_routing_metrics_without_tokens() -> None:
    empty = np.zeros((0, 2, 2), np.int16)
    m = routing_metrics(empty, empty, np.zeros(0), moe_layers=(0, 1))
    assert (m.tokens, m.any_layer_differs, m.mean_jaccard) == (0, 0.0, 1.0)
    assert m.agree == mismatch_stats(np.zeros(0))


def test_compare_replay_by_hand() -> None:
    count = differing(ROLLOUT, TRAIN).sum(axis=1)  # [0, 1, 2]
    c = compare_replay({"none": R, "rollout": np.array([0.0, 0.0, LN2])}, count, layers=2)
    assert c.modes["none"].k3_kl == pytest.approx((1 - LN2 + LN2 - 0.5) / 3)
    assert c.modes["rollout"].k3_kl == pytest.approx((1 - LN2) / 3)
    assert c.k3_removed["none"] == pytest.approx(0.0)
    assert c.k3_removed["rollout"] == pytest.approx(1 - (1 - LN2) / 0.5)
    assert [s.mean_abs_log_ratio for s in c.by_differing_layers["rollout"]] == pytest.approx(
        [0.0, 0.0, LN2]
    )  # verl's masked mean: sum / (n + 1e-8)
    alone = compare_replay({"rollout": R}, count, layers=2)  # no baseline to remove from
    assert alone.k3_removed == {"rollout": None}


# --- store -------------------------------------------------------------------------------------

SHAPE = RoutingShape((0, 1), top_k=2, num_experts=8, num_hidden_layers=2)


def _routes(t: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = [[rng.permutation(8)[:2] for _ in range(2)] for _ in range(t)]  # [t, 2, 2] distinct
    return np.sort(np.array(ids, np.int16).reshape(t, 2, 2), axis=-1)


def test_routing_table_positions_and_round_trip(tmp_path: Path) -> None:
    # seq 10: P = 3, R = 2 -> columns 0..3 -> positions -2, -1, 0, 1; seq 11: P = 2, R = 0 -> -1
    roll = [_routes(4, 0), _routes(1, 1)]
    train = [_routes(4, 2), _routes(1, 3)]
    table = routing_table("s", [10, 11], [3, 2], roll, train)
    assert table.column("seq_id").to_pylist() == [10, 10, 10, 10, 11]
    assert table.column("position").to_pylist() == [-2, -1, 0, 1, -1]
    path = tmp_path / "routing.parquet"
    write_routing(path, table, SHAPE, "prefill_replay", {"tool": "mismatch_probe"})
    data = read_routing(tmp_path)
    assert data.meta == {
        "num_layers": 2, "top_k": 2, "num_experts": 8, "moe_layers": [0, 1],
        "num_hidden_layers": 2, "capture_path": "prefill_replay",
    }  # fmt: skip
    np.testing.assert_array_equal(data.rollout, np.concatenate(roll))
    np.testing.assert_array_equal(data.train, np.concatenate(train))
    assert store.read_run_metadata(path)["tool"] == "mismatch_probe"
    assert read_routing(path, setting="other").seq_id.size == 0


def _tokens_table(setting: str, seq_ids: list[int], rollout_lp: list[float], train_lp: list[float]):
    n = len(seq_ids)
    position = [int(x) for x in np.arange(n) - np.searchsorted(seq_ids, seq_ids)]
    return pa.table(
        {
            "setting": [setting] * n,
            "seq_id": pa.array(seq_ids, pa.int64()),
            "prompt_id": pa.array([0] * n, pa.int64()),
            "sample_id": pa.array([0] * n, pa.int32()),
            "position": pa.array(position, pa.int32()),
            "token_id": pa.array([5] * n, pa.int32()),
            "token_text": ["x"] * n,
            "rollout_logprob": pa.array(rollout_lp, pa.float32()),
            "train_logprob": pa.array(train_lp, pa.float32()),
            "support_flip": [False] * n,
        }
    )


def test_analyze_run_joins_tokens_and_routes(tmp_path: Path) -> None:
    """Three response tokens of two sequences get the hand example's routes and ratios."""
    # seq 0: P = 2, R = 2 -> columns 0..2, positions -1, 0, 1; seq 1: P = 1, R = 1 -> position 0
    prompt = np.array([[[0, 1], [2, 3]]], np.int16)  # one prompt column
    roll = [np.concatenate([prompt, ROLLOUT[:2]]), ROLLOUT[2:]]
    train = [np.concatenate([prompt, TRAIN[:2]]), TRAIN[2:]]
    table = pa.concat_tables(
        [
            routing_table("a", [0, 1], [2, 1], roll, train),
            routing_table("b", [2, 3], [2, 1], roll, train),
        ]
    )
    write_routing(tmp_path / "routing.parquet", table, SHAPE, "prefill_replay", {})
    tokens = pa.concat_tables(
        [
            _tokens_table("a", [0, 0, 1], [-1.0, -1.0, -1.0], [-1.0, -1.0 + LN2, -1.0 - LN2]),
            _tokens_table("b", [2, 2, 3], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0 + LN2]),
            _tokens_table("c", [4, 4], [-1.0, -1.0], [-1.0, -1.0]),  # other tokens
        ]
    )
    store.write_table(tmp_path / "tokens.parquet", tokens, store.TOKEN_SCHEMA, {})
    metrics, replay = analyze_run(tmp_path, tmp_path, {"none": "a", "rollout": "b"})
    expected = routing_metrics(ROLLOUT, TRAIN, R, (0, 1))
    assert metrics.layer_disagreement == expected.layer_disagreement
    stored = ulp_bound(np.array([1 + LN2]))  # the log-probs went through float32 storage
    assert metrics.differ.k3_kl == pytest.approx(0.25, rel=0, abs=stored)
    assert replay.modes["rollout"].k3_kl == pytest.approx((1 - LN2) / 3, rel=0, abs=stored)
    _, only_r3 = analyze_run(tmp_path, tmp_path, {"rollout": "b"})  # its routes are the baseline
    assert only_r3.modes["rollout"] == replay.modes["rollout"]
    with pytest.raises(ProbeError, match="did not rescore"):
        analyze_run(tmp_path, tmp_path, {"none": "a", "short": "c"})


# --- engine-side layouts -----------------------------------------------------------------------

NATIVE_SHAPE = RoutingShape((1, 2), top_k=2, num_experts=8, num_hidden_layers=3)


@pytest.mark.parametrize("layout", ["all_layers", "moe_layers", "extra_last_row", "flattened"])
def test_normalize_native_layouts(layout: str) -> None:
    full = np.stack([_routes(4, seed) for seed in range(3)], axis=1)[:, :, 0]  # [4, 3, 2]
    full = full[:, :, ::-1].copy()  # descending: normalisation sorts
    variants = {
        "all_layers": full,
        "moe_layers": full[:, 1:],
        "extra_last_row": np.concatenate([full, full[:1]]),
        "flattened": full.reshape(4, 6),
    }
    out = normalize_native(variants[layout], columns=4, shape=NATIVE_SHAPE)
    np.testing.assert_array_equal(out, np.sort(full[:, 1:], axis=-1))
    assert out.dtype == np.int16


def test_normalize_native_rejects_wrong_lengths() -> None:
    with pytest.raises(ProbeError, match="expected 4 tokens"):
        normalize_native(np.zeros((3, 3, 2)), columns=4, shape=NATIVE_SHAPE)
    with pytest.raises(ProbeError, match="expected"):
        normalize_native(np.zeros((4, 3, 3)), columns=4, shape=NATIVE_SHAPE)


def _fake_runner(req_ids: list[str], starts: list[int], positions: list[int]) -> SimpleNamespace:
    import torch

    return SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=len(req_ids), req_ids=[*req_ids, None]),
        query_start_loc=SimpleNamespace(np=np.array([*starts, starts[-1]], np.int32)),
        positions=torch.tensor([*positions, 0, 0], dtype=torch.long),  # 2 padding rows
    )


def _ids(req: int, pos: int, layer: int) -> list[int]:
    return [(3 * req + pos + layer) % 8, (5 * req + 2 * pos + layer + 1) % 8 or 7]


def test_step_recorder_places_chunked_batched_rows() -> None:
    """Two steps: request A's chunk 0..2 beside B's 0..1, then B's 2..3 before A's 3."""
    import torch

    steps = [
        (["A-x1", "B-y2"], [0, 3, 5], [0, 1, 2, 0, 1]),
        (["B-y2", "A-x1"], [0, 2, 3], [2, 3, 3]),
    ]
    recorder = StepRecorder(None, SHAPE)
    for req_ids, starts, positions in steps:
        recorder.runner = _fake_runner(req_ids, starts, positions)
        owner = np.repeat([ord(r[0]) - ord("A") for r in req_ids], np.diff(starts))
        for layer in SHAPE.moe_layers:
            rows = [_ids(q, p, layer) for q, p in zip(owner, positions, strict=True)]
            recorder.callback(layer)(torch.tensor([*rows, [7, 7], [7, 7]]))  # + padding rows
    routes = recorder.assemble({"A": 4, "B": 4})
    for q, name in enumerate("AB"):
        want = [[sorted(_ids(q, p, layer)) for layer in (0, 1)] for p in range(4)]
        assert routes[name].tolist() == want
    with pytest.raises(ProbeError, match="missed 2"):
        recorder.assemble({"A": 5, "B": 4})  # position 4 of A was never computed (2 layers)


# --- tiny MoE checkpoints ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tiny_moe_checkpoint(tmp_path: Path, arch: str) -> None:
    from transformers import AutoConfig
    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    result = CliRunner().invoke(app, ["models", "tiny", "--arch", arch, str(tmp_path / arch)])
    assert result.exit_code == 0, result.output
    config = AutoConfig.from_pretrained(tmp_path / arch)
    assert routing_shape(config) == RoutingShape((0, 1), top_k=2, num_experts=8,
                                                 num_hidden_layers=2)  # fmt: skip
    assert config.head_dim == 32 and config.hidden_size // config.num_attention_heads == 32
    assert (tmp_path / arch / "model.safetensors").exists()


# --- plots -------------------------------------------------------------------------------------


def test_plots_are_written(tmp_path: Path) -> None:
    from mismatch_probe.report.routing import (
        plot_disagreement_by_layer,
        plot_logratio_by_differing_layers,
    )

    metrics = routing_metrics(ROLLOUT, TRAIN, R, (0, 1)).to_json_dict()
    count = differing(ROLLOUT, TRAIN).sum(axis=1)
    replay = compare_replay({"none": R, "rollout": R / 10}, count, layers=2).to_json_dict()
    paths = [
        plot_disagreement_by_layer(metrics, tmp_path / "a.png"),
        plot_logratio_by_differing_layers(metrics, {}, tmp_path / "b.png"),
        plot_logratio_by_differing_layers(metrics, replay, tmp_path / "c.png"),
    ]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000


def test_minus_infinity_log_prob_keeps_routing_json_finite(tmp_path: Path) -> None:
    """A training log-prob of -inf (a token the trainer gives zero probability) is read as the
    metric engine's floor (-9999): routing.json and the summary stay finite, and R3's share is
    a number, never 'nan%'."""
    from mismatch_probe.pipeline.routes import routing_outputs
    from mismatch_probe.report.routing import summary_lines
    from mismatch_probe.rundir.routing import load_routing
    from mismatch_probe.settings import RolloutSetting, Setting

    none, r3 = (Setting(RolloutSetting("bfloat16"), "float32", m) for m in ("none", "rollout"))
    prompt = np.array([[[0, 1], [2, 3]]], np.int16)
    roll = [np.concatenate([prompt, ROLLOUT[:2]]), ROLLOUT[2:]]
    train = [np.concatenate([prompt, TRAIN[:2]]), TRAIN[2:]]
    table = pa.concat_tables(
        [
            routing_table(s.name, ids, [2, 1], roll, train)
            for s, ids in ((none, [0, 1]), (r3, [2, 3]))
        ]
    )
    write_routing(tmp_path / store.ROUTING_FILE, table, SHAPE, "prefill_replay", {})
    inf = float("-inf")
    tokens = pa.concat_tables(
        [
            _tokens_table(none.name, [0, 0, 1], [-1.0, -1.0, -1.0], [inf, -1.0 + LN2, -1.0]),
            _tokens_table(r3.name, [2, 2, 3], [-1.0, -1.0, -1.0], [inf, -1.0, -1.0]),
        ]
    )
    store.write_table(tmp_path / store.TOKENS_FILE, tokens, store.TOKEN_SCHEMA, {})
    routing_outputs(tmp_path, [none, r3])
    text = (tmp_path / store.ROUTING_METRICS_FILE).read_text()
    assert "Infinity" not in text and "NaN" not in text
    data = load_routing(tmp_path)
    split = next(iter(data.values()))["metrics"]
    floor = -9999.0 + 1.0  # r of the -inf token: floor - rollout
    k3_floor = math.expm1(floor) - floor
    assert split["agree"]["k3_kl"] == pytest.approx(k3_floor, rel=1e-7)  # token 0 agrees
    (line,) = summary_lines(data)
    assert "nan" not in line and "R3 removes" in line


def test_write_json_refuses_nan_and_infinity(tmp_path: Path) -> None:
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ProbeError, match=r"refusing to write x\.json"):
            store.write_json(tmp_path / "x.json", {"k3_kl": bad})
    assert not (tmp_path / "x.json").exists()
