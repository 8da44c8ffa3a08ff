"""Data integrity checks (metrics spec section 8): each on a fixture that must trigger it and one
that must not, computed by hand on small stores written with pyarrow."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics import compute_metrics
from mismatch_probe.metrics.integrity import (
    COPY_MESSAGE,
    ERROR,
    WARNING,
    Integrity,
    compute_integrity,
    errors,
)

INGEST = {"kind": "ingest"}


def write_store(
    path: Path,
    train: list[list[float | None]],
    rollout: list[list[float | None]],
    steps: list[int] | None = None,
    row_group_size: int | None = None,
) -> Path:
    """A token store of one sequence per list (positions 0..), optionally with a step each."""
    lengths = [len(x) for x in train]
    seq = np.repeat(np.arange(len(train)), lengths)
    data: dict[str, Any] = {
        "seq_id": pa.array(seq, pa.int64()),
        "position": pa.array(np.concatenate([np.arange(k) for k in lengths]), pa.int32()),
        "rollout_logprob": pa.array([x for s in rollout for x in s], pa.float32()),
        "train_logprob": pa.array([x for s in train for x in s], pa.float32()),
    }
    if steps is not None:
        data["step"] = pa.array(np.repeat(steps, lengths), pa.int64())
    pq.write_table(pa.table(data), path, row_group_size=row_group_size)
    return path


def checks(integrity: Integrity) -> dict[str, tuple[str, int, int]]:
    return {f.check: (f.severity, f.tokens, f.sequences) for f in integrity.findings}


def drift(n: int, seed: int = 0, scale: float = 0.01) -> tuple[list[float], list[float]]:
    """Rollout log-probs in [-3, -0.05] and training ones a little off them (at most 0)."""
    rng = np.random.default_rng(seed)
    rollout = rng.uniform(-3.0, -0.05, n)
    return list(np.minimum(rollout + rng.normal(0, scale, n), 0.0)), list(rollout)


def test_a_clean_run_has_no_finding(tmp_path: Path) -> None:
    train, rollout = drift(200)
    result = compute_integrity(write_store(tmp_path / "t.parquet", [train], [rollout]), INGEST)
    assert result.findings == () and result.to_json_dict() == {"findings": [], "masks_applied": []}


def test_placeholder_error_at_one_percent(tmp_path: Path) -> None:
    train, rollout = drift(99)
    train[10] = 0.0  # rollout[10] < ln 0.5 (rollout drawn in [-3, -0.05]), 1 of 100 tokens
    rollout[10] = -2.0
    path = write_store(tmp_path / "t.parquet", [train, [-1.0]], [rollout, [-1.0]])
    assert checks(compute_integrity(path))["placeholder_logprob"] == (ERROR, 1, 1)


def test_placeholder_warning_below_one_percent(tmp_path: Path) -> None:
    train, rollout = drift(300)
    rollout[5], train[5] = 0.0, -4.0  # the other direction: rollout carries the dummy
    found = compute_integrity(write_store(tmp_path / "t.parquet", [train], [rollout]))
    assert checks(found) == {"placeholder_logprob": (WARNING, 1, 1)}
    assert "(0.33%)" in found.findings[0].message


def test_genuine_zero_logprob_is_not_a_placeholder(tmp_path: Path) -> None:
    """A near-deterministic token: exactly 0.0 on both sides, or 0.0 against -0.01."""
    train, rollout = drift(100)
    train[:20], rollout[:20] = [0.0] * 20, [0.0] * 20
    train[20], rollout[20] = 0.0, -0.01  # above ln 0.5: plausible rounding of a certain token
    found = compute_integrity(write_store(tmp_path / "t.parquet", [train], [rollout]))
    assert "placeholder_logprob" not in checks(found)


def test_shifted_by_one_found(tmp_path: Path) -> None:
    """ms-swift#8196: the training log-probs left-shifted by one token."""
    rng = np.random.default_rng(1)
    trains, rollouts = [], []
    for _ in range(4):
        rollout = list(rng.uniform(-3.0, -0.05, 30))
        trains.append([*rollout[1:], -1.0])  # train[t] = rollout[t+1]
        rollouts.append(rollout)
    found = compute_integrity(write_store(tmp_path / "t.parquet", trains, rollouts))
    assert checks(found) == {"shifted_by_one": (ERROR, 112, 4)}
    assert "shifted by +1 token" in found.findings[0].message


def test_shifted_counts_only_the_sequences_that_are_shifted(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    trains, rollouts = [], []
    for _ in range(3):
        rollout = list(rng.uniform(-3.0, -0.05, 40))
        trains.append([-1.0, *rollout[:-1]])  # train[t] = rollout[t-1]
        rollouts.append(rollout)
    good_train, good_rollout = drift(40, seed=3)
    path = write_store(tmp_path / "t.parquet", [*trains, good_train], [*rollouts, good_rollout])
    found = compute_integrity(path)
    assert checks(found)["shifted_by_one"] == (ERROR, 152, 3)
    assert "shifted by -1 token" in found.findings[0].message


def test_aligned_sides_are_not_shifted(tmp_path: Path) -> None:
    """Even large drift (L(0) well above 0.05) is not a shift when neighbours match worse."""
    train, rollout = drift(200, scale=0.3)
    assert compute_integrity(write_store(tmp_path / "t.parquet", [train], [rollout])).findings == ()


def test_an_outlying_first_token_is_not_a_shift(tmp_path: Path) -> None:
    """A constant rollout side and one large first-token difference per sequence: L(0) over
    every token would be well above L(-1) over the pairs (which miss the first train token);
    over the same interior tokens, the three are equal."""
    train = [[-0.5, *([-0.7] * 9)] for _ in range(3)]
    rollout = [[-3.0, *([-0.7] * 9)] for _ in range(3)]
    assert compute_integrity(write_store(tmp_path / "t.parquet", train, rollout)).findings == ()


def test_trainer_copies_rollout_on_an_ingested_run(tmp_path: Path) -> None:
    _, rollout = drift(100)
    path = write_store(
        tmp_path / "t.parquet", [rollout[:50], rollout[50:]], [rollout[:50], rollout[50:]]
    )
    found = compute_integrity(path, INGEST)
    assert checks(found) == {"trainer_copies_rollout": (WARNING, 100, 2)}
    assert found.findings[0].message == COPY_MESSAGE
    assert errors(found.findings) == []


@pytest.mark.parametrize("case", ["a scan", "99 tokens", "one token differs"])
def test_trainer_copies_rollout_not_found(tmp_path: Path, case: str) -> None:
    _, rollout = drift(100)
    train = list(rollout)
    run = INGEST
    if case == "a scan":
        run = {"kind": "scan"}  # identical sides in a scan: the identity check, no finding
    elif case == "99 tokens":
        train, rollout = train[:99], rollout[:99]
    else:
        train[50] = float(np.nextafter(np.float32(train[50]), np.float32(0)))
    path = write_store(tmp_path / "t.parquet", [train], [rollout])
    assert "trainer_copies_rollout" not in checks(compute_integrity(path, run))


def test_positive_logprob(tmp_path: Path) -> None:
    """A stored log-prob of 5 (a 'probability' of 148) is an error; 5e-7 is rounding."""
    train, rollout = drift(50)
    train[3], rollout[7] = 5.0, 5e-7
    found = compute_integrity(write_store(tmp_path / "t.parquet", [train], [rollout]))
    assert checks(found) == {"positive_logprob": (ERROR, 1, 1)}
    assert "largest 5" in found.findings[0].message


def test_nonfinite_logprob(tmp_path: Path) -> None:
    train, rollout = drift(50)
    train[1], rollout[2], train[3] = math.nan, math.inf, -math.inf
    found = compute_integrity(write_store(tmp_path / "t.parquet", [train], [rollout]))
    assert checks(found) == {"nonfinite_logprob": (ERROR, 3, 1)}


def test_minus_inf_on_a_support_flip_is_not_nonfinite(tmp_path: Path) -> None:
    """The scan's rescorer gives -inf to a sampled token outside the training side's top-k set
    and flags it: a measurement. The same -inf unflagged is a finding."""
    train, rollout = drift(20)
    train[4] = -math.inf
    path = write_store(tmp_path / "t.parquet", [train], [rollout])
    table = pq.read_table(path)
    flips = [i == 4 for i in range(20)]
    pq.write_table(table.append_column("support_flip", pa.array(flips)), path)
    assert compute_integrity(path).findings == ()
    pq.write_table(table.append_column("support_flip", pa.array([False] * 20)), path)
    assert checks(compute_integrity(path)) == {"nonfinite_logprob": (ERROR, 1, 1)}


def test_null_padding_is_not_nonfinite(tmp_path: Path) -> None:
    train: list[float | None]
    train, rollout = drift(50)  # type: ignore[assignment]
    train[10:] = [None] * 40
    assert compute_integrity(write_store(tmp_path / "t.parquet", [train], [rollout])).findings == ()


def test_mask_rules_from_run_metadata(tmp_path: Path) -> None:
    train, rollout = drift(50)
    path = write_store(tmp_path / "t.parquet", [train], [rollout])
    rules = [
        {"rule": "sample_loss_mask", "applied": True, "detail": "3 samples masked"},
        {"rule": "other_mask", "applied": False, "detail": "no such field"},
        "malformed",
        {"applied": False},
    ]
    found = compute_integrity(path, {"kind": "ingest", "mask_rules": rules})
    assert checks(found) == {"mask_rule": (WARNING, 0, 0)}
    assert found.findings[0].message.startswith("other_mask: ") and "no such field" in (
        found.findings[0].message
    )
    assert found.masks_applied == ({"rule": "sample_loss_mask", "detail": "3 samples masked"},)
    applied_only = {"kind": "ingest", "mask_rules": rules[:1]}
    assert compute_integrity(path, applied_only).findings == ()
    assert compute_integrity(path, {"kind": "ingest"}).findings == ()


def test_per_step_findings(tmp_path: Path) -> None:
    good_train, good_rollout = drift(20)
    bad_train, bad_rollout = drift(20, seed=5)
    bad_train[0] = 3.0
    path = write_store(
        tmp_path / "t.parquet",
        [good_train, bad_train, good_train],
        [good_rollout, bad_rollout, good_rollout],
        steps=[1, 2, 3],
    )
    found = compute_integrity(path, INGEST)
    assert checks(found) == {"positive_logprob": (ERROR, 1, 1)}
    assert found.of_step(1) == () and found.of_step(3) == ()
    assert [f.check for f in found.of_step(2)] == ["positive_logprob"]
    again = Integrity.from_json_dict(found.to_json_dict())
    assert again == found


def test_batches_do_not_change_the_result(tmp_path: Path) -> None:
    """Streaming: row groups of 7 rows (sequences cut across groups) give the same findings."""
    rng = np.random.default_rng(4)
    trains, rollouts = [], []
    for i in range(6):
        rollout = list(rng.uniform(-3.0, -0.05, 25))
        trains.append([*rollout[1:], -1.0] if i else list(np.array(rollout) - 0.01))
        rollouts.append(rollout)
    trains[0][4] = 0.0
    one = compute_integrity(write_store(tmp_path / "a.parquet", trains, rollouts))
    many = compute_integrity(
        write_store(tmp_path / "b.parquet", trains, rollouts, row_group_size=7)
    )
    assert one == many and checks(one)["shifted_by_one"] == (ERROR, 138, 5)


@pytest.mark.parametrize(
    ("seq_id", "message"),
    [
        (pa.array([2**63 + 5, 2**63 + 5, 7], pa.uint64()), "column seq_id does not hold int64"),
        (pa.array([1, None, 2], pa.int64()), "column seq_id holds nulls"),
    ],
    ids=["uint64 beyond int64", "null"],
)
def test_ids_int64_cannot_hold_are_refused_as_the_metrics_refuse_them(
    tmp_path: Path, seq_id: pa.Array, message: str
) -> None:
    """A seq_id beyond int64 (a cast would wrap it round to a negative id) or a null one (a
    cast would make it an arbitrary integer) is refused with the metric pass's own message."""
    path = tmp_path / "t.parquet"
    lp = pa.array([-1.0, -2.0, -0.5], pa.float32())
    positions = pa.array([0, 1, 0], pa.int32())
    columns = {"seq_id": seq_id, "position": positions, "rollout_logprob": lp, "train_logprob": lp}
    pq.write_table(pa.table(columns), path)
    for compute in (compute_integrity, compute_metrics):
        with pytest.raises(ProbeError, match=message):
            compute(path)
