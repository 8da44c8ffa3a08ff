"""The framework hooks against the real frameworks: TRL 1.16's ``GRPOTrainer`` runs a few CPU
steps with the README's hook (its code block; tool spans in the completions, evaluation on),
and verl 0.9.1's own objects (``DataProto``, the jagged ``TensorDict`` its V1 trainer keeps in
TransferQueue, its padding rows, its default config) go through the hooks' writer calls;
``probe ingest probe`` reads what they wrote.

The trainers themselves are not built here (they need GPUs): the objects they hold are, with
verl's own functions, and the trainer-class lookup of the off-policy bound runs on classes that
carry the real qualified names. The legacy launch script runs through verl's ``main_ppo`` up to
the trainer in tests/test_verl_wiring.py; ``wire_verl_legacy``'s refusals and its warning are
checked here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest import IngestConfig, ProbeWriter, probe_format, run_ingest
from mismatch_probe.ingest.hook import VERL_V1_FIELDS, prompt_groups
from mismatch_probe.store import TOKENS_FILE

TOOL_TEXT = " = 5. Paris"  # what the "tool" answers, inserted after the first turn
TURN1, TURN2 = 6, 4  # generated tokens before and after the tool output


def _ingest(src: Path, out: Path, fmt: str = "probe", **kw: Any) -> dict:
    return run_ingest(IngestConfig(fmt, src, out, **kw)).run


def _k3(rollout: np.ndarray, train: np.ndarray) -> float:
    r = np.asarray(train, np.float64) - np.asarray(rollout, np.float64)
    return float(np.mean(np.expm1(r) - r))


def _files(root: Path) -> dict[int, list[Path]]:
    return {int(d.name[5:]): sorted(d.glob("*.parquet")) for d in sorted(root.glob("step_*"))}


# --- TRL -------------------------------------------------------------------------------------


def _rollout_func(tokenizer: Any) -> Any:
    """A ``rollout_func`` that does what TRL's tool loop does: generate a turn, append the
    tool's output (sampling log-prob 0.0, ``env_mask`` 0), generate the next turn, on even
    rows; the engine is the trainer's own model (transformers ``generate``, float32)."""
    import torch

    tool = tokenizer.encode(TOOL_TEXT)

    def generate(model: Any, context: list[int], n: int) -> tuple[list[int], list[float]]:
        ids = torch.tensor([context])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=True, top_k=0, top_p=1.0,
                                 temperature=1.0, output_logits=True,
                                 return_dict_in_generate=True,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        new = out.sequences[0, ids.shape[1] :].tolist()
        logps = [
            torch.log_softmax(x[0].float(), -1)[t].item()
            for x, t in zip(out.logits, new, strict=True)
        ]
        return new, logps

    def rollout(prompts: list[str], trainer: Any) -> dict[str, list]:
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        out["env_mask"] = []
        for i, prompt in enumerate(prompts):
            p = tokenizer.encode(prompt)
            ids, logps = generate(trainer.model, p, TURN1)
            mask = [1] * len(ids)
            if i % 2 == 0:
                ids, logps, mask = ids + tool, logps + [0.0] * len(tool), mask + [0] * len(tool)
                more, more_logps = generate(trainer.model, p + ids, TURN2)
                ids, logps, mask = ids + more, logps + more_logps, mask + [1] * len(more)
            for key, value in zip(out, (p, ids, logps, mask), strict=True):
                out[key].append(value)
        return out

    return rollout


@dataclass
class TrlRun:
    root: Path
    batches: list[tuple[bool, int, dict]] = field(default_factory=list)  # (training, step, out)


def readme_block(marker: str) -> str:
    """The ```python block of the hooks' docs page (docs/ingest.md, once the README's) holding
    ``marker``."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "ingest.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b)


@contextmanager
def working_dir(path: Path) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def _trainer(model: Path, run: TrlRun | None, **kw: Any) -> Any:
    """The README's ``ProbeGRPOTrainer`` (its code block, executed), recording each output
    for the checks; it writes ``probe_logs`` in the working directory."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    namespace: dict[str, Any] = {}
    exec(readme_block("class ProbeGRPOTrainer"), namespace)

    class Recording(namespace["ProbeGRPOTrainer"]):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if run is not None:
                copy = {k: v.clone() if hasattr(v, "clone") else v for k, v in output.items()}
                run.batches.append((self.model.training, self.state.global_step, copy))
            return output

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = ["The quick brown fox", "Two plus two equals", "def add(a, b):", "Solve for x:"]
    data = Dataset.from_dict({"prompt": prompts})
    args = GRPOConfig(
        output_dir="trl-out", per_device_train_batch_size=4,
        num_generations=2, steps_per_generation=2, gradient_accumulation_steps=1,
        max_completion_length=16, report_to=[], use_cpu=True, save_strategy="no",
        logging_steps=100, disable_tqdm=True, bf16=False, seed=0, gradient_checkpointing=False,
        **kw,
    )  # fmt: skip
    reward = lambda completions, **_: [float(len(c)) for c in completions]  # noqa: E731
    return Recording(
        model=str(model), reward_funcs=[reward],
        args=args, train_dataset=data, eval_dataset=data.select(range(2)),
        processing_class=tokenizer,
        rollout_func=_rollout_func(tokenizer) if run is not None else None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def trl_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> TrlRun:
    """4 optimizer steps, a generation every 2 (``old_per_token_logps`` are then computed,
    as with vLLM), evaluation after every step."""
    import torch

    torch.manual_seed(0)
    work = tmp_path_factory.mktemp("trl")
    run = TrlRun(work / "probe_logs")
    with working_dir(work):
        _trainer(tiny_model, run, max_steps=4, eval_strategy="steps", eval_steps=1,
                 per_device_eval_batch_size=2).train()  # fmt: skip
    return run


def test_trl_hook_writes_the_tokens_trl_trains_on(trl_run: TrlRun) -> None:
    """Per training batch: exactly TRL's ``completion_mask * tool_mask`` tokens (TRL's own
    ``num_items_in_batch``), with TRL's two log-prob tensors, tool output left out but its
    positions kept (the second turn starts after the gap)."""
    import torch

    training = [(step, out) for is_train, step, out in trl_run.batches if is_train]
    assert [step for step, _ in training] == [0, 2]
    files = _files(trl_run.root)
    for step, out in training:
        (file,) = files[step]
        table = pq.read_table(file)
        loss_mask = (out["completion_mask"] * out["tool_mask"]).bool()
        assert (out["tool_mask"] == 0).any()  # the batch has tool output
        assert table.num_rows == int(out["num_items_in_batch"]) == int(loss_mask.sum())
        assert table.column("token_id").to_pylist() == out["completion_ids"][loss_mask].tolist()
        got = table.column("rollout_logprob").to_numpy()
        assert got.tolist() == out["sampling_per_token_logps"][loss_mask].tolist()
        got = table.column("train_logprob").to_numpy()
        assert got.tolist() == out["old_per_token_logps"][loss_mask].tolist()
        rows, cols = torch.nonzero(loss_mask, as_tuple=True)
        assert table.column("position").to_pylist() == cols.tolist()
        assert table.column("sequence").to_pylist() == rows.tolist()
        # row 0 had a tool call: turn 1 at 0..5, the tool's tokens, turn 2 after them
        tool_len = int((out["tool_mask"][0] == 0).sum())
        positions = cols[rows == 0].tolist()
        assert positions == [*range(TURN1), *range(TURN1 + tool_len, TURN1 + tool_len + TURN2)]
        # the num_generations responses to one prompt share a group
        groups = table.column("group").to_pylist()
        by_row = dict(zip(rows.tolist(), groups, strict=True))
        assert by_row == dict(enumerate(prompt_groups(out["prompt_ids"], out["prompt_mask"])))
        assert len(set(by_row.values())) == 4


def test_trl_hook_skips_evaluation_batches(trl_run: TrlRun) -> None:
    """TRL generates evaluation batches with the same method; none reaches the logs, though
    evaluation ran at global steps that are also training steps' folders."""
    evals = {step for is_train, step, _ in trl_run.batches if not is_train}
    assert evals >= {2}  # an evaluation at step 2, where a training generation also is
    assert {step: len(f) for step, f in _files(trl_run.root).items()} == {0: 1, 2: 1}


def test_trl_ingest_is_on_policy_and_the_identity(trl_run: TrlRun, tmp_path: Path) -> None:
    """Engine and trainer are the same float32 model: k3 about 0 with the tool mask applied;
    the tool tokens' sampling log-prob of 0.0 against the trainer's would not be."""
    run = _ingest(trl_run.root, tmp_path / "run")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    trained = sum(int(o["num_items_in_batch"]) for t, _, o in trl_run.batches if t)
    assert metrics["num_tokens"] == run["counts"]["tokens"] == trained
    assert metrics["k3_kl"] < 1e-6
    out = next(o for t, _, o in trl_run.batches if t)
    unmasked = out["completion_mask"].bool()  # what the hook wrote before tool_mask
    k3 = _k3(out["sampling_per_token_logps"][unmasked], out["old_per_token_logps"][unmasked])
    assert k3 > 0.5
    assert (
        run["off_policy"]["max_off_policy_steps"] == 0 and run["off_policy"]["staleness"] is False
    )
    assert run["off_policy"]["source"].startswith("TRL GRPOTrainer")
    assert "On-policy training" in (tmp_path / "run" / "report.md").read_text()
    seqs = pq.read_table(tmp_path / "run" / "sequences.parquet")
    assert sorted(seqs.column("sample_id").to_pylist()) == [0] * 8 + [1] * 8  # 2 per prompt


def test_trl_without_sampling_log_probs_stops_training(tiny_model: Path, tmp_path: Path) -> None:
    """Without vLLM TRL keeps no sampling log-probs: the hook stops the run with one line."""
    with working_dir(tmp_path):
        trainer = _trainer(tiny_model, None, max_steps=1)
        with pytest.raises(ProbeError, match="vllm_importance_sampling_correction=True"):
            trainer.train()
    assert not (tmp_path / "probe_logs").exists()


# --- verl: the objects its trainers hold -------------------------------------------------------


def _verl_config(**overrides: Any) -> Any:
    """verl 0.9.1's default PPO config (``_generated_ppo_trainer.yaml``), with overrides."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    config = OmegaConf.load(str(files("verl") / "trainer/config/_generated_ppo_trainer.yaml"))
    for key, value in overrides.items():
        OmegaConf.update(config, key, value)
    return config


def _trainer_class(qualified: str) -> type:
    """A class with the qualified name of a verl trainer (the off-policy lookup reads names)."""
    module, _, name = qualified.rpartition(".")
    return type(name, (), {"__module__": module})


LEGACY = "verl.trainer.ppo.ray_trainer.RayPPOTrainer"
V1_SYNC = "verl.trainer.ppo.v1.trainer_base.PPOTrainer"
FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_trainer.FullyAsyncTrainer"


def _verl_trainer(qualified: str, **overrides: Any) -> Any:
    trainer = _trainer_class(qualified)()
    trainer.config = _verl_config(**overrides)
    return trainer


# Three responses (two prompts): right-padded, row 1 with a tool span (response_mask 0).
RESPONSES = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16]]
MASKS = [[1, 1, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1]]
UIDS = ["p0", "p0", "p1"]


def _logps(seed: int) -> tuple[list[list[float]], list[list[float]]]:
    rng = np.random.default_rng(seed)
    rollout = [np.log(rng.uniform(0.1, 0.9, len(r))).tolist() for r in RESPONSES]
    train = [(np.array(r) + rng.normal(0, 0.1, len(r))).tolist() for r in rollout]
    for r, m in zip(rollout, MASKS, strict=True):  # tool tokens: the engine logged 0.0
        r[:] = [x if keep else 0.0 for x, keep in zip(r, m, strict=True)]
    return rollout, train


def _expected(rollout: list, train: list) -> dict[str, list]:
    keep = [(i, j) for i, m in enumerate(MASKS) for j, v in enumerate(m) if v]
    return {
        "token_id": [RESPONSES[i][j] for i, j in keep],
        "position": [j for _, j in keep],
        "rollout": [float(np.float32(rollout[i][j])) for i, j in keep],
        "train": [float(np.float32(train[i][j])) for i, j in keep],
    }


def _legacy_batch(rollout: list, train: list) -> tuple[Any, Any]:
    """``RayPPOTrainer.fit``'s ``batch`` at ``_compute_old_log_prob`` and what that returns
    (``DataProto.from_tensordict`` of ``old_log_probs`` and ``entropys``)."""
    import torch
    from verl.protocol import DataProto
    from verl.utils import tensordict_utils as tu

    width = max(map(len, RESPONSES))
    pad = lambda rows, v=0: [r + [v] * (width - len(r)) for r in rows]  # noqa: E731
    batch = DataProto.from_dict(
        tensors={
            "responses": torch.tensor(pad(RESPONSES)),
            "response_mask": torch.tensor(pad(MASKS)),
            "rollout_log_probs": torch.tensor(pad(rollout, 0.0), dtype=torch.float32),
            "attention_mask": torch.ones(3, 2 + width, dtype=torch.int64),
        },
        non_tensors={"uid": np.array(UIDS, dtype=object)},
    )
    result = {"old_log_probs": torch.tensor(pad(train, 0.0)), "entropys": torch.rand(3, width)}
    return batch, DataProto.from_tensordict(tu.get_tensordict(result))


def test_verl_legacy_hook_on_a_real_data_proto(tmp_path: Path) -> None:
    rollout, train = _logps(1)
    batch, old = _legacy_batch(rollout, train)
    writer = ProbeWriter.for_verl(
        _verl_trainer(LEGACY, **{"trainer.use_v1": False}), tmp_path / "logs"
    )
    writer.write_verl(3, batch, old)
    run = _ingest(tmp_path / "logs", tmp_path / "run")
    table = pq.read_table(tmp_path / "run" / TOKENS_FILE)
    expect = _expected(rollout, train)
    assert table.column("token_id").to_pylist() == expect["token_id"]
    assert table.column("position").to_pylist() == [0, 1, 2, 3, 0, 1, 4, 5, 0, 1]
    assert table.column("rollout_logprob").to_pylist() == expect["rollout"]
    assert table.column("train_logprob").to_pylist() == expect["train"]
    seqs = pq.read_table(tmp_path / "run" / "sequences.parquet")
    assert seqs.column("prompt_id").to_pylist() == [0, 0, 1]  # verl's uid
    assert run["off_policy"] == {
        "max_off_policy_steps": 0, "staleness": False,
        "source": "verl RayPPOTrainer: old_log_probs recomputed with the rollout's weights",
    }  # fmt: skip


@dataclass
class KVBatchMeta:
    """``transfer_queue.KVBatchMeta``'s fields (the package is not installed here)."""

    keys: list[str]
    tags: list[dict]
    partition_id: str = "train"


def _v1_batch(rollout: list, train: list) -> tuple[KVBatchMeta, Any]:
    """What ``tq.kv_batch_get`` returns after the V1 ``_compute_old_log_prob``: the samples as
    ``AgentLoopWorkerTQ`` put them (``list_of_dict_to_tensordict``), one padding sample from
    ``upsample_batch_to_divisible_size``'s template, and ``old_log_probs`` cut from the actor's
    nested log-probs by ``response_from_nested``."""
    import torch
    from verl.trainer.ppo.padding_utils import construct_minimal_padding_template
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    from verl.workers.utils.padding import response_from_nested

    prompt = [1, 2, 3]
    samples, tags = [], []
    for resp, mask, logp, uid in zip(RESPONSES, MASKS, rollout, UIDS, strict=True):
        samples.append({
            "prompts": torch.tensor(prompt), "responses": torch.tensor(resp),
            "response_mask": torch.tensor(mask), "loss_mask": torch.tensor(mask),
            "rollout_log_probs": torch.tensor(logp, dtype=torch.float32),
            "input_ids": torch.tensor(prompt + resp),
            "attention_mask": torch.ones(len(prompt) + len(resp), dtype=torch.int64),
            "rm_scores": torch.zeros(len(resp)), "num_turns": 2, "uid": uid,
        })  # fmt: skip
        tags.append({"status": "success", "global_steps": 4, "min_global_steps": 3,
                     "max_global_steps": 3, "seq_len": len(prompt) + len(resp)})  # fmt: skip
    padding, tag = construct_minimal_padding_template(samples[0], tags[0], eos_token_id=0)
    padding["uid"] = "padding"
    samples.append(padding)
    tags.append(tag)
    data = list_of_dict_to_tensordict(samples)
    # the actor's log-probs over prompt + response, shifted: entry t scores token t + 1
    full = []
    for i, sample in enumerate(samples):
        row = torch.zeros(len(sample["input_ids"]))
        n = len(sample["responses"])
        row[-n - 1 : -1] = torch.tensor(train[i] if i < len(train) else [0.0] * n)
        full.append(row)
    nested = torch.nested.as_nested_tensor(full, layout=torch.jagged)
    data["old_log_probs"] = response_from_nested(nested, data["response_mask"])
    keys = [f"{u}_{i}_0" for i, u in enumerate(UIDS)] + ["padding_0"]
    return KVBatchMeta(keys, tags), data.select(*VERL_V1_FIELDS)


def test_verl_v1_hook_on_transfer_queue_fields(tmp_path: Path) -> None:
    rollout, train = _logps(2)
    meta, data = _v1_batch(rollout, train)
    assert data["responses"].is_nested and meta.tags[-1]["is_padding"]
    writer = ProbeWriter.for_verl(_verl_trainer(V1_SYNC), tmp_path / "logs")
    writer.write_verl_v1(4, meta, data)
    run = _ingest(tmp_path / "logs", tmp_path / "run")
    table = pq.read_table(tmp_path / "run" / TOKENS_FILE)
    expect = _expected(rollout, train)
    assert table.column("token_id").to_pylist() == expect["token_id"]  # no padding row
    assert table.column("position").to_pylist() == [0, 1, 2, 3, 0, 1, 4, 5, 0, 1]
    assert table.column("rollout_logprob").to_pylist() == expect["rollout"]
    assert table.column("train_logprob").to_pylist() == expect["train"]
    assert table.column("step").to_pylist() == [4] * 10
    assert run["counts"]["sequences"] == 3 and run["off_policy"]["max_off_policy_steps"] == 0
    assert "trainer_mode=sync" in run["off_policy"]["source"]


def test_verl_v1_equal_length_samples_and_mismatched_tags(tmp_path: Path) -> None:
    """``list_of_dict_to_tensordict`` stacks equal-length samples densely instead of jagged:
    the same rows come out; tags that do not match the samples are one line."""
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    samples = [
        {"responses": torch.tensor([3, 4]), "response_mask": torch.tensor([1, 0]),
         "rollout_log_probs": torch.tensor([-1.0, 0.0]),
         "old_log_probs": torch.tensor([-1.5, -9.0]), "uid": f"u{i}"}
        for i in range(2)
    ]  # fmt: skip
    data = list_of_dict_to_tensordict(samples)
    assert not data["responses"].is_nested
    writer = ProbeWriter(tmp_path / "logs")
    table = pq.read_table(writer.write_verl_v1(1, KVBatchMeta(["a", "b"], [{}, {}]), data))
    assert table.column("train_logprob").to_pylist() == [-1.5, -1.5]
    assert table.column("group").to_pylist() == ["u0", "u1"]
    with pytest.raises(ProbeError, match="1 tags for 2 samples"):
        writer.write_verl_v1(1, KVBatchMeta(["a"], [{}]), data)


def test_verl_dump_recipe_with_a_real_data_proto(tmp_path: Path) -> None:
    """The README's ``save_to_disk`` recipe on verl's own ``DataProto``, read by ``verl-dp``."""
    rollout, train = _logps(3)
    batch, old = _legacy_batch(rollout, train)
    keep = batch.select(["responses", "response_mask", "rollout_log_probs"], ["uid"], [])
    keep = keep.union(old.select(["old_log_probs"], [], []))
    (tmp_path / "dumps").mkdir()
    keep.save_to_disk(str(tmp_path / "dumps" / "step_7.dp"))
    _ingest(tmp_path / "dumps", tmp_path / "run", fmt="verl-dp", trust_pickle=True)
    table = pq.read_table(tmp_path / "run" / TOKENS_FILE)
    expect = _expected(rollout, train)
    assert table.column("rollout_logprob").to_pylist() == expect["rollout"]
    assert table.column("train_logprob").to_pylist() == expect["train"]


def test_the_readme_verl_script_calls_what_probe_has() -> None:
    """The docs' ``probe_verl.py`` compiles and calls only ``ProbeWriter`` methods that exist
    (it runs, up to the trainer verl builds, in tests/test_verl_wiring.py)."""
    import ast

    source = readme_block("class ProbeTaskRunnerV1")
    tree = ast.parse(source)
    compile(tree, "probe_verl.py", "exec")
    called = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and (
            (isinstance(node.value, ast.Name) and node.value.id == "ProbeWriter")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "probe")
        )
    }
    assert called == {"for_verl", "write_verl", "write_verl_v1"}
    assert all(callable(getattr(ProbeWriter, name)) for name in called)


# --- verl: wire_verl_legacy, the legacy launch script's wiring -----------------------------------

# A task runner like verl's: ``run`` builds its trainer by the global name ``RayPPOTrainer``
# (its own namespace here, as Ray's by-value copy is in the actor), or returns without one.
RUNNER_SOURCE = """
class Runner:
    def run(self, config):
        return RayPPOTrainer(config) if config == "build" else None
"""


def _runner() -> tuple[type, dict[str, Any]]:
    namespace: dict[str, Any] = {"RayPPOTrainer": "verl's own"}
    exec(RUNNER_SOURCE, namespace)
    return namespace["Runner"], namespace


def test_wired_task_runner_builds_the_probe_trainer_and_restores_the_name() -> None:
    from mismatch_probe.ingest import verl_wiring

    runner, namespace = _runner()
    probe = type("ProbeV0Trainer", (), {"__init__": lambda self, config: None})
    checked = verl_wiring.checked_runner(runner, verl_wiring.trainer_builder(runner), probe)
    assert type(checked().run("build")) is probe
    assert namespace["RayPPOTrainer"] == "verl's own"  # what the globals held before the run


def test_a_run_that_never_builds_the_probe_trainer_says_so() -> None:
    from mismatch_probe.ingest import verl_wiring

    runner, _ = _runner()
    probe = type("ProbeV0Trainer", (), {"__module__": "__main__"})
    checked = verl_wiring.checked_runner(runner, runner, probe)
    with pytest.warns(RuntimeWarning, match=r"finished without building __main__\.ProbeV0Trainer"):
        checked().run("skip")


def test_wire_verl_legacy_refuses_what_cannot_work() -> None:
    from verl.trainer import main_ppo_v0
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from mismatch_probe.ingest import verl_wiring, wire_verl_legacy

    with pytest.raises(ProbeError, match="is not a subclass of RayPPOTrainer"):
        wire_verl_legacy(type("NotATrainer", (), {}))
    with pytest.raises(ProbeError, match="not a Ray actor class"):
        verl_wiring.actor_class(RayPPOTrainer)
    with pytest.raises(ProbeError, match="builds no RayPPOTrainer by name"):
        verl_wiring.trainer_builder(type("Runner", (), {"run": lambda self, config: None}))
    assert verl_wiring.actor_class(main_ppo_v0.TaskRunner).__qualname__ == "TaskRunner"


def test_wire_verl_legacy_sets_the_trainer_where_verl_builds_it() -> None:
    """In this process: ``main_ppo_v0.RayPPOTrainer`` (what Ray's copy of ``TaskRunner.run``
    captures) and a checked ``TaskRunner`` (what ``main_ppo.main`` starts); wiring twice wraps
    verl's runner once. Restored after."""
    from verl.trainer import main_ppo_v0
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from mismatch_probe.ingest import verl_wiring, wire_verl_legacy

    runner, trainer = main_ppo_v0.TaskRunner, main_ppo_v0.RayPPOTrainer
    probe = type("ProbeV0Trainer", (RayPPOTrainer,), {})
    try:
        wire_verl_legacy(probe)
        wire_verl_legacy(probe)
        assert main_ppo_v0.RayPPOTrainer is probe
        checked = verl_wiring.actor_class(main_ppo_v0.TaskRunner)
        assert getattr(checked, verl_wiring.CHECKED).endswith("ProbeV0Trainer")
        assert checked.__mro__[1] is verl_wiring.actor_class(runner)
    finally:
        main_ppo_v0.TaskRunner, main_ppo_v0.RayPPOTrainer = runner, trainer


# --- verl: the checks that keep a hook from writing nothing, or the wrong thing ----------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"actor_rollout_ref.rollout.calculate_log_probs": False},
         "set actor_rollout_ref.rollout.calculate_log_probs=True"),
        ({"algorithm.rollout_correction.bypass_mode": True},
         "set algorithm.rollout_correction.bypass_mode=false"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("trainer", [LEGACY, V1_SYNC])
def test_verl_configs_without_a_training_side_are_refused(
    trainer: str, overrides: dict, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ProbeError, match=message.replace(".", r"\.")):
        ProbeWriter.for_verl(_verl_trainer(trainer, **overrides), tmp_path)


def test_verl_writer_wants_an_absolute_directory() -> None:
    with pytest.raises(ProbeError, match="absolute directory"):
        ProbeWriter.for_verl(_verl_trainer(V1_SYNC), "probe_logs")


def test_verl_v1_without_rollout_log_probs_names_the_config_key(tmp_path: Path) -> None:
    rollout, train = _logps(4)
    meta, data = _v1_batch(rollout, train)
    writer = ProbeWriter(tmp_path)
    with pytest.raises(ProbeError, match="calculate_log_probs=True"):
        writer.write_verl_v1(1, meta, data.exclude("rollout_log_probs"))


@pytest.mark.parametrize(
    ("trainer", "overrides", "bound", "stale"),
    [
        (LEGACY, {"trainer.use_v1": False}, 0, False),
        (V1_SYNC, {}, 0, False),
        (V1_SYNC, {"trainer.v1.sync": {"parameter_sync_step": 3}}, 2, True),  # what ran
        (V1_SYNC, {"trainer.v1.trainer_mode": "colocate_async"}, None, True),
        (V1_SYNC, {"trainer.v1.trainer_mode": "separate_async"}, None, True),
        (FULLY_ASYNC, {"async_training": {"staleness_threshold": 0.1}}, None, True),
        ("verl.experimental.one_step_off_policy.ray_trainer.OneStepOffRayTrainer", {}, 1, True),
    ],
)
def test_verl_off_policy_bound_follows_the_trainer(
    trainer: str, overrides: dict, bound: int | None, stale: bool, tmp_path: Path
) -> None:
    """Subclasses inherit their verl base's rule; the fully-async trainer is never on-policy."""
    subclass = type("ProbeTrainer", (_trainer_class(trainer),), {})
    instance = subclass()
    instance.config = _verl_config(**overrides)
    writer = ProbeWriter.for_verl(instance, tmp_path / "logs")
    writer.write_step(1, [[1, 2]], [[1, 1]], [[-1.0, -2.0]], [[-1.0, -2.1]])
    info = probe_format.off_policy(tmp_path / "logs")  # what the ingest records in run.json
    assert (info["max_off_policy_steps"], info["staleness"]) == (bound, stale)
    if bound == 2:
        assert "parameter_sync_step=3" in info["source"]
    if trainer == FULLY_ASYNC:
        assert "staleness_threshold=0.1" in info["source"]
        _ingest(tmp_path / "logs", tmp_path / "run")
        note = (tmp_path / "run" / "report.md").read_text()
        assert "Asynchronous training with an unknown off-policy bound" in note


# --- a step that trained on nothing ------------------------------------------------------------


def test_a_step_without_trained_tokens_is_reported(tmp_path: Path) -> None:
    writer = ProbeWriter(tmp_path / "logs", max_off_policy_steps=0)
    tokens, logps = [[1, 2, 3], [4, 5, 6]], [[-1.0, -2.0, -3.0]] * 2
    writer.write_step(1, tokens, [[1, 1, 0], [1, 0, 0]], logps, logps)
    writer.write_step(2, tokens, [[0, 0, 0], [0, 0, 0]], logps, logps)  # all truncated
    writer.write_step(3, tokens, [[1, 1, 1], [0, 0, 0]], logps, logps)
    run = _ingest(tmp_path / "logs", tmp_path / "run")
    counts = run["counts"]
    assert counts["steps_without_trained_tokens"] == [2]
    assert (counts["steps"], counts["sequences"], counts["empty_sequences_skipped"]) == (2, 3, 3)
    report = (tmp_path / "run" / "report.md").read_text()
    assert "2 (1..3); no trained token at step 2" in report
