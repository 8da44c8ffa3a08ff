"""Multi-turn pieces without an engine: turn plans from chat templates, re-render drift, turns of
ingested logs and their per-turn metrics against hand computations."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe import store
from mismatch_probe.engine.turns import _Trajectory
from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.records import IngestConfig, turns_from_positions
from mismatch_probe.ingest.run import run_ingest
from mismatch_probe.metrics import compute_metrics
from mismatch_probe.metrics.turns import rerender_scalars
from mismatch_probe.models.tiny import CHAT_TEMPLATE, build_tokenizer
from mismatch_probe.pipeline import trajectory
from mismatch_probe.prompts import Prompt, encode_prompts

from .ingest_fixtures import DataProto, Seq, verl_batch

MESSAGES = (
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": None},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": None},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": None},
)
# A template that keeps only what follows ``</think>`` in every assistant message but the last,
# as Qwen3's drops the reasoning of earlier turns.
DROPS_EARLIER_REASONING = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "<|assistant|>{{ m['content'].split('</think>')[-1] }}<|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TURN_TEXTS = ("<think>two and two</think>call calc", "The answer is four.", "You are welcome.")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def encoded(tokenizer: Any, template: str = CHAT_TEMPLATE, messages: Any = MESSAGES) -> Any:
    tokenizer.chat_template = template
    return encode_prompts([Prompt(0, messages=messages)], tokenizer, True, 512, 16)[0]


def canonical_rollout(tokenizer: Any, prompt: Any, cut: int | None = None) -> Any:
    """The trajectory ``engine.turns`` builds when the engine samples the canonical ids of
    ``TURN_TEXTS`` (each ended by EOS, except turn ``cut``: stopped at max tokens)."""
    t = _Trajectory(prompt, 0)
    for k, text in enumerate(TURN_TEXTS):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids += [] if k == cut else [tokenizer.eos_token_id]
        out = SimpleNamespace(
            token_ids=ids,
            logprobs=[{i: SimpleNamespace(logprob=-1.0)} for i in ids],
            finish_reason="length" if k == cut else "stop",
            text=text,
        )
        t.add_turn(out, 0)
    return t.rollout(0)


def test_turn_plan_renders_given_messages_after_an_assistant_turn(tokenizer: Any) -> None:
    p = encoded(tokenizer)
    assert p.text == "<|user|>What is two plus two?<|end|><|assistant|>"
    plan = p.turns
    assert plan.turns == 3 and plan.end_id == tokenizer.eos_token_id
    decode = tokenizer.decode
    assert [decode(list(x)) for x in plan.after_end] == [
        "<|tool|>4<|end|><|assistant|>",
        "<|user|>thanks<|end|><|assistant|>",
    ]
    assert [decode(list(x)) for x in plan.after_cut] == [
        "<|end|><|tool|>4<|end|><|assistant|>",
        "<|end|><|user|>thanks<|end|><|assistant|>",
    ]
    assert plan.context_after(0, [5, plan.end_id]) == plan.after_end[0]
    assert plan.context_after(0, [5, 6]) == plan.after_cut[0]
    assert plan.context_after(2, [5]) == ()  # nothing after the last turn


def test_trajectory_is_prompt_generated_and_given_ids_in_order(tokenizer: Any) -> None:
    p = encoded(tokenizer)
    r = canonical_rollout(tokenizer, p, cut=1)
    ids = [*r.prompt_ids, *r.turns.continuation]
    text = tokenizer.decode(ids)
    assert text == (
        "<|user|>What is two plus two?<|end|><|assistant|><think>two and two</think>call calc"
        "<|end|><|tool|>4<|end|><|assistant|>The answer is four.<|end|><|user|>thanks<|end|>"
        "<|assistant|>You are welcome.<|end|>"
    )
    assert r.turns.finish_reasons == ("stop", "length", "stop")
    # the closing <|end|> of the cut turn is context, never scored
    assert [r.turns.continuation[i] for i in r.turns.positions] == r.response_ids
    request = trajectory.score_request(r)
    assert [request.response_ids[i] for i in request.scored_indices()] == r.response_ids


def test_round_tripping_template_has_no_drift(tokenizer: Any) -> None:
    r = canonical_rollout(tokenizer, encoded(tokenizer))
    drift = trajectory.rerender(r, r.turns.messages, tokenizer)
    assert drift == trajectory.Rerender(False, 0, None)


def test_template_dropping_earlier_reasoning_drifts(tokenizer: Any) -> None:
    r = canonical_rollout(tokenizer, encoded(tokenizer, DROPS_EARLIER_REASONING))
    drift = trajectory.rerender(r, r.turns.messages, tokenizer)
    think = len(tokenizer("<think>two and two</think>", add_special_tokens=False)["input_ids"])
    assert drift.differs
    assert drift.mismatched >= think  # the dropped reasoning has no counterpart
    assert drift.mismatched < len(r.response_ids)
    assert drift.context is not None and drift.context.startswith("turn 0, trajectory token")
    assert "»<«" in drift.context  # the engine's trajectory goes on with "<think>"


def test_template_that_is_not_append_only_is_refused(tokenizer: Any) -> None:
    reorders = "{% for m in messages|reverse %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    with pytest.raises(ProbeError, match="append-only after generated turn 0"):
        encoded(tokenizer, reorders)


def test_multi_turn_needs_the_chat_template(tokenizer: Any) -> None:
    tokenizer.chat_template = CHAT_TEMPLATE
    with pytest.raises(ProbeError, match="multi-turn prompts need a chat template"):
        encode_prompts([Prompt(0, messages=MESSAGES)], tokenizer, False, 512, 16)


def test_turns_are_runs_of_consecutive_positions() -> None:
    got = turns_from_positions(np.array([0, 1, 2, 5, 6, 8, 9]))
    assert got.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert turns_from_positions(np.arange(4)).tolist() == [0, 0, 0, 0]
    assert turns_from_positions(np.zeros(0, np.int64)).tolist() == []


# verl dump: 1 = trained token, 0 = tool output between turns.
MASKS = ([1, 1, 1, 0, 0, 1, 1, 0, 1, 1], [1, 1, 0, 1, 1, 1, 0, 0, 0, 0])
R = ([0.1, -0.2, 0.0, 9, 9, 0.3, 0.1, 9, -0.5, 0.2], [0.05, 0.0, 9, -0.1, 0.2, 0.4, 9, 9, 9, 9])


def test_ingested_verl_dump_with_tool_gaps_per_turn(tmp_path: Path) -> None:
    from tensordict import TensorDict

    seqs = [Seq([1, 2], list(range(10, 20)), [-1.0] * 10, [-1.0 + x for x in r]) for r in R]
    tensors, non_tensor = verl_batch(seqs)
    tensors["response_mask"][:, :10] = tensors["response_mask"].new_tensor(MASKS)
    logs = tmp_path / "logs"
    logs.mkdir()
    proto = DataProto(TensorDict(tensors, batch_size=[2]), non_tensor, {"temperature": 1.0})
    proto.save_to_disk(logs / "step_1.dp")
    run_ingest(IngestConfig("verl-dp", logs, tmp_path / "run", trust_pickle=True))

    tokens = pq.read_table(tmp_path / "run" / store.TOKENS_FILE)
    assert tokens.column("turn").to_pylist() == [0, 0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 1]
    seqs_table = pq.read_table(tmp_path / "run" / store.SEQUENCES_FILE)
    assert seqs_table.column("num_turns").to_pylist() == [3, 2]

    rows = compute_metrics(tmp_path / "run").per_turn
    f32 = lambda x: float(np.float32(x))  # noqa: E731  (the store holds float32)
    r = lambda xs: np.array([f32(-1.0 + x) - f32(-1.0) for x in xs])  # noqa: E731
    by_turn = {0: r([0.1, -0.2, 0.0, 0.05, 0.0]), 1: r([0.3, 0.1, -0.1, 0.2, 0.4])}
    by_turn[2] = r([-0.5, 0.2])
    firsts = {0: r([0.1, 0.05]), 1: r([0.3, -0.1]), 2: r([-0.5])}
    assert [row["turn"] for row in rows] == [0, 1, 2]
    for row in rows:
        x, t = by_turn[row["turn"]], row["turn"]
        n = len(x)
        assert row["tokens"] == n
        assert row["sequences"] == (2 if t < 2 else 1)
        assert row["k3_kl"] == pytest.approx(np.sum(np.exp(x) - 1 - x) / (n + 1e-8), rel=1e-9)
        assert row["kl"] == pytest.approx(np.sum(-x) / (n + 1e-8), rel=1e-9, abs=1e-15)
        assert row["abs_log_ratio_mean"] == pytest.approx(np.mean(np.abs(x)), rel=1e-12)
        mult = np.sum(np.exp(np.abs(x))) / (n + 1e-8)
        assert row["token_mult_prob_error"] == pytest.approx(mult, rel=1e-12)
        first = np.mean(np.abs(firsts[t]))
        assert row["first_token_abs_log_ratio_mean"] == pytest.approx(first, rel=1e-12)
        assert row["context_tokens_mean"] is None  # an ingested run has no prompt lengths


def test_rerender_fractions_hand_computed(tmp_path: Path) -> None:
    tokens = tmp_path / store.TOKENS_FILE
    tokens.touch()
    table = pa.table(
        {
            "setting": ["a", "a", "a", "b"],
            "seq_id": [0, 1, 2, 3],
            "response_length": pa.array([10, 5, 7, 4], pa.int32()),
            "rerender_differs": pa.array([True, False, None, True]),
            "rerender_mismatched_tokens": pa.array([2, 0, None, 4], pa.int32()),
        }
    )
    pq.write_table(table, tmp_path / store.SEQUENCES_FILE)
    got = rerender_scalars(tokens, "a")
    assert got == {"rerender_trajectory_fraction": 0.5, "rerender_token_fraction": 2 / 15}
    assert rerender_scalars(tokens, "b")["rerender_token_fraction"] == 1.0


def _turn_context(tmp_path: Path) -> Any:
    from mismatch_probe.rundir.context import RunContext

    row = {"sequences": 2, "tokens": 10, "kl": 0.001, "abs_log_ratio_mean": 0.02}
    rows = (
        {**row, "turn": 0, "context_tokens_mean": 12.0, "k3_kl": 0.0005,
         "first_token_abs_log_ratio_mean": 0.03, "token_mult_prob_error": 1.0201},
        {**row, "turn": 1, "context_tokens_mean": None, "k3_kl": 0.002,
         "first_token_abs_log_ratio_mean": 0.05, "token_mult_prob_error": 1.0412},
    )  # fmt: skip
    metrics = {"rerender_trajectory_fraction": 0.5, "rerender_token_fraction": 0.0125}
    return RunContext(
        tmp_path, {"setting": "rollout=bf16"}, metrics, {}, {}, (), None, per_turn=rows
    )


def test_per_turn_markdown_exact(tmp_path: Path) -> None:
    from mismatch_probe.report import turns as report_turns

    text = report_turns.markdown(_turn_context(tmp_path), tmp_path / "turns.png")
    assert text.splitlines() == [
        "## Per turn",
        "",
        "rollout=bf16: each turn's tokens alone (turn 0 is the first generated turn; its first "
        "token follows a prefill of the whole context so far; context: trajectory tokens at the "
        "turn's start; mult. error: `token_mult_prob_error`).",
        "",
        "| turn | sequences | tokens | context | k3 | kl | mean \\|r\\| | first-token \\|r\\| "
        "| mult. error |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| 0 | 2 | 10 | 12.0 | 0.0005 | 0.001 | 0.02 | 0.03 | 1.0201 |",
        "| 1 | 2 | 10 | n/a | 0.002 | 0.001 | 0.02 | 0.05 | 1.0412 |",
        "",
        f"{report_turns.DRIFT_NOTE} Trajectories whose ids differ: **50.0%** "
        "(`rerender_trajectory_fraction`); generated tokens that differ or have no counterpart: "
        "**1.25%** (`rerender_token_fraction`).",
        "",
        "![k3 and first-token |r| per turn](plots/turns.png)",
    ]


def test_per_turn_terminal_exact(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from mismatch_probe.report import turns as report_turns

    console = Console(file=io.StringIO(), width=100, force_terminal=False)
    console.print(report_turns.terminal_table(_turn_context(tmp_path)))
    lines = [line.rstrip() for line in console.file.getvalue().splitlines()]
    assert lines == [
        "Per turn",
        " turn  sequences  tokens  context      k3     kl  mean |r|  first-token |r|  mult. error",
        "    0          2      10     12.0  0.0005  0.001      0.02             0.03       1.0201",
        "    1          2      10      n/a   0.002  0.001      0.02             0.05       1.0412",
    ]


def test_open_turns_parse_and_bad_messages_are_refused(tmp_path: Path) -> None:
    import json

    from mismatch_probe.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": list(MESSAGES)}) + "\n")
    assert load_prompts(path)[0].open_turns == 3
    path.write_text(json.dumps({"messages": [{"role": "user", "content": None}]}) + "\n")
    with pytest.raises(ProbeError, match=r"p.jsonl:1: .*without content is a turn the engine"):
        load_prompts(path)


def test_multi_turn_moe_needs_prefill_replay_capture(tokenizer: Any) -> None:
    from mismatch_probe.engine.routing import NATIVE, PREFILL_REPLAY

    prompts = [encoded(tokenizer)]
    moe = lambda path: SimpleNamespace(setup=SimpleNamespace(capture_path=path))  # noqa: E731
    trajectory.check(prompts, None)  # a dense model
    trajectory.check(prompts, moe(PREFILL_REPLAY))  # routes of the whole trajectory replayed
    with pytest.raises(ProbeError, match="need prefill-replay route capture"):
        trajectory.check(prompts, moe(NATIVE))
