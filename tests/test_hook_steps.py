"""The hook writer's steps: a manifest per step and rank (what ``probe watch`` waits for), a
restarted writer's step replacing the dead run's attempt (``probe ingest probe`` counts it once
and the report says so), and audited steps keeping their whole rollouts for rescoring."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest import IngestConfig, ProbeWriter, run_ingest
from mismatch_probe.ingest.hook import AUDIT_DIR, manifest_name

TOKENS = [[5, 6, 7], [8, 9, 10]]
MASK = [[1, 1, 0], [1, 1, 1]]


def _logps(shift: float) -> tuple[list[list[float]], list[list[float]]]:
    rollout = [[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]]
    train = [[x - shift for x in row] for row in rollout]
    return rollout, train


def _write(writer: ProbeWriter, step: int, shift: float) -> None:
    rollout, train = _logps(shift)
    writer.write_step(step, TOKENS, MASK, rollout, train, group=["a", "a"])


def test_a_step_gets_its_manifest_once_the_writer_moves_on(tmp_path: Path) -> None:
    writer = ProbeWriter(tmp_path, rank=1, world_size=2)
    _write(writer, 3, 0.1)
    _write(writer, 3, 0.1)  # a second batch of the same step
    manifest = tmp_path / "step_3" / manifest_name(1)
    assert not manifest.exists()  # step 3 may still get batches
    _write(writer, 4, 0.1)
    data = json.loads(manifest.read_text())
    assert (data["step"], data["rank"], data["world_size"]) == (3, 1, 2)
    assert data["files"] == ["rank_1_0.parquet", "rank_1_1.parquet"]
    assert (data["rows"], data["tokens"]) == (4, 10)
    assert data["attempt"] == writer.attempt
    assert not (tmp_path / "step_4" / manifest_name(1)).exists()
    writer.close()
    assert json.loads((tmp_path / "step_4" / manifest_name(1)).read_text())["files"] == [
        "rank_1_2.parquet"
    ]


def test_a_complete_batch_writes_its_manifest_at_once(tmp_path: Path) -> None:
    writer = ProbeWriter(tmp_path)
    rollout, train = _logps(0.1)
    writer.write_step(1, TOKENS, MASK, rollout, train, complete=True)
    assert (tmp_path / "step_1" / manifest_name(0)).is_file()


def test_a_restarted_writer_replaces_the_steps_it_writes_again(tmp_path: Path) -> None:
    """The dead run wrote steps 1 and 2; the restarted trainer writes 2 and 3 beside its files:
    step 2 is the later attempt alone (4 sequences, not 6), and the report says so."""
    src = tmp_path / "logs"
    dead = ProbeWriter(src)
    _write(dead, 1, 0.01)
    _write(dead, 2, 0.50)  # the dead run's step 2: a large mismatch
    restarted = ProbeWriter(src)
    _write(restarted, 2, 0.02)
    _write(restarted, 3, 0.03)
    restarted.close()
    assert len(list((src / "step_2").glob("*.parquet"))) == 2  # both attempts on disk
    result = run_ingest(IngestConfig("probe", src, tmp_path / "run"))
    assert result.run["counts"]["sequences"] == 6  # 2 per step
    assert result.run["rewritten_steps"] == [{"step": 2, "ranks": ["0"], "files_replaced": 1}]
    # step 2's numbers are the later attempt's: r = -0.02 on every token
    assert result.steps[2]["kl"] == pytest.approx(0.02, rel=1e-5)
    report = (tmp_path / "run" / "report.md").read_text()
    assert "Step 2 was written again (a restarted trainer)" in report


def test_files_of_one_attempt_are_all_kept(tmp_path: Path) -> None:
    writer = ProbeWriter(tmp_path / "logs")
    for _ in range(2):
        _write(writer, 1, 0.01)
    result = run_ingest(IngestConfig("probe", tmp_path / "logs", tmp_path / "run"))
    assert result.run["counts"]["sequences"] == 4
    assert "rewritten_steps" not in result.run


def test_audited_steps_keep_their_rollouts(tmp_path: Path) -> None:
    """``audit_every=2``: the steps whose policy version is even keep prompt and response;
    without training log-probs the other steps write nothing."""
    writer = ProbeWriter(tmp_path, audit_every=2)
    rollout, _ = _logps(0.0)
    prompts, prompt_mask = [[0, 3, 4], [1, 2, 4]], [[0, 1, 1], [1, 1, 1]]
    for step in (1, 2, 3):
        writer.write_step(step, TOKENS, MASK, rollout, None, prompt_ids=prompts,
                          prompt_mask=prompt_mask, policy_version=step - 1)  # fmt: skip
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_3"]
    audit = pq.read_table(tmp_path / "step_1" / AUDIT_DIR / "rank_0_1.parquet").to_pylist()
    assert [a["prompt_ids"] for a in audit] == [[3, 4], [1, 2, 4]]
    assert [a["response_ids"] for a in audit] == [[5, 6], [8, 9, 10]]
    assert [a["response_mask"] for a in audit] == [[True, True], [True, True, True]]
    assert [a["policy_version"] for a in audit] == [0, 0]
    tokens = pq.read_table(tmp_path / "step_1" / "rank_0_0.parquet")
    assert tokens.column("train_logprob").null_count == 5  # no training side: nulls
    assert np.allclose(audit[1]["rollout_logprobs"], rollout[1])


def test_an_audited_step_needs_its_prompts(tmp_path: Path) -> None:
    writer = ProbeWriter(tmp_path, audit_every=1)
    rollout, train = _logps(0.0)
    with pytest.raises(ProbeError, match="no prompt_ids were given"):
        writer.write_step(1, TOKENS, MASK, rollout, train)
