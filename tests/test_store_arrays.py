"""``store.arrays``: Arrow columns read from their buffers give ``to_numpy``'s values, numpy
arrays and strings built into Arrow columns give ``pa.array``'s, and the metric path and
``probe ingest`` run in a fresh process never import pandas (pyarrow's conversions would)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from mismatch_probe.store.arrays import arrow_of, arrow_strings, numpy_of, valid_of

KINDS = [pa.int8(), pa.int32(), pa.int64(), pa.uint16(), pa.float32(), pa.float64(), pa.bool_()]


def _values(kind: pa.DataType, n: int, nulls: bool) -> pa.Array:
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 2, n) if kind == pa.bool_() else rng.integers(0, 100, n)
    items = [None if nulls and i % 7 == 3 else (bool(v) if kind == pa.bool_() else v)
             for i, v in enumerate(raw.tolist())]  # fmt: skip
    return pa.array(items, kind)


def _fill(kind: pa.DataType) -> object:
    fills = {pa.bool_(): False, pa.uint16(): 7}
    return fills.get(kind, np.nan if pa.types.is_floating(kind) else -1)


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("nulls", [False, True])
@pytest.mark.parametrize("window", [(0, 37), (5, 20), (13, 20), (17, 3), (11, 0), (0, 0)])
def test_same_as_to_numpy(kind: pa.DataType, nulls: bool, window: tuple[int, int]) -> None:
    whole = _values(kind, 37, nulls)
    values = whole.slice(*window)  # an offset into the buffers, not a multiple of 8
    want_valid = ~np.asarray(values.is_null().to_pylist(), dtype=bool)
    np.testing.assert_array_equal(valid_of(values), want_valid)
    fill = _fill(kind)
    got = numpy_of(values, null=fill)
    filled = values.null_count and fill is not np.nan  # a float column's nulls: to_numpy's NaN
    want = values.fill_null(pa.scalar(fill, kind)) if filled else values
    want_np = want.to_numpy(zero_copy_only=False)
    assert got.dtype == want_np.dtype
    np.testing.assert_array_equal(got, want_np)  # NaN equals NaN here
    if not values.null_count:
        np.testing.assert_array_equal(numpy_of(values), want_np)


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_chunked(kind: pa.DataType) -> None:
    a, b = _values(kind, 19, True), _values(kind, 30, False).slice(3)
    chunked = pa.chunked_array([a, b, b.slice(0, 0)])
    fill = _fill(kind)
    want = np.concatenate([numpy_of(a, null=fill), numpy_of(b)])
    np.testing.assert_array_equal(numpy_of(chunked, null=fill), want)
    np.testing.assert_array_equal(valid_of(chunked), np.concatenate([valid_of(a), valid_of(b)]))
    empty = pa.chunked_array([], kind)
    assert numpy_of(empty).shape == (0,) and valid_of(empty).shape == (0,)


def test_other_types_and_unfilled_nulls_go_to_pyarrow() -> None:
    words = pa.array(["a", None, "c"])
    assert numpy_of(words).tolist() == ["a", None, "c"]
    ints = pa.array([1, None, 3])
    assert np.isnan(numpy_of(ints)).tolist() == [False, True, False]  # to_numpy's own NaN


NUMERIC = [k for k in KINDS if k != pa.bool_()]


@pytest.mark.parametrize("kind", NUMERIC, ids=str)
@pytest.mark.parametrize("nulls", [0, 1, 13])
def test_arrow_of_is_pa_array(kind: pa.DataType, nulls: int) -> None:
    rng = np.random.default_rng(nulls)
    values = rng.integers(0, 100, 29).astype(np.float64)  # cast to the kind by both
    valid = np.ones(29, dtype=bool)
    valid[rng.choice(29, nulls, replace=False)] = False
    got = arrow_of(values, kind, valid)
    want = pa.array(values.astype(np.dtype(kind.to_pandas_dtype())), kind, mask=~valid)
    assert got.equals(want) and got.null_count == nulls and got.type == kind
    assert arrow_of(values, kind).equals(pa.array(values, kind).cast(kind))
    got.validate(full=True)
    assert arrow_of(values[:0], kind).equals(pa.array([], kind))
    with pytest.raises(TypeError):
        arrow_of(values, pa.bool_())


@pytest.mark.parametrize(
    "words", [[], ["a"], [None], ["", None, "é", "a long one", None, "日本", ""], ["x"] * 9]
)
def test_arrow_strings_is_pa_array(words: list[str | None]) -> None:
    got = arrow_strings(words)
    got.validate(full=True)
    assert got.equals(pa.array(words, pa.string())) and got.to_pylist() == words


_NO_PANDAS = """
import sys
from pathlib import Path
from mismatch_probe.metrics import compute_metrics
from mismatch_probe.metrics.integrity import compute_integrity
path = Path(sys.argv[1])
result = compute_metrics(path, workers=1)
compute_integrity(path)
assert result.flat(), "no metrics"
print("pandas" in sys.modules)
"""


def test_metric_path_does_not_import_pandas(tmp_path: Path) -> None:
    pytest.importorskip("pandas")  # where pandas is absent, nothing to prove
    from tests.bench.metrics import write_synthetic_store

    path = tmp_path / "tokens.parquet"
    write_synthetic_store(path, 20_000)
    out = subprocess.run([sys.executable, "-c", _NO_PANDAS, str(path)], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).parents[1])  # fmt: skip
    assert out.stdout.strip() == "False", out.stdout + out.stderr


_INGEST_NO_PANDAS = """
import sys
from pathlib import Path
import mismatch_probe.rundir as rundir
from mismatch_probe.ingest import IngestConfig, run_ingest
before_reports = []
build_report = rundir.build_report
def observed(*args, **kwargs):
    before_reports.append("pandas" in sys.modules)
    return build_report(*args, **kwargs)
rundir.build_report = observed
result = run_ingest(IngestConfig(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))
assert result.run["counts"]["tokens"] > 0
print(before_reports)
"""


@pytest.mark.parametrize("fmt", ["prime-rl", "nemo-rl"])
def test_ingest_does_not_import_pandas(fmt: str, tmp_path: Path) -> None:
    """Reading, the store and the metric pass (all of ``make bench ingest_duckdb``'s time)
    import no pandas: the writer builds its Arrow columns from the arrays' buffers. (The
    reports of a small run, timed apart, read its tokens through ``pyarrow.dataset``, which
    imports it.)"""
    pytest.importorskip("pandas")
    from tests.ingest_fixtures import synthetic_steps, write_nemo_rl, write_prime_rl

    writer = {"prime-rl": write_prime_rl, "nemo-rl": write_nemo_rl}[fmt]
    src = writer(tmp_path / "src", synthetic_steps([1, 2], seqs=4, seed=2))
    args = [sys.executable, "-c", _INGEST_NO_PANDAS, fmt, str(src), str(tmp_path / "run")]
    out = subprocess.run(args, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1])  # fmt: skip
    assert out.stdout.strip() == "[False]", out.stdout + out.stderr
