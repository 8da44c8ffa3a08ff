"""The table of metric names (``metrics/names.py``) is exactly what ``compute_metrics`` emits.

A store built here (two settings' worth of options, support flips, entropy, turns and a
sequences store with re-render drift) is measured under every IS level and threshold kind,
batch normalisation, and every rejection option at once. The keys that come out must be the
keys the table's patterns expand to, both ways: a metric added to the engine without a row, or
a row for a metric the engine no longer emits, fails here (and so the generated reference
cannot fall behind).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.metrics import RS_OPTIONS, MetricsConfig, compute_metrics
from mismatch_probe.metrics.names import GROUPS, NAMES, SOURCES, STRUCTURED, lookup
from mismatch_probe.metrics.stream import STRUCTURED_KEYS

# Every branch of the engine that adds keys: IS token/sequence x TIS/IcePop, batch
# normalisation, every RS option (k1 options take L_U, k2/k3 one number).
CONFIGS = (
    MetricsConfig(),
    MetricsConfig(rollout_is="sequence", batch_normalize=True),
    MetricsConfig(rollout_is_threshold="0.5_2.0"),
    MetricsConfig(rollout_is="sequence", rollout_is_threshold="0.5_2.0", batch_normalize=True),
    MetricsConfig(
        rollout_rs=",".join(RS_OPTIONS),
        rollout_rs_threshold=",".join("0.5_2.0" if o.endswith("k1") else "0.1" for o in RS_OPTIONS),
    ),
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``run/tokens.parquet`` (30 sequences of 5..34 tokens, 4 turns at most) and
    ``run/sequences.parquet`` with the re-render columns a multi-turn scan writes."""
    run = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    lengths = np.arange(5, 35)
    seq = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    rollout = -np.abs(rng.normal(1.0, 1.0, len(seq)))
    tokens = {
        "seq_id": pa.array(seq, pa.int64()),
        "position": pa.array(pos, pa.int32()),
        "rollout_logprob": pa.array(rollout, pa.float32()),
        "train_logprob": pa.array(rollout + rng.normal(0, 0.05, len(seq)), pa.float32()),
        "support_flip": pa.array(pos % 7 == 0),
        "token_id": pa.array(pos, pa.int32()),
        "prompt_id": pa.array(seq // 2, pa.int64()),
        "sample_id": pa.array(seq % 2, pa.int32()),
        "train_entropy": pa.array(np.abs(rng.normal(size=len(seq))), pa.float32()),
        "turn": pa.array(pos // 10, pa.int32()),
    }
    pq.write_table(pa.table(tokens), run / "tokens.parquet")
    n = len(lengths)
    sequences = {
        "seq_id": pa.array(np.arange(n), pa.int64()),
        "prompt_length": pa.array(np.full(n, 12), pa.int32()),
        "response_length": pa.array(lengths, pa.int32()),
        "rerender_differs": pa.array(np.arange(n) % 3 == 0),
        "rerender_mismatched_tokens": pa.array(np.arange(n) % 3 == 0, pa.int32()),
    }
    pq.write_table(pa.table(sequences), run / "sequences.parquet")
    return run


@pytest.fixture(scope="module")
def emitted(store: Path) -> tuple[set[str], set[str]]:
    """(flat keys, structured keys) over every configuration."""
    flat: set[str] = set()
    structured: set[str] = set()
    for config in CONFIGS:
        result = compute_metrics(store, config)
        flat |= set(result.flat())
        structured |= set(result.to_json_dict()) - set(result.flat())
    return flat, structured


def test_every_emitted_key_has_exactly_one_row(emitted: tuple[set[str], set[str]]) -> None:
    flat, _ = emitted
    for key in sorted(flat):
        rows = [n.pattern for n in NAMES if n.regex().fullmatch(key)]
        assert len(rows) == 1, f"{key}: matched by {rows or 'no row of metrics/names.py'}"


def test_every_row_stands_for_keys_the_engine_emits(emitted: tuple[set[str], set[str]]) -> None:
    flat, _ = emitted
    named = {key for row in NAMES for key in row.names()}
    assert named - flat == set(), "rows of metrics/names.py for keys the engine does not emit"
    assert flat - named == set(), "keys the engine emits without a row in metrics/names.py"


def test_structured_keys_are_described(emitted: tuple[set[str], set[str]]) -> None:
    _, structured = emitted
    assert list(STRUCTURED) == list(STRUCTURED_KEYS)
    # recommendation is added by the pipeline, not by compute_metrics
    assert structured <= set(STRUCTURED_KEYS)


def test_rows_are_well_formed() -> None:
    patterns = [n.pattern for n in NAMES]
    assert len(patterns) == len(set(patterns))
    for row in NAMES:
        assert row.source in SOURCES, row
        assert row.group in GROUPS, row
        assert row.definition.strip() and row.definition.count("`") % 2 == 0, row
    assert lookup("f_tau_2") is not None and lookup("f_tau_2.5") is None
    assert lookup("rollout_rs_seq_max_k2_seq_fraction_low") is None  # k1 options only
