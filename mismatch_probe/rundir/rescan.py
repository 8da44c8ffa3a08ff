"""The command that re-scans one response's prompt: ``probe scan --prompt-id P ...``.

Built from ``run.json`` (the scan's ``ScanConfig`` and sampling): the same model, prompts file,
sampling, seed, chat template and the outlier's own precision setting, with ``--prompt-id``
and ``--samples-per-prompt sample_id + 1``. Each request's seed depends only on (seed,
prompt_id, sample_id) (``engine.rollout.request_seed``), so the re-scan samples the same
response where the numerics are deterministic (an fp32 scan: tested).

Paths are written so that a report holds no absolute path of the machine: relative to the
working directory when below it, ``~/...`` when below the home directory, else ``<name>`` (a
placeholder the reader replaces). No command for an ingested run (nothing to re-scan), a run
without ``prompt_id``, or a ``--same-tokens`` setting that scored another setting's tokens.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from mismatch_probe.settings import Setting, rollout_settings, settings

DEFAULT_BATCH_TOKENS = 2048  # ScanConfig's default (the report does not import the pipeline)


def portable_path(path: str | Path, cwd: Path | None = None) -> str:
    """``path`` as a shell word without the machine's absolute path (see the module doc)."""
    p = Path(path)
    base = (cwd or Path.cwd()).resolve()
    if p.is_relative_to(base):
        return shlex.quote(p.relative_to(base).as_posix() or ".")
    home = Path.home()
    if p.is_relative_to(home):
        return "~/" + shlex.quote(p.relative_to(home).as_posix())
    return shlex.quote(f"<{p.name}>")


def _setting(config: dict[str, Any], name: str) -> Setting | None:
    try:
        rollouts = rollout_settings(
            config["rollout_dtypes"],
            config.get("kv_cache_dtypes", ("auto",)),
            config.get("quantizations", ("none",)),
            config.get("lm_head_fp32", (False,)),
        )
        every = settings(rollouts, config["train_dtypes"], config.get("routing_replay", ("none",)))
    except (KeyError, TypeError):
        return None
    return next((s for s in every if s.name == name), None)


def _setting_args(s: Setting) -> list[str]:
    args = ["--rollout-dtype", s.rollout.dtype, "--train-dtype", s.train_dtype]
    if s.rollout.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", s.rollout.kv_cache_dtype]
    if s.rollout.quantization != "none":
        args += ["--quantization", s.rollout.quantization]
    if s.rollout.lm_head_fp32:
        args += ["--lm-head-fp32", "on"]
    if s.replay != "none":
        args += ["--routing-replay", s.replay]
    return args


def _sampling_args(sampling: dict[str, Any]) -> list[str]:
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs_mode")
    return [
        word
        for name in names
        if name in sampling
        for word in (f"--{name.replace('_', '-')}", str(sampling[name]))
    ]


def _config_args(config: dict[str, Any], chat: Any) -> list[str]:
    args = [] if chat is None else ["--chat" if chat else "--no-chat"]
    for key, value in (config.get("vllm_args") or {}).items():
        args += ["--vllm-arg", f"{key}={json.dumps(value)}"]
    if config.get("batch_tokens", DEFAULT_BATCH_TOKENS) != DEFAULT_BATCH_TOKENS:
        args += ["--batch-tokens", str(config["batch_tokens"])]
    if config.get("flip_eps") is not None:
        args += ["--flip-eps", str(config["flip_eps"])]
    return args


def rescan_command(
    run: dict[str, Any], outlier: dict[str, Any], cwd: Path | None = None
) -> str | None:
    """``probe scan ...`` re-scanning the prompt of ``outlier`` (an ``outliers`` record), or
    None when the run cannot be re-scanned (see the module docstring)."""
    config = run.get("config")
    prompt_id, sample_id = outlier.get("prompt_id"), outlier.get("sample_id")
    if run.get("kind") == "ingest" or not isinstance(config, dict) or prompt_id is None:
        return None
    name = outlier.get("setting") or run.get("setting")
    setting = _setting(config, name) if isinstance(name, str) else None
    if setting is None:
        return None
    if config.get("same_tokens") and name != (run.get("settings") or [name])[0]:
        return None  # its tokens were sampled by the first setting's engine
    words = ["probe", "scan", "--prompt-id", str(prompt_id)]
    words += ["--samples-per-prompt", str((sample_id or 0) + 1)]
    words += _setting_args(setting) + _sampling_args(run.get("sampling", {}))
    words += _config_args(config, run.get("prompts", {}).get("chat", config.get("chat")))
    if config.get("batch_invariant"):  # an environment variable of the engine, not an option
        words += ["--vllm-arg", "VLLM_BATCH_INVARIANT=1"]
    model = run.get("model", {})
    hub = model.get("hub_id")  # a hub id stays one (its path is this machine's cache)
    if hub:
        words += ["--model", f"{hub}@{model['revision']}" if model.get("revision") else hub]
    keys = ("prompts",) if hub else ("model", "prompts")
    paths = [(f"--{key}", config.get(key)) for key in keys]
    quoted = [shlex.quote(w) for w in words]
    quoted += [f"{flag} {portable_path(p, cwd)}" for flag, p in paths if p]
    return " ".join(quoted)
