"""Scan-side faults of issue 22: a sharded scan that replaced a finished run without --force
(fault 3), --train-device-map cuda without CUDA found only after the rollout (fault 8), a
--stale-model of another vocabulary or architecture (fault 9), and an interrupted sharded scan
that said "nothing written" while its finished shards were kept (fault 15). Every case fails
before any engine starts."""

from __future__ import annotations

import io
import json
import shutil
import signal
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from mismatch_probe import interrupt, store
from mismatch_probe.pipeline import sharding
from mismatch_probe.store import dataset
from tests.cli_runner import run_probe_err as run_main


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# --- fault 3 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("held", [store.TOKENS_FILE, store.RUN_FILE, store.TOKENS_DIR])
def test_a_sharded_scan_keeps_an_existing_run_without_force(
    held: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    target = out / held
    if held == store.TOKENS_DIR:
        (target / "shard=0").mkdir(parents=True)
        (target / "shard=0" / "part-0.parquet").write_bytes(b"data")
    else:
        target.write_text("{}")
    args = ["scan", "--shards", "2", "--out", str(out), "--model", str(tmp_path / "absent")]
    code, err = run_main(args, monkeypatch, capsys)
    assert code == 2
    assert f"--out {out} holds a run already ({held})" in one_line_error(err)
    assert target.exists() and sorted(p.name for p in out.iterdir()) == [held]  # nothing lost


def test_force_and_resume_pass_the_out_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """With --force (or --resume) the check lets the scan go on: here to the missing model."""
    out = tmp_path / "run"
    out.mkdir()
    (out / store.TOKENS_FILE).write_text("{}")
    base = ["scan", "--shards", "2", "--out", str(out), "--model", str(tmp_path / "absent")]
    for extra in ("--force", "--resume"):
        code, err = run_main([*base, extra], monkeypatch, capsys)
        assert code == 2 and "holds a run already" not in err
    assert (out / store.TOKENS_FILE).exists()  # a failure later in prepare still loses nothing


# --- fault 8 -----------------------------------------------------------------------------------


def test_train_device_map_cuda_without_cuda_fails_up_front(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the device is available")
    trace = tmp_path / "stages.txt"
    monkeypatch.setenv(interrupt.TRACE_ENV, str(trace))
    out = tmp_path / "out"
    args = ["scan", "--model", str(tiny_model), "--train-device-map", "cuda", "--out", str(out)]
    code, err = run_main(args, monkeypatch, capsys)
    assert code == 2
    assert one_line_error(err) == (
        "error: --train-device-map cuda: no CUDA device is visible on this machine; use cpu, "
        "auto, or leave the option out"
    )
    stages = trace.read_text().split() if trace.exists() else []
    assert "engine" not in " ".join(stages) and not out.exists()


def test_a_ray_worker_checks_its_own_devices(tmp_path: Path) -> None:
    """A shard on a worker without CUDA fails at its start, before its engine and parts."""
    import torch

    from mismatch_probe.errors import ProbeError
    from mismatch_probe.pipeline.config import ScanConfig

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = ScanConfig(train_device_map="cuda", shards=2, out=tmp_path)
    with pytest.raises(ProbeError, match="--train-device-map cuda: no CUDA device"):
        sharding.run_shard(cfg, 0, (0, 1), str(tmp_path))
    assert not (tmp_path / store.TOKENS_DIR).exists()


# --- fault 9 -----------------------------------------------------------------------------------


def stale_copy(tiny_model: Path, tmp_path: Path, **changes: Any) -> Path:
    """The tiny model's files with ``changes`` made to its config.json."""
    stale = tmp_path / "stale"
    shutil.copytree(tiny_model, stale)
    config = json.loads((stale / "config.json").read_text())
    (stale / "config.json").write_text(json.dumps({**config, **changes}))
    return stale


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"vocab_size": 100}, "vocabulary size 100, the scanned model has "),
        (
            {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
            "architecture qwen2 (Qwen2ForCausalLM), the scanned model has llama (LlamaForCausalLM)",
        ),
    ],
)
def test_stale_model_must_match_the_scanned_model(
    changes: dict[str, Any],
    expected: str,
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    stale = stale_copy(tiny_model, tmp_path, **changes)
    out = tmp_path / "out"
    args = ["scan", "--model", str(tiny_model), "--attribute", "--stale-model", str(stale)]
    code, err = run_main([*args, "--out", str(out)], monkeypatch, capsys)
    assert code == 2
    line = one_line_error(err)
    assert f"error: --stale-model {stale}: {expected}" in line
    assert line.endswith("a stale checkpoint must be the same model at an earlier training step")
    assert not out.exists()


def test_a_stale_checkpoint_of_the_same_model_passes(tiny_model: Path, tmp_path: Path) -> None:
    from mismatch_probe.pipeline.attribution import check_stale

    check_stale(stale_copy(tiny_model, tmp_path), tiny_model)  # no error
    check_stale(None, tiny_model)


# --- fault 15 ----------------------------------------------------------------------------------


def test_an_interrupted_sharded_scan_says_what_it_kept(tmp_path: Path) -> None:
    tokens = tmp_path / store.TOKENS_DIR
    try:
        interrupt.resumable(partial(sharding.kept_shards, tmp_path, 4))
        message = interrupt.Interrupted(signal.SIGINT, "shards").message()
        assert message == (
            f"interrupted during shards; no shard finished yet (the plan is in "
            f"{tmp_path / sharding.PLAN_FILE}); rerun the same command with --resume to continue"
        )
        for k in (0, 2):
            dataset.shard_dir(tokens, k).mkdir(parents=True)
            store.mark_done(tokens, k, {"shard": k})
        dataset.shard_dir(tokens, 1).mkdir(parents=True)  # started, not finished
        message = interrupt.Interrupted(signal.SIGTERM, "shards").message()
        assert message == (
            f"interrupted during shards; finished shard(s) 0, 2 of 4 kept in {tmp_path}; rerun "
            "the same command with --resume to continue with the others"
        )
    finally:
        interrupt.resumable(None)
    assert "nothing written" in interrupt.Interrupted(signal.SIGINT, "startup").message()


def test_run_sharded_registers_what_an_interrupt_keeps(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver of a sharded scan, its shards replaced (unit test of the driver): shard 0
    finishes, the signal lands in shard 1; the message names shard 0 and --resume."""
    from mismatch_probe.pipeline.config import ScanConfig
    from mismatch_probe.sampling import SamplingSpec

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p {i}"}) + "\n" for i in range(4)))
    out = tmp_path / "run"

    def shard(cfg: Any, k: int, bounds: Any, where: str) -> dict[str, Any]:
        if k == 1:
            raise interrupt.Interrupted(signal.SIGINT, "generation")
        tokens = Path(where) / store.TOKENS_DIR
        dataset.shard_dir(tokens, k).mkdir(parents=True)
        store.mark_done(tokens, k, {"shard": k})
        return {}

    monkeypatch.setattr(sharding, "run_shard", shard)
    cfg = ScanConfig(
        model=tiny_model, prompts=prompts, shards=2, out=out, sampling=SamplingSpec(max_tokens=4)
    )
    try:
        with pytest.raises(interrupt.Interrupted) as info:
            sharding.run_sharded(cfg, Console(file=io.StringIO()))
        assert info.value.message() == (
            f"interrupted during generation; finished shard(s) 0 of 2 kept in {out}; rerun the "
            "same command with --resume to continue with the others"
        )
    finally:
        interrupt.resumable(None)
