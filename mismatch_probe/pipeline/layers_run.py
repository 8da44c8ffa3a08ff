"""``probe layers RUN``: the ``--layers`` comparison on the tokens of an existing scan.

The run's own record says everything: ``run.json`` (its ``ScanConfig``: model, dtypes, chat
template; each rollout setting's exact engine arguments and environment) and the token store
(each sequence's prompt text and response ids). Each sequence's prompt ids are the prompt text
(after the chat template) encoded as the scan encoded it; each rollout setting's engine is
started again as it ran, its streams captured (``layers.capture_run``), then each training dtype
compares them (``layers.compare_run``). ``layers.json`` is written and the reports re-rendered
(``publish``). Multi-turn and sharded runs are refused (as ``--layers`` refuses them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.engine import rollout
from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline import layers
from mismatch_probe.settings import Setting, rollout_settings, settings


def _config(run: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    config = run.get("config")
    if not isinstance(config, dict) or "train_dtypes" not in config or not run.get("rollouts"):
        raise ProbeError(
            f"{run_dir} holds no scan (run.json without its scan config): nothing to probe"
        )
    if config.get("shards", 1) > 1 or config.get("ray"):
        raise ProbeError(f"{run_dir}: --layers runs on a whole scan, not a sharded one")
    return config


def _settings(config: dict[str, Any]) -> list[Setting]:
    rollouts = rollout_settings(
        config["rollout_dtypes"],
        config.get("kv_cache_dtypes", ("auto",)),
        config.get("quantizations", ("none",)),
        config.get("lm_head_fp32", (False,)),
    )
    return settings(rollouts, config["train_dtypes"])  # own routes only


def _rollouts(run_dir: Path, setting: str, tokenizer: Any, chat: bool) -> list[rollout.Rollout]:
    """The sequences of ``setting`` in ``seq_id`` order (prompt ids re-encoded from the text)."""
    sequences = pq.read_table(store.resolve_tokens_path(run_dir).with_name(store.SEQUENCES_FILE))
    if "num_turns" in sequences.column_names and pc.max(sequences["num_turns"]).as_py() not in (
        None,
        1,
    ):
        raise ProbeError(f"{run_dir}: a multi-turn run; --layers compares single-turn scans")
    sequences = sequences.filter(pc.equal(sequences["setting"], setting)).sort_by("seq_id")
    tokens = pq.read_table(
        store.resolve_tokens_path(run_dir), columns=["setting", "seq_id", "position", "token_id"]
    )
    tokens = tokens.filter(pc.equal(tokens["setting"], setting)).sort_by(
        [("seq_id", "ascending"), ("position", "ascending")]
    )
    by_seq: dict[int, list[int]] = {}
    for seq, tok in zip(tokens["seq_id"].to_pylist(), tokens["token_id"].to_pylist(), strict=True):
        by_seq.setdefault(seq, []).append(tok)
    out = []
    for row in sequences.to_pylist():
        prompt = tokenizer(row["prompt_text"], add_special_tokens=not chat)["input_ids"]
        out.append(
            rollout.Rollout(
                row["seq_id"], row["prompt_id"], row["sample_id"], list(prompt),
                by_seq.get(row["seq_id"], []), [], row["finish_reason"], "",
            )
        )  # fmt: skip
    return out


def run_layers(run_dir: Path, sequences: int | None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Compare the run's settings layer by layer; write ``layers.json`` and re-render the
    reports. Returns ``layers.json``'s content and every path written.

    Raises:
        ProbeError: not a scan's run directory, a multi-turn or sharded run, an engine out of
            eager mode, ``sequences`` below 1.
    """
    from transformers import AutoTokenizer

    from mismatch_probe.engine import layers as engine_layers
    from mismatch_probe.pipeline.publish import publish
    from mismatch_probe.rundir import load_report
    from mismatch_probe.rundir.data import read_run
    from mismatch_probe.rundir.layers import write_layers
    from mismatch_probe.training import rescore

    if sequences is not None and sequences < 1:
        raise ProbeError(f"--layers-sequences must be >= 1, got {sequences}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ProbeError(f"{run_dir} is not a run directory")
    run = read_run(run_dir)
    config = _config(run, run_dir)
    model_dir = Path(config["model"]) if config.get("model") else None
    if model_dir is None or not model_dir.is_dir():
        raise ProbeError(f"{run_dir}: the scanned model {model_dir} is not a directory here")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    chat = (
        bool(getattr(tokenizer, "chat_template", None))
        if config.get("chat") is None
        else bool(config["chat"])
    )
    every = _settings(config)
    engines = {
        e["setting"]: e for e in run["rollouts"] if not e.get("skipped") and e.get("engine_args")
    }
    ran = [s for s in every if s.rollout.name in engines]
    captured: dict[str, tuple[list[rollout.Rollout], layers.EngineLayers]] = {}
    try:
        for name in dict.fromkeys(s.rollout.name for s in ran):
            first = next(s for s in ran if s.rollout.name == name)
            rollouts = _rollouts(run_dir, first.name, tokenizer, chat)
            count = len(rollouts) if sequences is None else min(sequences, len(rollouts))
            entry = engines[name]
            kwargs = {**entry["engine_args"], **engine_layers.ENGINE_KWARGS}
            env = {**entry.get("engine_env", {}), **engine_layers.ENGINE_ENV}
            engine_layers.check_eager(kwargs)
            with rollout.engine(kwargs, env) as llm:
                captured[name] = (rollouts, layers.capture_run(llm, rollouts, range(count)))
        found: dict[Setting, Any] = {}
        offsets: dict[Setting, int] = {}
        for dtype in dict.fromkeys(s.train_dtype for s in ran):
            model = rescore.load_model(model_dir, dtype, config.get("train_device_map"))
            for s in (s for s in ran if s.train_dtype == dtype):
                rollouts, got = captured[s.rollout.name]
                found[s] = layers.compare_run(model, rollouts, got)
                offsets[s] = _offset(run_dir, s.name)
            del model
    finally:
        for _, got in captured.values():
            got.discard()
    data = layers.finish(found, offsets)
    paths = write_layers(run_dir, data)
    ctx, entries = load_report(run_dir)
    return data, {**paths, **publish(ctx, entries)}


def _offset(run_dir: Path, setting: str) -> int:
    """The first ``seq_id`` of ``setting`` (its sequences are contiguous from there)."""
    table = pq.read_table(
        store.resolve_tokens_path(run_dir).with_name(store.SEQUENCES_FILE),
        columns=["setting", "seq_id"],
    )
    ids = table.filter(pc.equal(table["setting"], setting))["seq_id"]
    return int(pc.min(ids).as_py() or 0) if len(ids) else 0
