"""Issue 22, the ingest side: faults of ``probe ingest`` found by review, each through the real
CLI. A file never runs code (``--trust-pickle`` on slime, TorchScript archives inside every
torch-loaded payload); ids are never stored as other numbers; a step number is never read twice;
a field of the wrong type, an id outside the model's vocabulary or a bad option is one line on
stderr and exit code 2, with no traceback and nothing in ``--out`` (not even the hidden
directory beside it); errors and interrupts name what the user knows (``--out``, the stage).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest import IngestConfig
from mismatch_probe.ingest.hook import (
    FORMAT_KEY,
    FORMAT_NAME,
    FORMAT_VERSION,
    OFF_POLICY_KEY,
    PROBE_SCHEMA,
    VERSION_KEY,
    ProbeWriter,
)
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.store import TOKENS_FILE
from tests.cli_runner import run_probe
from tests.ingest_fixtures import (
    SKYRL_MODULE,
    TrainingInputBatch,
    rebuild_tensor_batch,
    registered,
    skyrl_batch,
    slime_payload,
    synthetic_steps,
    write_miles,
    write_nemo_rl,
    write_prime_rl,
    write_skyrl,
    write_slime,
)

REPO = Path(__file__).resolve().parents[1]
Case = Callable[[Path], tuple[list[str], str]]


def refused(args: list[str], message: str, tmp_path: Path, mp: Any, cap: Any) -> str:
    """``probe ingest ARGS --out runs/run``: exit 2, one line holding ``message``, no traceback,
    nothing in ``runs/`` (no run, no hidden partial directory)."""
    out = tmp_path / "runs" / "run"
    code, _, err = run_probe(["ingest", *args, "--out", str(out)], mp, cap)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert "Traceback" not in err and ".partial" not in err
    assert not out.exists()
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []
    return err


def ingested(args: list[str], tmp_path: Path, mp: Any, cap: Any) -> dict[str, Any]:
    """``probe ingest ARGS --out run`` succeeds; its run.json."""
    out = tmp_path / "run"
    code, _, err = run_probe(["ingest", *args, "--out", str(out)], mp, cap)
    assert code == 0, err
    return json.loads((out / "run.json").read_text())


def _rewrite_line(path: Path, index: int, edit: Callable[[dict], Any]) -> None:
    lines = path.read_text().splitlines()
    obj = json.loads(lines[index])
    edit(obj)
    lines[index] = json.dumps(obj)
    path.write_text("\n".join(lines) + "\n")


def _prime(tmp: Path, steps: list[int] | None = None) -> Path:
    return write_prime_rl(tmp / "src", synthetic_steps(steps or [1, 2], seqs=2))


# --- 1. --trust-pickle on slime never runs the file's code ------------------------------------


class _Exploit:
    """Unpickling this calls ``os.system`` (were it allowed), creating ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_slime_trust_pickle_never_runs_the_files_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    marker = tmp_path / "pwned"
    src = write_slime(tmp_path / "src", synthetic_steps([1, 2], seqs=2))
    payload = slime_payload(2, synthetic_steps([2], seqs=2)[2])
    payload["samples"][1]["metadata"] = {"note": _Exploit(marker)}
    torch.save(payload, src / "train_data" / "2.pt")
    err = refused(["slime", str(src), "--trust-pickle"], "2.pt: the pickle needs ", tmp_path,
                  monkeypatch, capsys)  # fmt: skip
    assert f"{os.system.__module__}.system, which probe does not load" in err
    assert not marker.exists()
    # without --trust-pickle it is refused naming the flag; the file is a live exploit
    refused(["slime", str(src)], "--trust-pickle", tmp_path, monkeypatch, capsys)
    with contextlib.suppress(Exception):
        torch.load(src / "train_data" / "2.pt", weights_only=False)
    assert marker.exists()


class SlimeStatus(Enum):
    """Stands for slime's ``Sample.Status``, pickled under slime's module."""

    COMPLETED = "completed"


def test_slime_trust_pickle_loads_numpy_and_slimes_own_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """What weights-only refuses but the restricted unpickler rebuilds: numpy arrays, and
    slime's classes as inert stand-ins (never imported)."""
    data = synthetic_steps([1, 2], seqs=2)
    src = write_slime(tmp_path / "src", data)
    payload = slime_payload(2, data[2])
    payload["samples"][0]["rewards"] = np.array([1.0, 0.5])
    payload["samples"][1]["status"] = SlimeStatus.COMPLETED
    with registered("slime.utils.types", Status=SlimeStatus):
        torch.save(payload, src / "train_data" / "2.pt")
    refused(["slime", str(src)], "--trust-pickle", tmp_path, monkeypatch, capsys)
    monkeypatch.setitem(sys.modules, "slime", None)  # read without slime
    run = ingested(["slime", str(src), "--trust-pickle"], tmp_path, monkeypatch, capsys)
    assert run["counts"]["steps"] == 2 and run["counts"]["sequences"] == 4


# --- 2. TorchScript archives are refused before torch.load sees them ---------------------------


class _Scripted(torch.nn.Module):
    """A TorchScript module whose scripted ``__setstate__`` prints when loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.x = torch.zeros(1)

    @torch.jit.export
    def __getstate__(self) -> tuple[torch.Tensor, bool]:
        return (self.x, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[torch.Tensor, bool]) -> None:
        print("TORCHSCRIPT-SETSTATE-RAN")
        self.x = state[0]
        self.training = state[1]


def _torchscript_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(_Scripted()), buffer)
    return buffer.getvalue()


class _ScriptedDataProto:
    """verl's ``DataProto`` whose TensorDict bytes are a TorchScript archive."""

    def __getstate__(self) -> tuple[Any, ...]:
        return _torchscript_bytes(), {}, {}


class _ScriptedBatch(TrainingInputBatch):
    """SkyRL's batch with one ``{"format": "torch"}`` tensor that is a TorchScript archive."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["batch_dict"]["rollout_logprobs"] = {"format": "torch", "data": _torchscript_bytes()}
        return state


def _scripted_dump(fmt: str, root: Path) -> Path:
    if fmt == "slime":
        (root / "train_data").mkdir(parents=True)
        (root / "train_data" / "1.pt").write_bytes(_torchscript_bytes())
        return root / "train_data" / "1.pt"
    if fmt == "verl-dp":
        root.mkdir(parents=True)
        file = root / "step_1.dp"
        with registered("verl.protocol", DataProto=_ScriptedDataProto), file.open("wb") as fh:
            pickle.dump(_ScriptedDataProto(), fh)
        return file
    (root / "dumped_data").mkdir(parents=True)
    file = root / "dumped_data" / "global_step_1_training_input.pkl"
    batch = skyrl_batch(synthetic_steps([1], seqs=2)[1])
    batch.__class__ = _ScriptedBatch
    with registered(SKYRL_MODULE, TrainingInputBatch=_ScriptedBatch,
                    _rebuild_tensor_batch=rebuild_tensor_batch), file.open("wb") as fh:  # fmt: skip
        pickle.dump(batch, fh)
    return file


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
@pytest.mark.parametrize(
    ("fmt", "trust"), [("slime", False), ("slime", True), ("verl-dp", True), ("skyrl", True)]
)
def test_a_torchscript_archive_is_refused_before_loading(
    fmt: str, trust: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    file = _scripted_dump(fmt, tmp_path / "src")
    args = [fmt, str(tmp_path / "src"), *(["--trust-pickle"] if trust else [])]
    err = refused(args, f"{file.name}: a TorchScript archive", tmp_path, monkeypatch, capfd)
    assert "TORCHSCRIPT-SETSTATE-RAN" not in err
    assert "TORCHSCRIPT-SETSTATE-RAN" not in capfd.readouterr().out
    # the archive's code runs under a plain torch.load: the test above can fail
    with contextlib.suppress(Exception):
        torch.load(io.BytesIO(_torchscript_bytes()), weights_only=False)
    assert "TORCHSCRIPT-SETSTATE-RAN" in capfd.readouterr().out


# --- 5. ids are stored as given or refused ------------------------------------------------------


def _token_id(value: int) -> Case:
    def case(tmp: Path) -> tuple[list[str], str]:
        src = _prime(tmp)
        file = src / "token_exports" / "step_2" / "rank_0.jsonl"
        _rewrite_line(file, 1, lambda o: o["token_ids"].__setitem__(-1, value))
        return ["prime-rl", str(src)], f"rank_0.jsonl:2: token id {value} is outside 0..2147483647"

    case.__name__ = f"token_id_{value}"
    return case


def _probe_file(root: Path, table: dict[str, Any], schema: pa.Schema, meta: dict) -> Path:
    (root / "step_1").mkdir(parents=True)
    pq.write_table(
        pa.table(table, schema=schema.with_metadata(meta)), root / "step_1" / "a.parquet"
    )
    return root


def _probe_columns(**changes: Any) -> dict[str, Any]:
    columns: dict[str, Any] = {
        "step": [1, 1, 1], "sequence": [0, 0, 0], "group": ["g", "g", "g"],
        "position": [0, 1, 2], "token_id": [5, 6, 7],
        "rollout_logprob": [-1.0, -2.0, -0.5], "train_logprob": [-1.1, -2.0, -0.4],
    }  # fmt: skip
    columns.update(changes)
    return columns


_META = {FORMAT_KEY: FORMAT_NAME.encode(), VERSION_KEY: FORMAT_VERSION.encode()}


def null_position(tmp: Path) -> tuple[list[str], str]:
    """A foreign ``probe``-format file whose position column is nullable and holds a null."""
    schema = pa.schema([f.with_nullable(True) for f in PROBE_SCHEMA])
    src = _probe_file(tmp / "src", _probe_columns(position=[0, None, 2]), schema, _META)
    return ["probe", str(src)], "a.parquet: column position holds nulls"


# --- 6. a step number is never read twice ------------------------------------------------------


def duplicate_prime_rl_step(tmp: Path) -> tuple[list[str], str]:
    src = _prime(tmp)
    write_prime_rl(tmp / "other", synthetic_steps([2], seqs=2))
    (tmp / "other" / "token_exports" / "step_2").rename(src / "token_exports" / "step_02")
    return ["prime-rl", str(src)], "step 2 appears twice: "


def duplicate_nemo_step(tmp: Path) -> tuple[list[str], str]:
    src = write_nemo_rl(tmp / "src", synthetic_steps([1, 2], seqs=2))
    (src / "train_data_step02.jsonl").write_text((src / "train_data_step2.jsonl").read_text())
    return ["nemo-rl", str(src)], "step 2 appears twice: "


def duplicate_slime_step(tmp: Path) -> tuple[list[str], str]:
    src = write_slime(tmp / "src", synthetic_steps([1, 2], seqs=2))
    (src / "train_data" / "02.pt").write_bytes((src / "train_data" / "2.pt").read_bytes())
    return ["slime", str(src)], "step 2 appears twice: "


def duplicate_probe_step(tmp: Path) -> tuple[list[str], str]:
    writer = ProbeWriter(tmp / "src")
    for step in (2, 2):
        writer.write_step(step, [[5, 6]], [[1, 1]], [[-1.0, -2.0]], [[-1.0, -2.1]])
    (tmp / "src" / "step_2").rename(tmp / "src" / "step_02")
    writer.write_step(2, [[5, 6]], [[1, 1]], [[-1.0, -2.0]], [[-1.0, -2.1]])
    return ["probe", str(tmp / "src")], "step 2 appears twice: "


def test_duplicate_steps_name_both_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args, _ = duplicate_nemo_step(tmp_path)
    err = refused(args, "step 2 appears twice", tmp_path, monkeypatch, capsys)
    assert "/train_data_step2.jsonl" in err and "/train_data_step02.jsonl" in err
    # steps that are not doubled still read
    run = ingested([*args, "--steps", "1"], tmp_path, monkeypatch, capsys)
    assert run["counts"]["steps"] == 1


# --- 10. fields of the wrong type ---------------------------------------------------------------


def prime_sample_id_list(tmp: Path) -> tuple[list[str], str]:
    src = _prime(tmp)
    file = src / "token_exports" / "step_1" / "rank_0.jsonl"
    _rewrite_line(file, 0, lambda o: o.update(sample_id=[1, 2]))
    return ["prime-rl", str(src)], "rank_0.jsonl:1: sample_id [1, 2] is not a string or an integer"


def prime_off_policy_infinite(tmp: Path) -> tuple[list[str], str]:
    src = _prime(tmp)
    (src / "configs").mkdir()
    (src / "configs" / "orchestrator.json").write_text('{"max_off_policy_steps": 1e400}')
    return ["prime-rl", str(src)], "orchestrator.json: max_off_policy_steps inf is not a"


def prime_off_policy_text(tmp: Path) -> tuple[list[str], str]:
    src = _prime(tmp)
    (src / "configs").mkdir()
    (src / "configs" / "rl.json").write_text('{"orchestrator": {"max_off_policy_steps": "8"}}')
    return ["prime-rl", str(src)], "rl.json: max_off_policy_steps '8' is not a non-negative"


def _nemo_sample_mask(value: Any, message: str) -> Case:
    def case(tmp: Path) -> tuple[list[str], str]:
        src = write_nemo_rl(tmp / "src", synthetic_steps([1], seqs=2))
        _rewrite_line(src / "train_data_step1.jsonl", 1, lambda o: o.update(sample_loss_mask=value))
        return ["nemo-rl", str(src)], f"train_data_step1.jsonl:2: sample_loss_mask {message}"

    case.__name__ = f"nemo_sample_loss_mask_{value!r}"
    return case


def _slime_sample(tmp: Path, **fields: Any) -> Path:
    src = write_slime(tmp / "src", synthetic_steps([1, 2], seqs=2))
    payload = slime_payload(2, synthetic_steps([2], seqs=2)[2])
    payload["samples"][1].update(fields)
    torch.save(payload, src / "train_data" / "2.pt")
    return src


def slime_response_lengths_list(tmp: Path) -> tuple[list[str], str]:
    src = _slime_sample(tmp, response_lengths=[3, 4])
    return ["slime", str(src)], "2.pt samples[1]: response_lengths [3, 4] is not an integer"


def slime_response_lengths_text(tmp: Path) -> tuple[list[str], str]:
    src = _slime_sample(tmp, response_lengths="3")
    return ["slime", str(src)], "2.pt samples[1]: response_lengths '3' is not an integer"


def _skyrl_metadata(tmp: Path, **metadata: Any) -> Path:
    data = synthetic_steps([1], seqs=4)
    root = tmp / "src"
    (root / "dumped_data").mkdir(parents=True)
    batch = skyrl_batch(data[1])
    batch.metadata.update(metadata)
    file = root / "dumped_data" / "global_step_1_training_input.pkl"
    with registered(SKYRL_MODULE, TrainingInputBatch=TrainingInputBatch,
                    _rebuild_tensor_batch=rebuild_tensor_batch), file.open("wb") as fh:  # fmt: skip
        pickle.dump(batch, fh)
    return root


def skyrl_pad_size_text(tmp: Path) -> tuple[list[str], str]:
    src = _skyrl_metadata(tmp, pad_size="two")
    return ["skyrl", str(src), "--trust-pickle"], "metadata: pad_size 'two' is not an integer"


def skyrl_pad_size_too_large(tmp: Path) -> tuple[list[str], str]:
    src = _skyrl_metadata(tmp, pad_size=9)
    return ["skyrl", str(src), "--trust-pickle"], "pad_size 9 is not within 0..4 rows"


def skyrl_boundary_not_a_pair(tmp: Path) -> tuple[list[str], str]:
    src = _skyrl_metadata(tmp, policy_prompt_boundaries=[(0, 2), 3])
    return ["skyrl", str(src), "--trust-pickle"], "policy_prompt_boundaries: 3 is not a (start,"


def skyrl_boundary_text(tmp: Path) -> tuple[list[str], str]:
    src = _skyrl_metadata(tmp, policy_prompt_boundaries=[(0, "x")])
    return ["skyrl", str(src), "--trust-pickle"], "bound 'x' is not an integer"


def skyrl_boundaries_not_a_list(tmp: Path) -> tuple[list[str], str]:
    src = _skyrl_metadata(tmp, policy_prompt_boundaries=7)
    return ["skyrl", str(src), "--trust-pickle"], "policy_prompt_boundaries 7 is not a list"


def probe_off_policy_text(tmp: Path) -> tuple[list[str], str]:
    meta = {**_META, OFF_POLICY_KEY: b"eight"}
    src = _probe_file(tmp / "src", _probe_columns(), PROBE_SCHEMA, meta)
    return ["probe", str(src)], "max_off_policy_steps 'eight' is not a non-negative integer"


def probe_position_as_text(tmp: Path) -> tuple[list[str], str]:
    schema = PROBE_SCHEMA.set(3, pa.field("position", pa.string()))
    src = _probe_file(tmp / "src", _probe_columns(position=["0", "1", "2"]), schema, _META)
    return ["probe", str(src)], "a.parquet: column position is string, expected integer"


def probe_logprob_as_text(tmp: Path) -> tuple[list[str], str]:
    schema = PROBE_SCHEMA.set(6, pa.field("train_logprob", pa.string()))
    src = _probe_file(tmp / "src", _probe_columns(train_logprob=["a", "b", "c"]), schema, _META)
    return ["probe", str(src)], "column train_logprob is string, expected floating-point"


# --- a file where a directory belongs ------------------------------------------------------------


def prime_rl_file(tmp: Path) -> tuple[list[str], str]:
    file = _prime(tmp) / "token_exports" / "step_1" / "rank_0.jsonl"
    return ["prime-rl", str(file)], "rank_0.jsonl is a file; give the directory that holds"


def nemo_rl_file(tmp: Path) -> tuple[list[str], str]:
    src = write_nemo_rl(tmp / "src", synthetic_steps([1], seqs=2))
    return ["nemo-rl", str(src / "train_data_step1.jsonl")], "step1.jsonl is a file; give the"


CASES: list[Case] = [
    _token_id(2**40),
    _token_id(-1),
    null_position,
    duplicate_prime_rl_step,
    duplicate_nemo_step,
    duplicate_slime_step,
    duplicate_probe_step,
    prime_sample_id_list,
    prime_off_policy_infinite,
    prime_off_policy_text,
    slime_response_lengths_list,
    slime_response_lengths_text,
    _nemo_sample_mask(["x"], "'x' is not a number"),
    _nemo_sample_mask([2.0], "2.0 is not within 0..1"),
    _nemo_sample_mask([-1], "-1 is not within 0..1"),
    skyrl_pad_size_text,
    skyrl_pad_size_too_large,
    skyrl_boundary_not_a_pair,
    skyrl_boundary_text,
    skyrl_boundaries_not_a_list,
    probe_off_policy_text,
    probe_position_as_text,
    probe_logprob_as_text,
    prime_rl_file,
    nemo_rl_file,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args, message = case(tmp_path)
    refused(args, message, tmp_path, monkeypatch, capsys)


def test_the_largest_int32_id_is_stored_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    src = _prime(tmp_path)
    file = src / "token_exports" / "step_2" / "rank_0.jsonl"
    _rewrite_line(file, 1, lambda o: o["token_ids"].__setitem__(-1, 2**31 - 1))
    ingested(["prime-rl", str(src)], tmp_path, monkeypatch, capsys)
    assert 2**31 - 1 in pq.read_table(tmp_path / "run" / TOKENS_FILE).column("token_id").to_pylist()


def test_the_hook_writer_refuses_ids_outside_int32(tmp_path: Path) -> None:
    writer = ProbeWriter(tmp_path / "logs")
    with pytest.raises(ProbeError, match=r"token id 1099511627776 is outside 0\.\.2147483647"):
        writer.write_step(1, [[5, 2**40]], [[1, 1]], [[-1.0, -2.0]], [[-1.0, -2.1]])
    assert not list((tmp_path / "logs").rglob("*.parquet"))
    writer.write_step(1, [[5, 2**40]], [[1, 0]], [[-1.0, -2.0]], [[-1.0, -2.1]])  # untrained


def test_well_typed_foreign_probe_files_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Nullable columns without nulls, int64 ids, float64 log-probs: accepted as they are."""
    schema = pa.schema(
        [pa.field(f.name, pa.int64() if pa.types.is_integer(f.type) else pa.float64()
                  if pa.types.is_floating(f.type) else f.type) for f in PROBE_SCHEMA]
    )  # fmt: skip
    src = _probe_file(tmp_path / "src", _probe_columns(), schema, {**_META, OFF_POLICY_KEY: b"0"})
    run = ingested(["probe", str(src)], tmp_path, monkeypatch, capsys)
    assert run["counts"]["tokens"] == 3 and run["off_policy"]["max_off_policy_steps"] == 0
    assert pq.read_table(tmp_path / "run" / TOKENS_FILE).column("position").to_pylist() == [0, 1, 2]


# --- 12. miles-parquet ids outside the model's vocabulary ---------------------------------------


@pytest.mark.parametrize(("where", "value"), [("response", 5000), ("prompt", -3)])
def test_miles_ids_outside_the_vocabulary_are_one_line(
    where: str,
    value: int,
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    data = synthetic_steps([1, 2], seqs=3, seed=6)
    seq = data[2][1]
    (seq.response if where == "response" else seq.prompt)[0] = value
    src = write_miles(tmp_path / "src", data)
    message = f"rollout_2.parquet row 1: {where} token id {value} is outside the vocabulary of "
    err = refused(["miles-parquet", str(src), "--model", str(tiny_model)], message, tmp_path,
                  monkeypatch, capsys)  # fmt: skip
    assert "(ids 0..383)" in err  # the tiny model's 384 ids


# --- 13. ingest's options: the scan's rules, checked before anything is read --------------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--batch-tokens", "0", "--batch-tokens must be >= 1, got 0"),
        ("--batch-tokens", "-5", "--batch-tokens must be >= 1, got -5"),
        ("--temperature", "nan", "--temperature must be a finite number, got nan"),
        ("--temperature", "inf", "--temperature must be a finite number, got inf"),
        ("--temperature", "-1", "--temperature must be >= 0, got -1.0"),
    ],
)
def test_ingest_options_are_checked_up_front(
    option: str,
    value: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    """Checked when the config is built: a miles ingest needing a model that is not there
    fails on the option, before any model is loaded or any file read."""
    src = write_miles(tmp_path / "src", synthetic_steps([1], seqs=2))
    args = ["miles-parquet", str(src), "--model", str(tmp_path / "no-model"), option, value]
    refused(args, message, tmp_path, monkeypatch, capsys)


def test_ingest_and_scan_share_the_option_rules(tmp_path: Path) -> None:
    for field, scan_kw in (
        ({"batch_tokens": 0}, {"batch_tokens": 0}),
        ({"temperature": float("nan")}, {"sampling": _sampling(float("nan"))}),
        ({"temperature": -2.0}, {"sampling": _sampling(-2.0)}),
    ):
        with pytest.raises(ProbeError) as ingest_error:
            IngestConfig("prime-rl", tmp_path, tmp_path / "out", **field)
        with pytest.raises(ProbeError) as scan_error:
            ScanConfig(**scan_kw)
        assert str(ingest_error.value) == str(scan_error.value)
    IngestConfig("prime-rl", tmp_path, tmp_path / "out", temperature=0.0, batch_tokens=1)


def _sampling(temperature: float) -> Any:
    from mismatch_probe.sampling import SamplingSpec

    return SamplingSpec(temperature=temperature)


# --- errors of the metric pass name --out, interrupts name the stage ---------------------------


def test_a_metric_pass_error_names_out_not_the_hidden_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Every engine log-prob null: the store is written, the metric pass finds no valid token."""
    src = _prime(tmp_path)
    for step in (1, 2):
        file = src / "token_exports" / f"step_{step}" / "rank_0.jsonl"
        for i in range(2):
            _rewrite_line(
                file, i, lambda o: o.update(inference_logprobs=[None] * len(o["token_ids"]))
            )
    err = refused(["prime-rl", str(src)], "no valid response token", tmp_path, monkeypatch, capsys)
    assert str(tmp_path / "runs" / "run" / TOKENS_FILE) in err


def _interrupted(args: list[str], stage: str, tmp_path: Path) -> tuple[int, str]:
    """``probe ingest ARGS`` in a process of its own, held on entering ``stage`` and sent
    SIGINT there: (exit code, stderr)."""
    trace = tmp_path / "stages.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MISMATCH_PROBE_STAGE_TRACE": str(trace),
           "MISMATCH_PROBE_STAGE_HOLD": stage}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "mismatch_probe.cli", "ingest", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 300
    while not (trace.exists() and stage in trace.read_text().splitlines()):
        assert proc.poll() is None and time.monotonic() < deadline, (
            proc.stderr and proc.stderr.read()
        )
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.parametrize("stage", ["reading", "metrics", "reports"])
def test_an_interrupt_names_the_ingest_stage(stage: str, tmp_path: Path) -> None:
    out = tmp_path / "runs" / "run"
    code, err = _interrupted(["prime-rl", str(_prime(tmp_path)), "--out", str(out)], stage,
                             tmp_path)  # fmt: skip
    assert code == 130, err
    assert err.strip() == f"interrupted during {stage}; nothing written"
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


def test_an_interrupt_while_rescoring_says_so(tiny_model: Path, tmp_path: Path) -> None:
    src = write_miles(tmp_path / "src", synthetic_steps([1], seqs=2))
    out = tmp_path / "runs" / "run"
    args = ["miles-parquet", str(src), "--model", str(tiny_model), "--out", str(out)]
    code, err = _interrupted(args, "rescoring", tmp_path)
    assert code == 130 and err.strip() == "interrupted during rescoring; nothing written", err
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


def test_skyrl_fixture_with_metadata_still_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The must-not of the SkyRL metadata cases: integer pad_size and boundaries read."""
    src = write_skyrl(tmp_path / "src", synthetic_steps([1], seqs=4), pad_size=1)
    run = ingested(["skyrl", str(src), "--trust-pickle"], tmp_path, monkeypatch, capsys)
    assert run["counts"]["sequences"] == 4
