"""The run metadata (``run.json``, also in the Parquet files' key-value metadata): every
setting, the resolved sampling parameters and log-probability mode, each engine's arguments,
the model and the hash of its config, library versions, hardware and timings."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from mismatch_probe import models, store
from mismatch_probe.engine import rollout, turns
from mismatch_probe.hardware import library_versions
from mismatch_probe.pipeline.records import Prepared, RolloutRun

if TYPE_CHECKING:
    from mismatch_probe.pipeline.config import ScanConfig


def run_metadata(
    cfg: ScanConfig, prep: Prepared, runs: list[RolloutRun], timings: dict[str, float]
) -> dict[str, Any]:
    """Everything needed to reproduce and interpret the run (``run.json``)."""
    spec = cfg.rescoring_spec()
    return {
        "tool": "mismatch_probe",
        "schema_version": store.SCHEMA_VERSION,
        "config": cfg.to_dict(),
        "setting": cfg.settings()[0].name,
        "settings": [s.name for s in cfg.settings()],
        "sampling": {
            **vars(cfg.sampling),
            "vllm_logprobs_mode": rollout.VLLM_LOGPROBS_MODE[cfg.sampling.logprobs_mode],
            "rescoring": "processed" if spec.processes_logits else "raw",
            "rollout_logprobs": _logprob_source(cfg),
        },
        "rollouts": [run_record(r) for r in runs],
        "model": {
            "path": str(prep.model_dir.resolve()),
            "name": models.model_name(prep.model_dir),
            "source": models.model_source(prep.model_dir),
            "config_sha256": models.config_hash(prep.model_dir),
            **_hub_record(prep),
        },
        "prompts": {
            "path": str(prep.prompts_path),
            "count": len(prep.prompts),
            "chat": prep.chat,
            "sha256": prompts_hash(prep),
        },
        "train_device_map": dict(prep.train_devices),
        "attribution_device_map": dict(prep.attribution_devices),
        "batch_invariant": prep.batch_invariant,
        "versions": library_versions(),
        "hardware": hardware(),
        "timings": dict(timings),
    }


def _hub_record(prep: Prepared) -> dict[str, str]:
    """``hub_id`` and ``revision`` (the commit) of a model read from the Hugging Face cache."""
    from mismatch_probe.models.hub import hub_origin

    origin = hub_origin(prep.model_dir)
    return {"hub_id": origin[0], "revision": origin[1]} if origin else {}


def prompts_hash(prep: Prepared) -> str:
    """sha256 of the prompt token ids the engine saw (file, count, chat template, tokenizer
    together): two runs with the same hash asked the same questions."""
    ids: list[Any] = [list(p.token_ids) for p in prep.prompts]
    ids += [[p.prompt_id, p.turns.after_end, p.turns.after_cut] for p in prep.prompts if p.turns]
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


def _logprob_source(cfg: ScanConfig) -> str:
    if cfg.same_tokens:
        return (
            "prefill (forced continuation of the first setting's tokens): raw log-probs from "
            "prefill kernels; measures numerics only, not sampling"
        )
    return f"decode ({cfg.sampling.logprobs_mode} log-probs of the sampled tokens)"


def run_record(run: RolloutRun) -> dict[str, Any]:
    """A rollout setting's engine run: the arguments and environment its engine was created
    with (recorded at the start; empty when the setting was refused before one started)."""
    return {
        "setting": run.setting.name,
        "engine_args": run.engine_args,
        "engine_env": run.engine_env,
        "engine_mode": run.engine_mode,
        "skipped": run.skipped,
        "generation_seconds": run.generation_seconds,
        "tokens_per_s": run.tokens_per_s,
        **_prefix_cache(run),
    }


def _prefix_cache(run: RolloutRun) -> dict[str, Any]:
    """Multi-turn: how much of the later turns' prompts the engine's prefix cache held."""
    record = turns.prefix_cache_record(run.rollouts)
    return {"prefix_cache": record} if record is not None else {}


def hardware() -> dict[str, Any]:
    """The machine the run ran on (``mismatch_probe.hardware``): CPU model and kernel flags, GPUs,
    and ``compute``, what ``probe check --baseline`` and ``probe compare`` compare."""
    from mismatch_probe import hardware as machine

    return machine.hardware()
