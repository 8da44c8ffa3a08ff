"""Format-specific mask rules (metrics spec section 8, ``mask_rule``): NeMo-RL's
``sample_loss_mask`` is applied as NeMo applies it, so a step's ``k3_kl`` is NeMo's own
``gen_kl_error``, checked by hand on a dump small enough to add up; ``run.json`` records each
rule as applied or not (``mask_rules``), the record the integrity checks read."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.ingest import IngestConfig, run_ingest
from mismatch_probe.ingest.nemo_rl import _APPLIED, _MISSING, _WEIGHTED
from tests.ingest_fixtures import synthetic_steps, write_prime_rl

PAD_TO = 8
# (prompt ids, response ids, generation_logprobs, prev_logprobs, sample_loss_mask) of step 1:
# dyadic log-probs, exact in float32, so the sums below hold to rounding of exp alone.
SAMPLES = [
    ([11, 12], [21, 22, 23], [-1.0, -0.5, -2.0], [-0.5, -0.5, -2.5], 1.0),  # r = .5, 0, -.5
    ([13, 14], [24, 25, 26], [-1.0, -1.0, -1.0], [-3.0, -3.0, -3.0], 0.0),  # truncated: out
    ([15, 16], [27, 28], [-0.25, -4.0], [-0.25, -3.0], 1.0),  # r = 0, 1
]
# k3 = exp(r) - 1 - r with r = prev - gen, summed over the 5 tokens of the samples NeMo keeps:
# (e^.5 - 1.5) + 0 + (e^-.5 - .5) + 0 + (e - 2) = e^.5 + e^-.5 + e - 4
K3_SUM_KEPT = 0.9735337588718  # 1.6487212707001 + 0.6065306597126 + 2.7182818284590 - 4
# the truncated sample's 3 tokens (r = -2) add 3 * (e^-2 + 1)
K3_SUM_TRUNCATED = 3.4060058497098  # 3 * (0.1353352832366 + 1)
# NeMo's masked_mean (nemo_rl/algorithms/utils.py) and verl's divide by (count + 1e-8)
K3_APPLIED = K3_SUM_KEPT / (5 + 1e-8)  # 0.19470675138...
K3_ALL = (K3_SUM_KEPT + K3_SUM_TRUNCATED) / (8 + 1e-8)  # 0.54744245...


def _line(i: int, sample: tuple[Any, ...], with_mask: bool) -> dict[str, Any]:
    """One line of ``train_data_step<N>.jsonl`` (``write_nemo_rl``'s layout: one-element lists,
    arrays padded to the batch length, index i of a log-prob array belongs to token i)."""
    prompt, response, gen, prev, weight = sample
    p, n = len(prompt), len(response)
    pad = PAD_TO - p - n
    line = {
        "content": [[{"role": "user", "content": "q"}]],
        "rewards": [1.0],
        "input_lengths": [p + n],
        "token_ids": [prompt + response + [0] * pad],
        "token_loss_mask": [[0] * p + [1] * n + [0] * pad],
        "advantages": [[0.0] * PAD_TO],
        "generation_logprobs": [[0.0] * p + gen + [0.0] * pad],
        "prev_logprobs": [[0.0] * p + prev + [0.0] * pad],
        "idx": i,
    }
    if with_mask:
        line["sample_loss_mask"] = [weight]
    return line


def _write(root: Path, steps: dict[int, list[dict[str, Any]]]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for step, lines in steps.items():
        text = "".join(json.dumps(x) + "\n" for x in lines)
        (root / f"train_data_step{step}.jsonl").write_text(text)
    return root


def nemo_gen_kl_error(lines: list[dict[str, Any]]) -> float:
    """NeMo-RL's ``gen_kl_error`` of one step, as ``ClippedPGLossFn`` computes it: k3 of
    ``prev - gen`` over ``token_mask[:, 1:] * sample_mask[:, None]``, a masked mean over the
    global batch."""
    gen = np.array([x["generation_logprobs"][0] for x in lines])[:, 1:]
    prev = np.array([x["prev_logprobs"][0] for x in lines])[:, 1:]
    token_mask = np.array([x["token_loss_mask"][0] for x in lines], dtype=np.float64)[:, 1:]
    sample_mask = np.array([x["sample_loss_mask"][0] for x in lines])
    mask = token_mask * sample_mask[:, None]
    logr = prev - gen
    kl = np.exp(logr) - 1 - logr
    return float((kl * mask).sum() / (mask.sum() + 1e-8))


def _ingest(src: Path, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    run = run_ingest(IngestConfig("nemo-rl", src, out)).run
    return run, json.loads((out / "steps.json").read_text())["steps"]


def test_hand_computed_constants() -> None:
    e = math.e
    assert pytest.approx(e**0.5 + e**-0.5 + e - 4, rel=1e-12) == K3_SUM_KEPT
    assert pytest.approx(3 * (e**-2 + 1), rel=1e-12) == K3_SUM_TRUNCATED


def test_sample_loss_mask_makes_k3_kl_equal_nemos_gen_kl_error(tmp_path: Path) -> None:
    lines = [_line(i, s, with_mask=True) for i, s in enumerate(SAMPLES)]
    run, steps = _ingest(_write(tmp_path / "src", {1: lines}), tmp_path / "run")
    assert steps["1"]["k3_kl"] == pytest.approx(K3_APPLIED, rel=1e-12)
    assert steps["1"]["k3_kl"] == pytest.approx(nemo_gen_kl_error(lines), rel=1e-14)
    assert K3_ALL > 2 * K3_APPLIED  # the rule changes the number
    assert steps["1"]["num_tokens"] == 5
    assert run["counts"]["sequences"] == 2 and run["counts"]["empty_sequences_skipped"] == 1
    assert run["mask_rules"] == [
        {"rule": "sample_loss_mask", "applied": True, "detail": _APPLIED,
         "sequences": 1, "tokens": 3},
    ]  # fmt: skip
    on_disk = json.loads((tmp_path / "run" / "run.json").read_text())
    assert on_disk["mask_rules"] == run["mask_rules"]


def test_without_sample_loss_mask_the_rule_is_recorded_as_not_applied(tmp_path: Path) -> None:
    lines = [_line(i, s, with_mask=False) for i, s in enumerate(SAMPLES)]
    run, steps = _ingest(_write(tmp_path / "src", {1: lines}), tmp_path / "run")
    assert steps["1"]["k3_kl"] == pytest.approx(K3_ALL, rel=1e-12)  # the truncated one counted
    assert run["mask_rules"] == [
        {"rule": "sample_loss_mask", "applied": False, "detail": _MISSING,
         "sequences": 3, "tokens": 8},
    ]  # fmt: skip


def test_a_weight_other_than_0_and_1_is_recorded_as_not_applied(tmp_path: Path) -> None:
    lines = [_line(i, s, with_mask=True) for i, s in enumerate(SAMPLES)]
    lines[1]["sample_loss_mask"] = [0.5]
    run, steps = _ingest(_write(tmp_path / "src", {1: lines}), tmp_path / "run")
    assert steps["1"]["num_tokens"] == 8  # the weighted sample is counted with weight 1
    assert run["mask_rules"] == [
        {"rule": "sample_loss_mask", "applied": True, "detail": _APPLIED,
         "sequences": 0, "tokens": 0},
        {"rule": "sample_loss_mask", "applied": False, "detail": _WEIGHTED,
         "sequences": 1, "tokens": 3},
    ]  # fmt: skip


def test_a_step_whose_samples_are_all_masked_out_adds_no_step(tmp_path: Path) -> None:
    """Not mistaken for a skipped trainer forward (all-zero prev_logprobs): nothing to refuse."""
    kept = [_line(i, s, with_mask=True) for i, s in enumerate(SAMPLES)]
    dropped = [_line(i, s, with_mask=True) for i, s in enumerate(SAMPLES)]
    for line in dropped:
        line["sample_loss_mask"] = [0.0]
    run, steps = _ingest(_write(tmp_path / "src", {1: kept, 2: dropped}), tmp_path / "run")
    assert list(steps) == ["1"] and run["counts"]["empty_sequences_skipped"] == 4
    assert run["mask_rules"][0]["sequences"] == 4 and run["mask_rules"][0]["tokens"] == 11


def test_a_format_without_mask_rules_records_an_empty_list(tmp_path: Path) -> None:
    src = write_prime_rl(tmp_path / "src", synthetic_steps([1], seqs=2))
    run = run_ingest(IngestConfig("prime-rl", src, tmp_path / "run")).run
    assert run["mask_rules"] == []
