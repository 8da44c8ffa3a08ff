"""The worst tokens' ``cause`` column, derived from what the run records (no blanket "numeric
drift"): support flips, MoE routing that differs, the attribution's dominant link, the
low-probability tail; ``—`` when none applies. Hand-built stores, no engine."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from mismatch_probe import store
from mismatch_probe.routing.shape import RoutingShape
from mismatch_probe.routing.store import routing_table, write_routing
from mismatch_probe.rundir.causes import describe, known_causes
from mismatch_probe.rundir.context import load_run
from tests.test_report_fixtures import SETTING, make_run, token_table, uniform_seqs

LN = math.log


@pytest.mark.parametrize(
    ("flip", "p_rollout", "p_train", "known", "cause"),
    [
        (True, 0.5, 0.6, (), "support flip"),
        (False, 0.5, 0.6, (), "—"),  # nothing known: no cause claimed
        (False, 0.5, 0.09, (), "low-probability tail"),  # p_train < 0.1
        (False, 0.08, 0.5, (), "low-probability tail"),  # p_rollout < 0.1
        (None, 0.5, 0.5, ("MoE routing differs",), "MoE routing differs"),
        (True, 0.05, 0.2, ("MoE routing differs",), "support flip, MoE routing differs, "
                                                     "low-probability tail"),
    ],
)  # fmt: skip
def test_describe(
    flip: bool | None, p_rollout: float, p_train: float, known: tuple[str, ...], cause: str
) -> None:
    assert describe(flip, LN(p_rollout), LN(p_train), known) == cause


def test_attribution_dominant_link(tmp_path: Path) -> None:
    """Two tokens with the rungs of ``--attribute``: token 0's largest link is the engine's
    decode vs prefill (|L1 - L0| = 0.5), token 1's the kernels (|L3 - L2| = 0.4)."""
    table = token_table(uniform_seqs(0.0, [2]), SETTING)
    lp = LN(0.5)
    rungs = {
        "engine_prefill_logprob": [lp + 0.5, lp],  # L1
        "engine_prefill_single_logprob": [lp + 0.5, lp + 0.01],  # L2
        "train_rollout_dtype_logprob": [lp + 0.45, lp + 0.41],  # L3
    }
    train = [lp + 0.45, lp + 0.42]  # L4
    table = table.set_column(8, "train_logprob", pa.array(train, pa.float32()))
    for name, values in rungs.items():
        table = table.append_column(name, pa.array(values, pa.float32()))
    run = tmp_path / "run"
    run.mkdir()
    store.write_table(run / store.TOKENS_FILE, table, store.token_schema(table.column_names), {})
    found = known_causes(run, None, [(0, 0), (0, 1)])
    assert found == {
        (0, 0): ["engine decode vs prefill (attribution)"],
        (0, 1): ["engine vs transformers kernels (attribution)"],
    }


def test_routing_that_differs_is_a_cause_in_the_report(tmp_path: Path) -> None:
    """An MoE run whose training side chose another expert in layer 1 for token (1, 2) only."""
    seqs = uniform_seqs(0.02, [3, 4])
    run = make_run(tmp_path / "moe", seqs)
    shape = RoutingShape(moe_layers=(0, 1), top_k=2, num_experts=4)
    prompt = 2  # T = P + R - 1 route rows per sequence; response position = row - (P - 1)
    rollout = [np.tile(np.array([0, 1], np.int16), (prompt + n - 1, 2, 1)) for n in (3, 4)]
    train = [r.copy() for r in rollout]
    train[1][(prompt - 1) + 2, 1] = [0, 3]
    table = routing_table(SETTING, [0, 1], [prompt, prompt], rollout, train)
    write_routing(run / store.ROUTING_FILE, table, shape, "test", {})
    found = known_causes(run, None, [(1, 2), (1, 1), (0, 2)])
    assert found == {(1, 2): ["MoE routing differs"], (1, 1): [], (0, 2): []}
    ctx = load_run(run)
    causes = {(t.seq_id, t.position): t.cause for t in ctx.worst}
    assert causes[(1, 2)] == "MoE routing differs"
    assert causes[(0, 0)] == "—"
