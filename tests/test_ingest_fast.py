"""The vectorised ingest (pyarrow JSONL reader, columnar batches, batch writer) against the
record-by-record readers and writer it replaced (``tests/oracle/ingest_*``, the code as it was):
the same stores, column for column and row group for row group, the same counts and the same
integrity findings, on every format's fixtures; and the same error lines."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest import IngestConfig, ProbeWriter
from mismatch_probe.ingest.formats import get_format
from mismatch_probe.ingest.writer import RunStoreWriter
from mismatch_probe.metrics.integrity import compute_integrity
from tests.ingest_fixtures import (
    Seq,
    synthetic_steps,
    write_miles,
    write_nemo_rl,
    write_prime_rl,
    write_skyrl,
    write_slime,
    write_verl,
)
from tests.oracle import ingest_prime_rl as old_prime_rl
from tests.oracle.ingest_writer import RunStoreWriter as OldWriter

RUN = {"kind": "ingest", "tool": "mismatch_probe"}


def _write_probe(root: Path, data: dict[int, list[Seq]]) -> Path:
    writer = ProbeWriter(root)
    for step, seqs in data.items():
        width = max(len(s.response) for s in seqs) + 2
        shape = (len(seqs), width)
        tokens, mask = np.zeros(shape, np.int64), np.zeros(shape)
        rollout, train = np.zeros(shape), np.zeros(shape)
        for i, s in enumerate(seqs):
            n = len(s.response)
            tokens[i, 1 : n + 1], mask[i, 1 : n + 1] = s.response, 1
            rollout[i, 1 : n + 1], train[i, 1 : n + 1] = s.rollout, s.train
        writer.write_step(
            step, tokens, mask, rollout, train, group=[f"g{i // 2}" for i in range(len(seqs))]
        )
    return root


WRITERS = {
    "prime-rl": write_prime_rl,
    "nemo-rl": write_nemo_rl,
    "slime": write_slime,
    "verl-dp": write_verl,
    "skyrl": write_skyrl,
    "probe": _write_probe,
    "miles-parquet": write_miles,
}
VARIANTS = {  # name: (format, writer)
    "skyrl-legacy-padded": ("skyrl", lambda root, data: write_skyrl(root, data, legacy=True,
                                                                     pad_size=1)),
    "verl-dp-numpy": ("verl-dp", lambda root, data: write_verl(root, data, method="numpy")),
}  # fmt: skip


def _old_records(fmt: str, cfg: IngestConfig):
    reader = old_prime_rl.read(cfg.path, cfg.steps) if fmt == "prime-rl" else None
    records = reader if reader is not None else get_format(fmt).read(cfg)
    for record in records:
        if record.train is None:  # miles: what rescoring would add, the same on both sides
            record.train = record.rollout - 0.25
        yield record


def _new_batches(fmt: str, cfg: IngestConfig):
    if fmt != "miles-parquet":
        yield from get_format(fmt).read_batches(cfg)
        return
    from mismatch_probe.ingest.batches import from_records

    yield from from_records(_old_records(fmt, cfg))


def _stores(fmt: str, src: Path, tmp: Path) -> tuple[Path, Path, Any, Any]:
    cfg = IngestConfig(fmt, src, tmp / "unused", trust_pickle=True)
    new, old = tmp / "new", tmp / "old"
    new.mkdir()
    old.mkdir()
    writer = RunStoreWriter(new, RUN)
    try:
        for batch in _new_batches(fmt, cfg):
            writer.add_batch(batch)
    finally:
        new_counts = writer.close()
    reference = OldWriter(old, RUN)
    try:
        for record in _old_records(fmt, cfg):
            reference.add(record)
    finally:
        old_counts = reference.close()
    return new, old, new_counts, old_counts


def _assert_same_stores(new: Path, old: Path) -> None:
    for name in (store.TOKENS_FILE, store.SEQUENCES_FILE):
        a, b = pq.ParquetFile(new / name), pq.ParquetFile(old / name)
        assert a.schema_arrow.equals(b.schema_arrow, check_metadata=True)
        groups = [[f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)]
                  for f in (a, b)]  # fmt: skip
        assert groups[0] == groups[1]
        assert a.read().equals(b.read()), name
        _assert_same_float_bits(a.read(), b.read())
    assert compute_integrity(new, RUN) == compute_integrity(old, RUN)


def _assert_same_float_bits(a: Any, b: Any) -> None:
    """Every float the same bits (``Table.equals`` takes -0.0 for 0.0), lists' values too."""
    import pyarrow as pa

    for name in a.column_names:
        x, y = a.column(name).combine_chunks(), b.column(name).combine_chunks()
        while pa.types.is_list(x.type) or pa.types.is_large_list(x.type):
            x, y = x.flatten(), y.flatten()
        if pa.types.is_floating(x.type):
            bits = [np.asarray(v.fill_null(0).to_numpy(zero_copy_only=False)).tobytes()
                    for v in (x, y)]  # fmt: skip
            assert bits[0] == bits[1], name


def _big_steps(steps: list[int], seqs: int, length: int, seed: int) -> dict[int, list[Seq]]:
    """Longer responses, so that a step fills several row groups."""
    rng = np.random.default_rng(seed)
    out = {}
    for step in steps:
        batch = []
        for _ in range(seqs):
            n = int(rng.integers(length // 2, length))
            rollout = np.log(rng.uniform(0.05, 0.95, n))
            train = np.minimum(rollout + rng.normal(0.0, 0.01, n), -1e-6)
            prompt = rng.integers(1, 200, 3).tolist()
            batch.append(Seq(prompt, rng.integers(1, 200, n).tolist(), rollout.tolist(),
                             train.tolist()))  # fmt: skip
        out[step] = batch
    return out


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_every_format_gives_the_store_of_the_record_readers(fmt: str, tmp_path: Path) -> None:
    data = synthetic_steps([2, 5, 9], seqs=6, seed=3)
    new, old, new_counts, old_counts = _stores(fmt, WRITERS[fmt](tmp_path / "src", data), tmp_path)
    assert asdict(new_counts) == asdict(old_counts) and new_counts.tokens > 0
    _assert_same_stores(new, old)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dump_variants_give_the_store_of_the_record_readers(variant: str, tmp_path: Path) -> None:
    fmt, write = VARIANTS[variant]
    data = synthetic_steps([1, 4], seqs=5, seed=8)
    new, old, new_counts, old_counts = _stores(fmt, write(tmp_path / "src", data), tmp_path)
    assert asdict(new_counts) == asdict(old_counts) and new_counts.tokens > 0
    _assert_same_stores(new, old)


def test_prime_rl_row_groups_steps_and_ranks_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of several row groups each (65,536 tokens), two rank files per step."""
    monkeypatch.setattr(store, "ROW_GROUP_TOKENS", 65_536)
    data = _big_steps([1, 2, 3], seqs=120, length=1500, seed=4)
    src = write_prime_rl(tmp_path / "src", data)
    for step in data:  # a second rank file: the same lines again
        d = src / "token_exports" / f"step_{step}"
        (d / "rank_1.jsonl").write_text((d / "rank_0.jsonl").read_text())
    new, old, new_counts, old_counts = _stores("prime-rl", src, tmp_path)
    assert asdict(new_counts) == asdict(old_counts)
    assert pq.ParquetFile(new / store.TOKENS_FILE).num_row_groups > 6
    _assert_same_stores(new, old)


def _prime_line(tokens: int, mask: list, rollout: list, train: list, **extra) -> str:
    line = {"schema_version": 1, "token_ids": list(range(1, tokens + 1)), "loss_mask": mask,
            "inference_logprobs": rollout, "trainer_logprobs": train, **extra}  # fmt: skip
    return json.dumps(line)


UNUSUAL = {
    # nulls inside the log-probs (prime-rl's non-finite floats), sample ids as strings and ints
    "nulls": [
        _prime_line(
            4,
            [False, True, True, True],
            [0.0, -0.5, None, -0.1],
            [-9.0, -0.4, -0.2, None],
            sample_id="a",
        ),
        _prime_line(3, [False, True, True], [0.0, -0.3, -0.2], [-9.0, -0.3, -0.25], sample_id="a"),
    ],
    "nulls_without_ids": [
        _prime_line(
            4, [False, True, True, True], [0.0, -0.5, None, -0.1], [-9.0, -0.4, -0.2, None]
        ),
        _prime_line(3, [False, True, True], [-0.0, -0.3, -0.2], [-9.0, -0.3, -0.25]),
    ],
    "int_keys": [
        _prime_line(3, [False, True, True], [0.0, -0.3, -0.2], [-9.0, -0.3, -0.25], sample_id=7),
        _prime_line(3, [False, True, True], [0.0, -0.3, -0.2], [-9.0, -0.3, -0.25], sample_id=7),
    ],
    # what only the reference reader reads: NaN tokens, 0/1 masks, float ids, a blank line
    "fallback": [
        '{"schema_version": 1, "token_ids": [1, 2, 3.0], "loss_mask": [0, 1, 1], '
        '"inference_logprobs": [0.0, NaN, -0.2], "trainer_logprobs": [-9.0, -0.1, -0.2]}',
        "",
        _prime_line(3, [False, True, True], [0.0, -0.3, -0.2], [-9.0, -0.3, -0.25]),
    ],
    # a mask gap: two turns
    "turns": [
        _prime_line(
            6,
            [False, True, True, False, True, True],
            [0.0, -0.1, -0.2, 0.0, -0.3, -0.1],
            [-9.0, -0.1, -0.25, -1.0, -0.3, -0.2],
        ),
    ],
}


def _prime_file(root: Path, lines: list[str]) -> Path:
    d = root / "token_exports" / "step_1"
    d.mkdir(parents=True)
    (d / "rank_0.jsonl").write_text("".join(line + "\n" for line in lines))
    (d / "STABLE").touch()
    return root


@pytest.mark.parametrize("case", list(UNUSUAL))
def test_prime_rl_unusual_lines_give_the_same_store(case: str, tmp_path: Path) -> None:
    src = _prime_file(tmp_path / "src", UNUSUAL[case])
    new, old, new_counts, old_counts = _stores("prime-rl", src, tmp_path)
    assert asdict(new_counts) == asdict(old_counts)
    _assert_same_stores(new, old)


@pytest.mark.parametrize("case", ["turns", "nulls_without_ids", "several_steps"])
def test_prime_rl_without_the_compiled_reader_gives_the_same_store(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyarrow's reader, where the package has no compiled one (the compiled reader reads
    these files in the other tests; ``sample_id`` is left to pyarrow's in any case)."""
    from mismatch_probe.ingest import jsonl

    if case == "several_steps":
        src = write_prime_rl(tmp_path / "src", _big_steps([1, 2], seqs=40, length=900, seed=2))
    else:
        src = _prime_file(tmp_path / "src", UNUSUAL[case])
    monkeypatch.setattr(jsonl, "_lines", None)
    new, old, new_counts, old_counts = _stores("prime-rl", src, tmp_path)
    assert asdict(new_counts) == asdict(old_counts)
    _assert_same_stores(new, old)


BAD = {
    "not json": ["{oops"],
    "missing field": ['{"schema_version": 1, "token_ids": [1, 2], "loss_mask": [false, true], '
                      '"inference_logprobs": [0.0, -0.1]}'],
    "unequal": [_prime_line(3, [False, True], [0.0, -0.1], [-9.0, -0.1])],
    "empty mask": [_prime_line(2, [False, False], [0.0, -0.1], [-9.0, -0.1])],
    "version": [_prime_line(2, [False, True], [0.0, -0.1], [-9.0, -0.1]).replace(
        '"schema_version": 1', '"schema_version": 2')],
    "big id": [_prime_line(2, [False, True], [0.0, -0.1], [-9.0, -0.1]).replace(
        "[1, 2]", "[1, 4294967296]")],
    # the reference reads ids through float64: 2^53 + 1 is named as 2^53 on both paths
    "id beyond 2^53": [_prime_line(2, [False, True], [0.0, -0.1], [-9.0, -0.1]).replace(
        "[1, 2]", "[1, 9007199254740993]")],
}  # fmt: skip


def _error(write, tmp: Path, read) -> str:
    tmp.mkdir()
    writer = write(tmp, RUN)
    with pytest.raises(ProbeError) as exc:
        for item in read:
            (writer.add_batch if isinstance(writer, RunStoreWriter) else writer.add)(item)
    return str(exc.value)


@pytest.mark.parametrize("case", list(BAD))
def test_prime_rl_bad_lines_give_the_same_error(case: str, tmp_path: Path) -> None:
    lines = [_prime_line(3, [False, True, True], [0.0, -0.3, -0.2], [-9.0, -0.3, -0.2])]
    src = _prime_file(tmp_path / "src", lines + BAD[case])
    steps = IngestConfig("prime-rl", src, src).steps
    new = _error(
        RunStoreWriter,
        tmp_path / "new",
        get_format("prime-rl").read_batches(IngestConfig("prime-rl", src, src)),
    )
    old = _error(OldWriter, tmp_path / "old", old_prime_rl.read(src, steps))
    assert new == old and "rank_0.jsonl:2" in new


def test_prime_rl_takes_the_fast_path_on_an_ordinary_export(tmp_path: Path) -> None:
    from mismatch_probe.ingest import jsonl, prime_rl

    src = write_prime_rl(tmp_path / "src", synthetic_steps([1], seqs=3))
    file = src / "token_exports" / "step_1" / "rank_0.jsonl"
    assert jsonl.read_columns(file, prime_rl._COLUMNS) is not None  # the compiled reader
    assert prime_rl.fast_batch(file, 1) is not None
    table = jsonl.read_table(file, prime_rl._SCHEMA, prime_rl._OPTIONAL)  # pyarrow's
    assert table is not None
    blank = tmp_path / "blank.jsonl"
    blank.write_text(file.read_text() + "\n")  # a blank line: the reference reader decides
    assert jsonl.read_table(blank, prime_rl._SCHEMA, prime_rl._OPTIONAL) is None


def _nemo_line(mask: list, gen: list, prev: list, nested: bool = True, **extra: Any) -> dict:
    """One line of ``train_data_step<N>.jsonl``: the logger's one-element lists (``nested``)
    or flat lists; ``extra`` fields as given (``input_lengths=[4]``, ``idx=0``, ...)."""
    wrap = (lambda v: [v]) if nested else (lambda v: v)
    arrays = {"token_ids": list(range(1, len(mask) + 1)), "token_loss_mask": mask,
              "generation_logprobs": gen, "prev_logprobs": prev}  # fmt: skip
    return {"content": [[{"role": "user", "content": "q"}]],
            **{k: wrap(v) for k, v in arrays.items()}, **extra}  # fmt: skip


def _nemo(mask_value: Any = 1.0, idx: Any = 0, **extra: Any) -> dict:
    """An ordinary padded line: 6 entries, 4 of them real (``input_lengths``)."""
    fields = {"input_lengths": [4], "sample_loss_mask": [mask_value], "idx": idx, **extra}
    return _nemo_line([0, 1, 1, 1, 1, 1], [0.0, -0.5, -0.2, -0.1, 0.0, 0.0],
                      [0.0, -0.4, -0.25, -0.1, 0.0, 0.0], **fields)  # fmt: skip


NEMO_FAST = {  # what the fast reader reads itself: the same store as the reference reader
    "padded": [_nemo(idx=0), _nemo(idx=1)],
    "flat lists, scalars, string ids": [
        _nemo_line(
            [0, 1, 1],
            [0.0, -0.3, -0.2],
            [0.0, -0.3, -0.25],
            nested=False,
            input_lengths=3,
            sample_loss_mask=1,
            idx="a",
        ),
        _nemo_line(
            [0, 1, 1, 0],
            [0.0, -0.1, -0.2, 0.0],
            [0.0, -0.1, -0.2, 0.0],
            nested=False,
            input_lengths=3,
            sample_loss_mask=1,
            idx="",
        ),
    ],
    "non-finite and null log-probs": [
        _nemo_line(
            [0, 1, 1, 1],
            [0.0, float("nan"), float("-inf"), None],
            [0.0, float("inf"), -0.2, -0.1],
            input_lengths=[4],
            idx=3,
        ),
    ],
    "sample masks: removed, weighted, nested": [
        _nemo(0.0, idx=0),
        _nemo(0.5, idx=1),
        _nemo(1.0, idx=2),
        _nemo_line([0, 0, 0], [0.0] * 3, [0.0] * 3, input_lengths=[3], sample_loss_mask=[0], idx=3),
    ],
    "sample mask one level deeper": [_nemo([1.0], idx=0), _nemo([0], idx=1)],
    "no sample mask, no idx, no lengths": [
        _nemo_line([0, 1, 1], [0.0, -0.3, -0.2], [0.0, -0.3, -0.25]),
        _nemo_line([0, 1, 0], [0.0, -0.3, 0.0], [0.0, -0.2, 0.0]),
    ],
    "all-zero prev_logprobs first, then trained": [
        _nemo_line([0, 1, 1], [0.0, -0.3, -0.2], [0.0, 0.0, 0.0], idx=0),
        _nemo_line([0, 1, 1], [0.0, -0.3, -0.2], [0.0, -0.3, -0.25], idx=1),
    ],
}
NEMO_REFERENCE = {  # what only the reference reader reads: still the same store
    "shapes change between lines": [
        _nemo(idx=0),
        _nemo_line([0, 1, 1], [0.0, -0.3, -0.2], [0.0, -0.3, -0.25], nested=False, idx=1),
    ],
    "a sample mask only after the first line": [
        _nemo_line([0, 1, 1], [0.0, -0.3, -0.2], [0.0, -0.3, -0.25]),
        _nemo(0.0, idx=1),
    ],
    "float token ids": [{**_nemo(), "token_ids": [[1, 2.0, 3, 4, 5, 6]]}],
    "float idx": [_nemo(idx=1.5)],
    "a null sample mask": [_nemo(idx=0), _nemo(None, idx=1)],
    "a blank line": [_nemo(idx=0), "", _nemo(idx=1)],
    "a line of spaces": [_nemo(idx=0), "  ", _nemo(idx=1)],
    # what pyarrow reads otherwise than json: -0.0 for the integer -0
    "the integer -0": [json.dumps(_nemo(idx=0)).replace("[[0.0, -0.4", "[[-0, -0.4")],
    "the integer -0 before a tab": [
        json.dumps(_nemo(idx=0)).replace("[[0.0, -0.4", "[[-0\t, -0.4")
    ],
    "an optional key spelt with escapes": [
        _nemo_line([0, 1, 1], [0.0, -0.3, -0.2], [0.0, -0.3, -0.25]),
        json.dumps(_nemo_line([0, 1, 1], [0.0, -0.3, -0.2], [0.0, -0.3, -0.25], idx=7)).replace(
            '"idx"', '"id\\u0078"'
        ),
    ],
}


def _nemo_file(root: Path, lines: list) -> Path:
    root.mkdir(parents=True)
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    (root / "train_data_step1.jsonl").write_text(text)
    return root


def _nemo_reader(src: Path) -> str | None:
    """Which reader gives the step file's batch: ``"compiled"``, ``"pyarrow"`` or None (the
    reference reader's records)."""
    from mismatch_probe.ingest import nemo_rl

    file = src / "train_data_step1.jsonl"
    for name, parse in (("compiled", nemo_rl._compiled), ("pyarrow", nemo_rl._by_pyarrow)):
        parsed = parse(file)
        if parsed is not None:
            return name if nemo_rl._batch(*parsed, file, 1) is not None else None
    return None


def _nemo_fast(src: Path) -> bool:
    return _nemo_reader(src) is not None


NEMO_NOT_COMPILED = {  # the fast cases the compiled reader leaves to pyarrow's
    "flat lists, scalars, string ids": "an idx string",
}
NEMO_COMPILED_ONLY = ("the integer -0", "the integer -0 before a tab")  # json's 0.0, not -0.0


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "pyarrow"])
@pytest.mark.parametrize(
    "case,fast",
    [(c, True) for c in NEMO_FAST] + [(c, False) for c in NEMO_REFERENCE],
)
def test_nemo_rl_lines_give_the_store_of_the_record_reader(
    case: str, fast: bool, compiled: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each case read by the compiled reader where it can, or by pyarrow's where the package
    has no compiled one (``compiled=False``), else by the reference reader: the same store."""
    from mismatch_probe.ingest import jsonl

    if not compiled:
        monkeypatch.setattr(jsonl, "_lines", None)
        monkeypatch.setattr(jsonl, "COMPILED", False)
    src = _nemo_file(tmp_path / "src", {**NEMO_FAST, **NEMO_REFERENCE}[case])
    if compiled and case in NEMO_COMPILED_ONLY:
        expected: str | None = "compiled"
    elif fast:
        expected = "pyarrow" if not compiled or case in NEMO_NOT_COMPILED else "compiled"
    else:
        expected = None
    assert _nemo_reader(src) == expected
    new, old, new_counts, old_counts = _stores("nemo-rl", src, tmp_path)
    assert asdict(new_counts) == asdict(old_counts) and new_counts.sequences > 0
    _assert_same_stores(new, old)


def test_nemo_rl_takes_the_fast_path_on_the_loggers_files(tmp_path: Path) -> None:
    src = write_nemo_rl(tmp_path / "src", synthetic_steps([1], seqs=4))
    assert _nemo_reader(src) == "compiled"


NEMO_BAD = {
    "all-zero prev_logprobs": ([_nemo_line([0, 1, 1], [0.0, -0.3, -0.2], [0.0] * 3)],
                               "prev_logprobs are all zero"),
    "sample mask above 1": ([_nemo(2.0)], "sample_loss_mask 2.0 is not within 0..1"),
    "input length 0": ([_nemo(input_lengths=[0])], "input_lengths 0 is not a length"),
    "unequal lengths": ([{**_nemo(), "prev_logprobs": [[0.0, -0.1]]}], "unequal length"),
    "empty mask": ([_nemo_line([0, 0, 0], [0.0] * 3, [0.0] * 3, sample_loss_mask=[1])],
                   "the loss mask selects no token"),
    # what pyarrow reads and json refuses: the reference reader's error, not a store
    "Inf": ([json.dumps(_nemo(idx=1)).replace('"content"', '"r": [1, Inf], "content"')],
            "not valid JSON"),
    "a byte-order mark": (["\ufeff" + json.dumps(_nemo(idx=0))], "not valid JSON"),
    "two objects on one line": ([json.dumps(_nemo(idx=0)) + json.dumps(_nemo(idx=1)), "",
                                 _nemo(idx=2)], "not valid JSON"),
}  # fmt: skip
ON_THE_FIRST_LINE = ("all-zero prev_logprobs", "a byte-order mark")


@pytest.mark.parametrize("case", list(NEMO_BAD))
def test_nemo_rl_bad_lines_give_the_same_error(case: str, tmp_path: Path) -> None:
    lines, message = NEMO_BAD[case]
    good = _nemo_line([0, 1, 1], [0.0, -0.3, -0.2], [0.0, -0.3, -0.25], sample_loss_mask=[1])
    src = _nemo_file(tmp_path / "src", lines if case in ON_THE_FIRST_LINE else [good, *lines])
    cfg = IngestConfig("nemo-rl", src, src)
    new = _error(RunStoreWriter, tmp_path / "new", get_format("nemo-rl").read_batches(cfg))
    old = _error(OldWriter, tmp_path / "old", get_format("nemo-rl").read(cfg))
    assert new == old and message in new
    assert not _nemo_fast(src)


def test_a_file_too_large_for_the_fast_reader_is_streamed_by_the_reference_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyarrow's block size is an int32: a file of ``MAX_FAST_BYTES`` or more goes to the
    reference reader, a line at a time (here with the bound lowered), the same store; the
    compiled reader does not hold such a file whole either."""
    from mismatch_probe.ingest import jsonl

    src = write_nemo_rl(tmp_path / "src", synthetic_steps([1, 2], seqs=4, seed=9))
    monkeypatch.setattr(jsonl, "MAX_FAST_BYTES", 10)
    assert not _nemo_fast(src)
    new, old, new_counts, old_counts = _stores("nemo-rl", src, tmp_path)
    assert asdict(new_counts) == asdict(old_counts) and new_counts.tokens > 0
    _assert_same_stores(new, old)


@pytest.mark.parametrize("fmt", ["prime-rl", "nemo-rl"])
def test_an_empty_file_gives_the_store_of_the_record_reader(fmt: str, tmp_path: Path) -> None:
    """A file of no line (a rank with no sequence, a step logged empty): nothing read from it,
    as the reference reader reads nothing (the fast path used to fail on it)."""
    src = WRITERS[fmt](tmp_path / "src", synthetic_steps([1, 2], seqs=3, seed=5))
    empty = {"prime-rl": "token_exports/step_2/rank_1.jsonl", "nemo-rl": "train_data_step2.jsonl"}
    (src / empty[fmt]).write_text("")
    new, old, new_counts, old_counts = _stores(fmt, src, tmp_path)
    assert asdict(new_counts) == asdict(old_counts) and new_counts.tokens > 0
    _assert_same_stores(new, old)


def test_one_pass_gives_each_steps_metrics_and_the_integrity_bit_for_bit(tmp_path: Path) -> None:
    """``ingest.run.measure``: the run's metrics, each step's (steps spanning several row
    groups, batches carrying a sequence across a step's end) and the integrity findings, equal
    to one ``compute_metrics`` per step and ``compute_integrity`` reading the store itself."""
    from mismatch_probe.ingest.run import measure
    from mismatch_probe.metrics import compute_metrics

    data = _big_steps([1, 2, 3, 5], seqs=70, length=2500, seed=6)
    new, _, _, _ = _stores("prime-rl", write_prime_rl(tmp_path / "src", data), tmp_path)
    tokens = new / store.TOKENS_FILE
    run = {**RUN, "mask_rules": []}
    whole, steps, integrity = measure(tokens, run)
    exact = lambda r: json.dumps(r.to_json_dict(), sort_keys=True, default=str)  # noqa: E731
    assert exact(whole) == exact(compute_metrics(tokens))
    assert sorted(steps) == [1, 2, 3, 5]
    for step, flat in steps.items():
        assert repr(flat) == repr(compute_metrics(tokens, step=step).flat()), step
    assert integrity == compute_integrity(tokens, run)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn"])
def test_slime_tensors_give_the_records_of_their_lists(dtype: str) -> None:
    """slime's samples hold tensors; the reader takes their values as numpy arrays (no Python
    object per token) and must give what it gave from their ``tolist``, bit for bit."""
    import torch

    from mismatch_probe.ingest.slime import sample_record

    rng = np.random.default_rng(11)
    n, prompt = 40, 7
    kind = getattr(torch, dtype)
    sample = {
        "tokens": torch.tensor(rng.integers(0, 50_000, prompt + n), dtype=torch.int32),
        "response_lengths": n,
        "loss_masks": torch.tensor(rng.random(n) < 0.8),
        "log_probs": torch.tensor(np.log(rng.uniform(0.01, 1, n))).to(kind),
        "rollout_log_probs": torch.tensor(np.log(rng.uniform(0.01, 1, n))).to(kind),
        "sample_index": 3,
    }
    sample["log_probs"][2] = float("-inf")
    lists = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in sample.items()}
    new, old = (sample_record(s, 1, "here", train_key="log_probs") for s in (sample, lists))
    for field in ("token_ids", "positions", "rollout", "train"):
        a, b = getattr(new, field), getattr(old, field)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), field
    assert (new.prompt_key, new.source) == (old.prompt_key, old.source)


def test_miles_columns_give_the_records_of_their_python_rows(tmp_path: Path) -> None:
    """Miles' Parquet rows are read with each list as a numpy array; the records must be what
    ``to_pylist``'s rows gave, bit for bit: a null loss mask (every token trained), a null
    log-prob (NaN), int8 masks, float32 log-probs."""
    import pyarrow as pa

    from mismatch_probe.ingest import miles
    from mismatch_probe.ingest.records import parse_steps

    src = write_miles(tmp_path / "src", synthetic_steps([1, 3], seqs=9, seed=2))
    file = src / "dashboard_columns" / "rollout_3.parquet"
    table = pq.read_table(file)
    masks = table.column("loss_mask").to_pylist()
    masks[4] = None
    logprobs = table.column("rollout_log_probs").to_pylist()
    logprobs[6][1] = None
    table = table.set_column(4, "loss_mask", pa.array(masks, table.schema.field(4).type))
    table = table.set_column(5, "rollout_log_probs",
                             pa.array(logprobs, table.schema.field(5).type))  # fmt: skip
    pq.write_table(table, file, row_group_size=8)
    new = list(miles.read(src, parse_steps(None)))
    old = []
    for step, path in miles.column_files(src, parse_steps(None)):
        for row, sample in enumerate(pq.read_table(path, columns=list(miles.COLUMNS)).to_pylist()):
            old.append(miles._record(sample, step, f"{path} row {row}"))
    assert len(new) == len(old) == 18
    for a, b in zip(new, old, strict=True):
        for field in ("token_ids", "positions", "rollout", "prompt_ids", "response_ids"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), (b.source, field)
        assert (a.step, a.source, a.prompt_key) == (b.step, b.source, b.prompt_key)
    assert np.isnan(new[9 + 6].rollout).any()
    # a column that is not one of the token arrays stays as to_pylist gives it
    sample_index = pa.array([[i, i] for i in range(table.num_rows)], pa.list_(pa.int32()))
    pq.write_table(table.set_column(0, "sample_index", sample_index), file, row_group_size=8)
    keys = [r.prompt_key for r in miles.read(src, parse_steps(None))][9:]
    assert keys == [f"sample {[i, i]}" for i in range(9)]


@pytest.mark.parametrize(
    "text,lenient",
    [
        (b'{"a": [1, Inf]}\n', True),
        (b'{"a": [1, -Inf]}\n', True),
        (b'{"a": [-NaN]}\n', True),
        (b'{"a": [1,' + b" " * 80 + b"Inf]}\n", True),
        (b'{"a": [1,  Infinity, -Infinity, NaN]}\n', False),  # JSON for Python's json too
        (b'{"a": "Information", "b": "NaN and Inf-like words"}\n', False),
    ],
)
def test_the_values_only_pyarrow_reads_are_found(text: bytes, lenient: bool) -> None:
    from mismatch_probe.ingest import jsonl

    assert jsonl._lenient(text) is lenient


@pytest.mark.parametrize(
    "text,blank",
    [(b"a\n\nb\n", True), (b"a\n  \nb\n", True), (b"\na\n", True), (b"a\n \n", True),
     (b"a\nb\n", False), (b"a\n  b\n", False), (b"a\nb", False)],
)  # fmt: skip
def test_blank_lines_and_lines_of_spaces_are_found(text: bytes, blank: bool) -> None:
    from mismatch_probe.ingest import jsonl

    assert jsonl._blank_line(text) is blank
