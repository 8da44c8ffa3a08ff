"""``--audit-every`` for runs that skip the training-side recompute: the hook keeps the whole
rollouts of every N-th policy version and no training log-prob; ``probe watch --model
'ckpts/global_step_{step}/actor'`` rescores each with the checkpoint of the version that
sampled it (rollouts made by two different tiny models: the right checkpoint gives k3 = 0 to
float32 rounding, the other would not), records the off-policy lag, and says when a version has
no checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe.ingest import ProbeWriter
from tests.cli_runner import run_probe
from tests.ingest_fixtures import synthetic_steps


def _logps(model_dir: Path, prompt: list[int], response: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(response)]


@pytest.fixture(scope="module")
def checkpoints(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ckpts/global_step_0/actor`` (the tiny model) and ``global_step_2`` (another seed)."""
    from mismatch_probe.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("ckpts")
    shutil.copytree(tiny_model, root / "global_step_0" / "actor")
    build_tiny_model(root / "global_step_2" / "actor", seed=1)
    return root


def _pad(row: list, value: Any, width: int) -> list:
    return row + [value] * (width - len(row))


def _write_run(src: Path, ckpts: Path) -> None:
    """Steps 1..5 sampled by versions 0..4 (one behind the trainer: lag 1); the hook keeps
    the even versions (steps 1, 3, 5); version 4 has no checkpoint."""
    writer = ProbeWriter(src, audit_every=2)
    data = synthetic_steps([1, 2, 3, 4, 5], seqs=2, seed=3)
    for step, seqs in data.items():
        version = step - 1
        sampler = ckpts / f"global_step_{version}" / "actor"
        rollout = [
            _logps(sampler, s.prompt, s.response) if sampler.exists() else s.rollout for s in seqs
        ]
        width = max(len(s.response) for s in seqs)
        prompts = [s.prompt + [0] * (4 - len(s.prompt)) for s in seqs]
        writer.write_step(step, [_pad(s.response, 0, width) for s in seqs],
                          [_pad([1] * len(s.response), 0, width) for s in seqs],
                          [_pad(r, 0.0, width) for r in rollout], None,
                          prompt_ids=prompts,
                          prompt_mask=[[1] * len(s.prompt) + [0] * (4 - len(s.prompt))
                                       for s in seqs],
                          policy_version=version, trainer_version=step, complete=True)  # fmt: skip


def test_audited_steps_are_rescored_with_their_checkpoint(
    checkpoints: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    src, run = tmp_path / "logs", tmp_path / "run"
    _write_run(src, checkpoints)
    assert sorted(p.name for p in src.iterdir()) == ["step_1", "step_3", "step_5"]
    pattern = str(checkpoints / "global_step_{step}" / "actor")
    code, out, err = run_probe(["watch", "probe", str(src), "--out", str(run), "--model",
                                pattern, "--until", "5", "--interval", "0.1"],
                               monkeypatch, capsys)  # fmt: skip
    assert code == 0, err
    lines = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 3]
    for line in lines:
        # float32 forwards of one model, batched vs alone: a few ulps
        assert line["metrics"]["k3_kl"] < 1e-9
        assert abs(line["metrics"]["kl"]) < 1e-5
        assert line["lag"] == {"min": 1.0, "max": 1.0, "mean": 1.0}
    # version 4 has no checkpoint: step 5 is not measured, and an alert says why
    expected = str(checkpoints / "global_step_4" / "actor")
    assert f"ALERT step 5: unreadable: no checkpoint for policy version 4: {expected}" in out
    meta = json.loads((run / "run.json").read_text())
    assert [u["step"] for u in meta["watch"]["unreadable"]] == [5]
    assert "lag 1" in out  # the plain line of each step shows it


def test_without_model_an_audit_only_step_says_what_is_missing(
    checkpoints: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    src, run = tmp_path / "logs", tmp_path / "run"
    _write_run(src, checkpoints)
    code, _, err = run_probe(["watch", "probe", str(src), "--out", str(run), "--until", "1",
                                "--interval", "0.1"], monkeypatch, capsys)  # fmt: skip
    assert code == 0, err
    line = json.loads((run / "steps.jsonl").read_text().splitlines()[0])
    assert line["metrics"] == {}
    assert line["note"] == "no valid token (every log-prob null or non-finite)"
    assert line["tokens"] > 0 and not (run / "report.md").exists()
