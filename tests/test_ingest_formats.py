"""``probe ingest`` on each format's exact layout: the store holds every trained token with the
framework's two log-probs, one ``step`` per training step, and per-step metrics that match a
hand computation; ``--steps`` selects. The verl and TRL hooks: ``test_ingest_hooks.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mismatch_probe.ingest import IngestConfig, parse_steps, run_ingest
from mismatch_probe.metrics import compute_metrics
from mismatch_probe.store import TOKENS_FILE
from tests.ingest_fixtures import (
    expected_tokens,
    synthetic_steps,
    write_miles,
    write_nemo_rl,
    write_prime_rl,
    write_slime,
)

STEPS = [3, 4, 7]
WRITERS = {"prime-rl": write_prime_rl, "nemo-rl": write_nemo_rl, "slime": write_slime}


def _ingest(fmt: str, src: Path, out: Path, **kw) -> dict:
    result = run_ingest(IngestConfig(fmt, src, out, **kw))
    assert result.out == out and out.is_dir()
    return result.run


def _k3(rollout: np.ndarray, train: np.ndarray) -> float:
    r = train.astype(np.float64) - rollout.astype(np.float64)
    return float(np.mean(np.expm1(r) - r))


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_each_format_stores_every_trained_token_per_step(fmt: str, tmp_path: Path) -> None:
    data = synthetic_steps(STEPS, seqs=4, seed=1)
    run = _ingest(fmt, WRITERS[fmt](tmp_path / "src", data), tmp_path / "run")
    table = pq.read_table(tmp_path / "run" / TOKENS_FILE)
    rollout, train = expected_tokens(data)
    assert table.column("rollout_logprob").to_numpy().tolist() == rollout.tolist()
    assert table.column("train_logprob").to_numpy().tolist() == train.tolist()
    lengths = [len(s.response) for seqs in data.values() for s in seqs]
    assert table.column("step").to_pylist() == [
        step for step, seqs in data.items() for s in seqs for _ in s.response
    ]
    assert table.column("position").to_pylist() == [p for n in lengths for p in range(n)]
    assert table.column("token_id").to_pylist() == [
        t for seqs in data.values() for s in seqs for t in s.response
    ]
    assert sorted(set(table.column("seq_id").to_pylist())) == list(range(len(lengths)))
    assert run["source"]["format"] == fmt and run["kind"] == "ingest"
    assert run["counts"] == {
        "steps": 3, "first_step": 3, "last_step": 7, "sequences": 12,
        "tokens": len(rollout), "null_logprobs": 0, "empty_sequences_skipped": 0,
        "steps_without_trained_tokens": [],
    }  # fmt: skip
    assert run["available"]["train_logprobs"] not in (None, "")


def test_per_step_metrics_match_a_hand_computation(tmp_path: Path) -> None:
    data = synthetic_steps(STEPS, seqs=5, seed=2, growth=0.2)
    _ingest("prime-rl", write_prime_rl(tmp_path / "src", data), tmp_path / "run")
    steps = json.loads((tmp_path / "run" / "steps.json").read_text())["steps"]
    assert list(steps) == ["3", "4", "7"]
    for step in STEPS:
        rollout, train = expected_tokens({step: data[step]})
        assert steps[str(step)]["k3_kl"] == pytest.approx(_k3(rollout, train), rel=1e-9, abs=1e-15)
        assert steps[str(step)]["num_tokens"] == len(rollout)
    overall = json.loads((tmp_path / "run" / "metrics.json").read_text())
    rollout, train = expected_tokens(data)
    assert overall["k3_kl"] == pytest.approx(_k3(rollout, train), rel=1e-9)
    # the mismatch grows with the step (growth 0.2 per step)
    assert steps["3"]["k3_kl"] < steps["4"]["k3_kl"] < steps["7"]["k3_kl"]


def test_metrics_of_one_step_read_only_its_rows(tmp_path: Path) -> None:
    data = synthetic_steps(STEPS, seqs=3, seed=3)
    _ingest("slime", write_slime(tmp_path / "src", data), tmp_path / "run")
    one = compute_metrics(tmp_path / "run", step=4).flat()
    assert one["num_sequences"] == 3
    rollout, train = expected_tokens({4: data[4]})
    assert one["k3_kl"] == pytest.approx(_k3(rollout, train), rel=1e-9, abs=1e-15)


def test_steps_option_selects_inclusive_range(tmp_path: Path) -> None:
    data = synthetic_steps([1, 2, 3, 4, 5], seqs=2, seed=4)
    run = _ingest("nemo-rl", write_nemo_rl(tmp_path / "src", data), tmp_path / "run",
                  steps=parse_steps("2:4"))  # fmt: skip
    assert (run["counts"]["first_step"], run["counts"]["last_step"]) == (2, 4)
    steps = pq.read_table(tmp_path / "run" / TOKENS_FILE).column("step").to_pylist()
    assert sorted(set(steps)) == [2, 3, 4]


def test_parse_steps_forms() -> None:
    assert (parse_steps("7").first, parse_steps("7").last) == (7, 7)
    assert (parse_steps("10:").first, parse_steps("10:").last) == (10, None)
    assert (parse_steps(":3").first, parse_steps(":3").last) == (None, 3)
    assert 5 in parse_steps(None) and 5 not in parse_steps("6:")


def test_prime_rl_reads_the_off_policy_bound_from_the_run_config(tmp_path: Path) -> None:
    data = synthetic_steps([1, 2], seqs=2)
    src = write_prime_rl(tmp_path / "src", data)
    (src / "configs").mkdir()
    (src / "configs" / "orchestrator.json").write_text(json.dumps({"max_off_policy_steps": 2}))
    run = _ingest("prime-rl", src, tmp_path / "run")
    assert run["off_policy"]["max_off_policy_steps"] == 2 and run["off_policy"]["staleness"]
    report = (tmp_path / "run" / "report.md").read_text()
    assert "up to 2 policy versions older" in report and "mismatch plus policy staleness" in report


def test_prime_rl_skips_a_step_still_being_written(tmp_path: Path) -> None:
    src = write_prime_rl(tmp_path / "src", synthetic_steps([1, 2], seqs=2))
    write_prime_rl(src, synthetic_steps([3], seqs=2), stable=False)  # the live tail
    run = _ingest("prime-rl", src, tmp_path / "run")
    assert run["counts"]["last_step"] == 2


def test_null_log_probs_are_stored_as_nulls_and_not_counted(tmp_path: Path) -> None:
    data = synthetic_steps([1], seqs=2)
    src = write_prime_rl(tmp_path / "src", data)
    path = src / "token_exports" / "step_1" / "rank_0.jsonl"
    first = json.loads(path.read_text().splitlines()[0])
    first["trainer_logprobs"][-1] = None  # prime-rl writes non-finite floats as null
    rest = path.read_text().splitlines()[1:]
    path.write_text("\n".join([json.dumps(first), *rest]) + "\n")
    run = _ingest("prime-rl", src, tmp_path / "run")
    assert run["counts"]["null_logprobs"] == 1
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["num_tokens"] == run["counts"]["tokens"] - 1


def test_miles_rescoring_of_the_models_own_log_probs_is_the_identity(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Rollout log-probs computed by a plain transformers forward of the same model in float32:
    the ingest's rescoring must give the same numbers (k3_kl about 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    data = synthetic_steps([1, 2], seqs=3, seed=6)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for seqs in data.values():
        for s in seqs:
            ids = torch.tensor([s.prompt + s.response])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            p = len(s.prompt)
            s.rollout = [float(logp[p - 1 + i, t]) for i, t in enumerate(s.response)]
    src = write_miles(tmp_path / "src", data)
    run = _ingest("miles-parquet", src, tmp_path / "run", model=tiny_model)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["num_tokens"] == run["counts"]["tokens"] > 0
    # float32 forwards of one model, batched vs alone: a few float32 ulps of log-probs ~1e-6
    assert abs(metrics["kl"]) < 1e-5 and metrics["k3_kl"] < 1e-9
    assert run["available"]["token_text"] is True
    assert "token_text" in pq.read_schema(tmp_path / "run" / TOKENS_FILE).names
