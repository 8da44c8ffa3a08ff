"""``probe ingest verl-dp|skyrl``: pickle-based dumps, end to end through the CLI.

With ``--trust-pickle`` the store holds every trained token with both log-probs and per-step
metrics that match a hand computation and a prime-rl ingest of the same numbers, read without
importing verl, tensordict or SkyRL. Without it, and for a corrupt file or a pickle naming a
global outside the whitelist (``os.system``), one line and exit 2, nothing in ``--out``, and the
crafted call never runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from mismatch_probe.store import TOKENS_FILE
from tests.cli_runner import run_probe, run_probe_err
from tests.ingest_fixtures import (
    SKYRL_MODULE,
    DataProto,
    Seq,
    TrainingInputBatch,
    expected_tokens,
    rebuild_tensor_batch,
    registered,
    skyrl_batch,
    synthetic_steps,
    verl_batch,
    write_prime_rl,
    write_skyrl,
    write_verl,
)

STEPS = [2, 5, 6]


def _skyrl_legacy(root: Path, data: dict[int, list[Seq]]) -> Path:
    """Early-2026 SkyRL: raw tensor items, bfloat16 trainer log-probs, two padding rows."""
    import torch

    return write_skyrl(root, data, legacy=True, pad_size=2, train_dtype=torch.bfloat16)


WRITERS: dict[str, tuple[str, Callable[[Path, dict[int, list[Seq]]], Path]]] = {
    "verl-dp": ("verl-dp", write_verl),
    "verl-dp-unconsolidated": ("verl-dp", lambda root, data: write_verl(root, data, "plain")),
    "verl-dp-numpy": ("verl-dp", lambda root, data: write_verl(root, data, "numpy")),
    "skyrl": ("skyrl", write_skyrl),
    "skyrl-legacy-bf16": ("skyrl", _skyrl_legacy),
}


def _k3(rollout: np.ndarray, train: np.ndarray) -> float:
    r = train.astype(np.float64) - rollout.astype(np.float64)
    return float(np.mean(np.expm1(r) - r))


def _ingest(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any) -> str:
    code, out, err = run_probe(["ingest", *args], monkeypatch, capsys)
    assert code == 0, err
    return out


@pytest.mark.parametrize("case", list(WRITERS))
def test_each_pickle_format_ingests_every_trained_token(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    fmt, write = WRITERS[case]
    data = synthetic_steps(STEPS, seqs=4, seed=3, growth=0.2)
    src = write(tmp_path / "src", data)
    for module in ("verl", "tensordict", "skyrl", "skyrl_train"):  # read without the frameworks
        monkeypatch.setitem(sys.modules, module, None)
    run = tmp_path / "run"
    _ingest([fmt, str(src), "--out", str(run), "--trust-pickle"], monkeypatch, capsys)

    rollout, train = expected_tokens(data)
    if case.endswith("bf16"):  # the trainer's side was dumped in bfloat16
        import torch

        train = torch.tensor(train.astype(np.float64)).to(torch.bfloat16).float().numpy()
    table = pq.read_table(run / TOKENS_FILE)
    assert table.column("rollout_logprob").to_numpy().tolist() == rollout.tolist()
    assert table.column("train_logprob").to_numpy().tolist() == train.tolist()
    assert table.column("token_id").to_pylist() == [
        t for seqs in data.values() for s in seqs for t in s.response
    ]
    assert table.column("position").to_pylist() == [
        p for seqs in data.values() for s in seqs for p in range(len(s.response))
    ]
    assert table.column("step").to_pylist() == [
        step for step, seqs in data.items() for s in seqs for _ in s.response
    ]
    # two responses per prompt (verl uid, SkyRL prompt boundaries)
    seqs = pq.read_table(run / "sequences.parquet").to_pylist()
    assert [(r["step"], r["prompt_id"], r["sample_id"]) for r in seqs[:4]] == [
        (2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1),
    ]  # fmt: skip
    steps = json.loads((run / "steps.json").read_text())["steps"]
    for step in STEPS:
        r, t = expected_tokens({step: data[step]})
        if case.endswith("bf16"):
            import torch

            t = torch.tensor(t.astype(np.float64)).to(torch.bfloat16).float().numpy()
        assert steps[str(step)]["k3_kl"] == pytest.approx(_k3(r, t), rel=1e-9, abs=1e-15)
        assert steps[str(step)]["num_tokens"] == len(r)
    info = json.loads((run / "run.json").read_text())
    assert info["source"]["format"] == fmt
    assert info["source"]["format_version"].split()[0] in ("DataProto", "TrainingInputBatch")
    assert info["counts"]["sequences"] == 12 and info["counts"]["empty_sequences_skipped"] == 0


@pytest.mark.parametrize("fmt", ["verl-dp", "skyrl"])
def test_same_numbers_give_the_same_metrics_as_prime_rl(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    data = synthetic_steps([1, 2], seqs=3, seed=4, growth=0.3)
    prime, other = tmp_path / "prime", tmp_path / "other"
    _ingest(["prime-rl", str(write_prime_rl(tmp_path / "p", data)), "--out", str(prime)],
            monkeypatch, capsys)  # fmt: skip
    _ingest([fmt, str(WRITERS[fmt][1](tmp_path / "s", data)), "--out", str(other),
             "--trust-pickle"], monkeypatch, capsys)  # fmt: skip
    for name in ("metrics.json", "steps.json"):
        a = json.loads((prime / name).read_text())
        b = json.loads((other / name).read_text())
        for data in (a, b):  # prompt ids come from each format's own group keys (or none)
            for rec in data.get("outliers", []):
                rec.pop("prompt_id"), rec.pop("sample_id")
            data.pop("store", None)  # each store's own fingerprint (its files differ)
        assert a == b, name


def _assert_refused(
    args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> str:
    out = tmp_path / "runs" / "run"
    code, err = run_probe_err(["ingest", *args, "--out", str(out)], monkeypatch, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert "Traceback" not in err
    assert not out.exists()
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []
    return err


@pytest.mark.parametrize("fmt", ["verl-dp", "skyrl"])
def test_without_trust_pickle_is_refused_naming_the_flag(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    src = WRITERS[fmt][1](tmp_path / "src", synthetic_steps([1], seqs=2))
    err = _assert_refused([fmt, str(src)], "--trust-pickle", tmp_path, monkeypatch, capsys)
    assert "run code" in err


def _dump_path(fmt: str, root: Path, step: int) -> Path:
    if fmt == "verl-dp":
        return root / f"step_{step}.dp"
    return root / "dumped_data" / f"global_step_{step}_training_input.pkl"


@pytest.mark.parametrize("fmt", ["verl-dp", "skyrl"])
def test_a_corrupt_dump_is_one_line(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    src = WRITERS[fmt][1](tmp_path / "src", synthetic_steps([1, 2], seqs=2))
    bad = _dump_path(fmt, src, 2)
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    args = [fmt, str(src), "--trust-pickle"]
    _assert_refused(args, f"{bad.name}: not a readable", tmp_path, monkeypatch, capsys)


class _Exploit:
    """Unpickling this calls ``os.system`` (were it allowed), creating ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class _InnerExploit:
    """A ``DataProto`` whose ``torch.save`` buffer (verl's TensorDict bytes) is the exploit."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __getstate__(self) -> tuple[Any, ...]:
        import io

        import torch

        buffer = io.BytesIO()
        torch.save(_Exploit(self.marker), buffer)
        return buffer.getvalue(), {}, {}


def _crafted(fmt: str, root: Path, marker: Path) -> Path:
    """A one-step dump holding an ``_Exploit`` (verl: a ``non_tensor_batch`` column, or the
    TensorDict buffer; SkyRL: a metadata entry)."""
    from tensordict import TensorDict

    seqs = synthetic_steps([1], seqs=2)[1]
    root.mkdir(parents=True)
    if fmt == "verl-dp-buffer":
        file = root / "step_1.dp"
        with registered("verl.protocol", DataProto=_InnerExploit), file.open("wb") as fh:
            pickle.dump(_InnerExploit(marker), fh)
        return file
    if fmt == "verl-dp":
        tensors, non_tensor = verl_batch(seqs)
        non_tensor["reward_extra_info"] = np.array([_Exploit(marker)] * 2, dtype=object)
        file = root / "step_1.dp"
        DataProto(TensorDict(tensors, batch_size=[2]), non_tensor, {}).save_to_disk(file)
        return file
    batch = skyrl_batch(seqs)
    batch.metadata["metrics"] = {"loss/avg_final_rewards": _Exploit(marker)}
    file = root / "dumped_data" / "global_step_1_training_input.pkl"
    file.parent.mkdir()
    with registered(SKYRL_MODULE, TrainingInputBatch=TrainingInputBatch,
                    _rebuild_tensor_batch=rebuild_tensor_batch), file.open("wb") as fh:  # fmt: skip
        pickle.dump(batch, fh)
    return file


@pytest.mark.parametrize("case", ["verl-dp", "verl-dp-buffer", "skyrl"])
def test_a_global_outside_the_whitelist_is_refused_and_never_runs(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Even with --trust-pickle: the crafted ``os.system`` call is named, not run."""
    marker = tmp_path / "pwned"
    file = _crafted(case, tmp_path / "src", marker)
    args = [case.removesuffix("-buffer"), str(tmp_path / "src"), "--trust-pickle"]
    err = _assert_refused(args, "system, which probe does not load", tmp_path, monkeypatch, capsys)
    assert f"needs {os.system.__module__}.system" in err
    assert not marker.exists()
    # plain pickle runs it: the file is a live exploit, so the test above can fail
    if case == "verl-dp-buffer":  # verl's __setstate__ torch.loads the buffer, weights_only=False
        import io

        import torch

        buffer = _InnerExploit(marker).__getstate__()[0]
        with contextlib.suppress(Exception):
            torch.load(io.BytesIO(buffer), weights_only=False)
    else:
        with (
            registered("verl.protocol", DataProto=DataProto),
            registered(SKYRL_MODULE, TrainingInputBatch=TrainingInputBatch,
                       _rebuild_tensor_batch=rebuild_tensor_batch),
            contextlib.suppress(Exception),
            file.open("rb") as fh,
        ):  # fmt: skip
            pickle.load(fh)
    assert marker.exists()


def _verl_unequal(root: Path) -> tuple[list[str], str]:
    from tensordict import TensorDict

    root.mkdir(parents=True)
    tensors, non_tensor = verl_batch(synthetic_steps([1], seqs=2)[1])
    tensors["old_log_probs"] = tensors["old_log_probs"][:, :-1]
    DataProto(TensorDict(tensors, batch_size=[2]), non_tensor, {}).save_to_disk(root / "step_1.dp")
    return ["verl-dp", str(root)], "step_1.dp: arrays of unequal shape (responses ["


def _skyrl_no_forward(root: Path) -> tuple[list[str], str]:
    batch = skyrl_batch(synthetic_steps([1], seqs=2)[1])
    batch["action_log_probs"] = None  # SkyRL's _skip_policy_forward
    (root / "dumped_data").mkdir(parents=True)
    file = root / "dumped_data" / "global_step_1_training_input.pkl"
    with registered(SKYRL_MODULE, TrainingInputBatch=TrainingInputBatch,
                    _rebuild_tensor_batch=rebuild_tensor_batch), file.open("wb") as fh:  # fmt: skip
        pickle.dump(batch, fh)
    return ["skyrl", str(root)], "no 'action_log_probs' (the trainer skipped its policy forward"


@pytest.mark.parametrize("case", [_verl_unequal, _skyrl_no_forward], ids=lambda c: c.__name__)
def test_a_dump_without_both_sides_aligned_is_one_line(
    case: Callable[[Path], tuple[list[str], str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    args, message = case(tmp_path / "src")
    _assert_refused([*args, "--trust-pickle"], message, tmp_path, monkeypatch, capsys)
