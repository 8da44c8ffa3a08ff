"""The rollout stage: vLLM generates responses and reports each sampled token's log-probability.

This module is the only one that imports vLLM. It takes token-id prompts and a ``SamplingSpec``
and returns ``Rollout`` records (token ids, the engine's log-probabilities, finish reasons). It
knows nothing about transformers or Parquet.

Every sampling parameter is passed explicitly (``generation_config="vllm"`` so the
checkpoint's generation config cannot change them), and each (prompt, sample) request gets its
own seed derived from ``--seed``, so the same run settings give the same tokens.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe import interrupt
from mismatch_probe.engine import process
from mismatch_probe.errors import ProbeError
from mismatch_probe.prompts import EncodedPrompt
from mismatch_probe.sampling import VLLM_LOGPROBS_MODE, SamplingSpec
from mismatch_probe.settings import RolloutSetting

# Defaults for a CPU machine: a small KV-cache budget so the training model fits beside the
# engine, eager mode (no graph capture), and no per-step stats logging.
CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "kv_cache_memory_bytes": 1 << 30,
    "enforce_eager": True,
}
COMMON_ENGINE_DEFAULTS: dict[str, Any] = {"disable_log_stats": True, "use_tqdm_on_load": False}
# On the CPU backend, for a scan whose later requests repeat earlier ones (multi-turn: each turn's
# prompt holds the turns before it). The prefix cache keeps whole KV blocks, and the CPU
# backend's default block is 128 tokens: each later turn recomputed the previous turn's last,
# partial block (up to 127 tokens). 32 is the smallest block it prefers (multiples of 32:
# vllm/platforms/cpu.py); GPU backends default to 16 already. ``make bench multiturn``
# measures it (``docs/speed.md``).
CPU_PREFIX_REUSE_DEFAULTS: dict[str, Any] = {"block_size": 32}
# Environment of every engine (scoped to its life; a value the user set wins): vLLM's own log
# quiet, and model paths are local, so the engine never asks a model hub.
ENGINE_ENV = {"VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1"}
# How an engine runs: in this process (starts in seconds: no process spawn, no second import
# of torch and vLLM; the process state it changes is restored by ``process.preserved``)
# or in its own processes (vLLM's default: an engine-core process and a worker process).
IN_PROCESS, MULTIPROCESS = "in-process", "multiprocess"
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
IN_PROCESS_KWARGS = {"distributed_executor_backend": "uni"}  # the worker in this process too
_WORLD_SIZE_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


@dataclass(frozen=True)
class Turns:
    """A multi-turn trajectory after its prompt (``engine.turns``): ``P0`` is the rollout's
    ``prompt_ids``, ``continuation = G1 + D1 + G2 + ... + Gn`` everything after it.

    Shapes: ``[C]`` continuation ids; ``[R]`` per generated token (the rollout's
    ``response_ids`` are the generated ids of every turn, in order); ``[n]`` per turn.
    """

    continuation: tuple[int, ...]  # [C] generated and given ids after P0
    positions: tuple[int, ...]  # [R] index in ``continuation`` of each generated token
    turn: tuple[int, ...]  # [R] 0-based turn of each generated token
    starts: tuple[int, ...]  # [n] index in ``continuation`` where turn k's generation starts
    finish_reasons: tuple[str, ...]  # [n] each turn's finish reason
    texts: tuple[str, ...]  # [n] each turn's text as the engine decoded it
    cached_tokens: tuple[int, ...]  # [n] prompt tokens of each turn's request the prefix cache held
    messages: tuple[dict[str, Any], ...] = ()  # the prompt's messages (open turns: no content)
    block_size: int = 0  # the engine's KV-cache block size (0: unknown)


@dataclass
class Rollout:
    """One sampled response (a multi-turn trajectory's generated tokens, with ``turns``)."""

    seq_id: int
    prompt_id: int
    sample_id: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # engine's log-prob of each response token
    finish_reason: str
    response_text: str
    routed_experts: Any = None  # vLLM's native MoE routes, where the engine returns them
    turns: Turns | None = None  # a multi-turn trajectory's layout (None: one turn)

    def continuation(self) -> list[int]:
        """``[C]`` every id after the prompt: the response, or ``G1 + D1 + ... + Gn``."""
        return list(self.turns.continuation) if self.turns else list(self.response_ids)

    def scored_positions(self) -> list[int]:
        """``[R]`` index in ``continuation()`` of each response token."""
        return list(self.turns.positions) if self.turns else list(range(len(self.response_ids)))


def parse_engine_args(items: Sequence[str]) -> dict[str, Any]:
    """``["key=value", ...]`` -> kwargs; values are JSON when they parse, strings otherwise."""
    args: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ProbeError(f"--vllm-arg expects key=value, got {item!r}")
        try:
            args[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            args[key.strip()] = value
    return args


class EngineStartError(ProbeError):
    """The engine cannot start with this setting (e.g. fp8 weights on a CPU backend)."""


class EngineError(ProbeError):
    """The engine failed after it started (while it generated or scored)."""


@contextmanager
def running(what: str) -> Iterator[None]:
    """Calls into a started engine: a failure of the engine (vLLM raises many types, and an
    engine process only says "see root cause above") becomes one line naming its cause and
    ``what`` the engine was doing; the whole traceback goes to the engine log."""
    log = process.current_log()
    offset = log.stat().st_size if log is not None and log.is_file() else 0
    try:
        yield
    except ProbeError:
        raise
    except Exception as exc:
        interrupt.reraise_swallowed()
        reason = _start_failure(exc, log, offset)
        raise EngineError(f"vLLM failed during {what}: {reason}") from None


def engine_kwargs(
    model: Path,
    setting: RolloutSetting,
    spec: SamplingSpec,
    max_model_len: int,
    extra: dict[str, Any],
    prefix_reuse: bool = False,
) -> dict[str, Any]:
    """All arguments for ``vllm.LLM``, later entries winning: platform defaults, our explicit
    settings, the precision setting's overrides, then the user's ``--vllm-arg`` values.
    ``prefix_reuse``: later requests repeat earlier ones (a multi-turn scan), so the platform's
    prefix-cache defaults apply too."""
    from vllm.platforms import current_platform

    defaults = dict(COMMON_ENGINE_DEFAULTS)
    if current_platform.is_cpu():
        defaults.update(CPU_ENGINE_DEFAULTS)
        defaults.update(CPU_PREFIX_REUSE_DEFAULTS if prefix_reuse else {})
        if all(int(extra.get(name, 1)) == 1 for name in _WORLD_SIZE_ARGS):
            defaults.update(IN_PROCESS_KWARGS)  # one worker: in this process
    return {
        **defaults,
        "model": str(model),
        "logprobs_mode": VLLM_LOGPROBS_MODE[spec.logprobs_mode],
        "generation_config": "vllm",
        "seed": spec.seed,
        "max_model_len": max_model_len,
        **setting.engine_overrides(),
        **extra,
    }


def cpu_fp8_kv_cache_supported() -> bool:
    """Whether vLLM's CPU attention can hold an fp8 KV cache here: on x86 it needs AVX-512 or
    AMX (``vllm/v1/attention/backends/cpu_attn.py``); an AVX2-only CPU cannot."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def check_supported(setting: RolloutSetting) -> None:
    """Refuse, before a 25-second start, what this backend is known not to run."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    kv_fp8 = cpu_fp8_kv_cache_supported()
    if setting.quantization == "fp8":
        instead = "; use --kv-cache-dtype fp8 for an fp8 KV cache instead" if kv_fp8 else ""
        raise EngineStartError(
            "fp8 weight quantization is not supported by the vLLM CPU backend (its FP8 GEMM "
            f"kernels need a GPU){instead}"
        )
    if setting.kv_cache_dtype.startswith("fp8") and not kv_fp8:
        raise EngineStartError(
            "an fp8 KV cache needs AVX-512 or AMX on the vLLM CPU backend, and this CPU has "
            "neither (AVX2 only); it runs on GPUs and on AVX-512 CPUs"
        )


def engine_env(
    extra: dict[str, str] | None = None, kwargs: dict[str, Any] | None = None
) -> dict[str, str]:
    """The environment variables an engine starts with: ours (quiet logs, never a model hub,
    in-process where ``kwargs`` ask for vLLM's single-process executor) unless the user set
    them, then ``extra`` (e.g. what MoE route capture needs)."""
    ours = dict(ENGINE_ENV)
    if kwargs is not None and kwargs.get("distributed_executor_backend") == "uni":
        ours[MULTIPROCESSING_ENV] = "0"
    ours = {key: value for key, value in ours.items() if key not in os.environ}
    return {**ours, **(extra or {})}


def engine_mode(env: dict[str, str]) -> str:
    """``in-process`` or ``multiprocess``: how an engine started under ``env`` runs."""
    value = env.get(MULTIPROCESSING_ENV, os.environ.get(MULTIPROCESSING_ENV, "1"))
    return IN_PROCESS if value.strip().lower() in ("0", "false") else MULTIPROCESS


@contextmanager
def scoped_env(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` for the engine's creation and life; restore the process environment after.

    vLLM reads its variables lazily but caches them (``vllm.envs``) once an in-process engine
    has started: the cache is cleared on entry and on exit so that each engine of a process
    sees the environment it was created in.
    """
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    _clear_vllm_env_cache()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _clear_vllm_env_cache()


def _clear_vllm_env_cache() -> None:
    import vllm.envs

    reset = getattr(vllm.envs, "disable_envs_cache", None)
    if reset is not None:
        reset()


@contextmanager
def engine(kwargs: dict[str, Any], env: dict[str, str] | None = None) -> Iterator[Any]:
    """A started ``vllm.LLM`` (created with ``kwargs`` under the environment ``env``, default
    ``engine_env(kwargs=kwargs)``), shut down (engine processes and memory) on exit; the
    process state the engine changed (threads, affinity, NUMA policy, environment) is restored.
    """
    with process.preserved(), scoped_env(engine_env(kwargs=kwargs) if env is None else env):
        with process.importing():
            from vllm import LLM  # its modules frozen with the heap (below, or by the scan's)

            from mismatch_probe.engine import seeded  # seeded requests through partial prefills

        log = process.current_log()
        offset = log.stat().st_size if log is not None and log.is_file() else 0
        with process.frozen_heap():
            try:
                llm = LLM(**{"worker_extension_cls": seeded.EXTENSION, **kwargs})
            except Exception as exc:  # vLLM raises many types for an engine that cannot start
                interrupt.reraise_swallowed()
                reason = _start_failure(exc, log, offset)
                raise EngineStartError(f"vLLM could not start the engine: {reason}") from None
            try:
                yield llm
            finally:
                shutdown(llm)
                del llm
                gc.collect()  # the engine gone: what its cycles held is freed (the rest frozen)


def shutdown(llm: Any) -> None:
    """Stop the engine (its processes, if any). vLLM's teardown runs two full garbage
    collections of its own (each about a second with torch, transformers and vLLM loaded)
    while the engine object is still referenced: they are skipped; ``engine`` collects once,
    after the engine is dropped."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        with process.collect_later():
            core.shutdown()


def _start_failure(exc: BaseException, log: Path | None, offset: int) -> str:
    """The real cause on one line: the exception itself in process; for an engine process that
    failed, the last exception its log got since ``offset`` (vLLM's own message only says
    "see root cause above"). The log file is named where there is one."""
    text = process.describe_exception(exc)
    if log is not None:  # the whole traceback beside the engine's own output
        process.append_traceback(log, exc)
    if process.is_wrapper(text):
        text = process.root_cause(log, offset) or text
    text = text[:400]
    return f"{text} (engine log: {log})" if log is not None else text


def request_seed(spec: SamplingSpec, prompt_id: int, sample_id: int) -> int:
    """A distinct, reproducible seed per (prompt, sample) request."""
    return (spec.seed * 1_000_003 + prompt_id * 1_009 + sample_id) % (2**31)


def generate(
    llm: Any,
    prompts: Sequence[EncodedPrompt],
    spec: SamplingSpec,
    samples_per_prompt: int,
    progress: Callable[..., Any] | bool = False,
) -> list[Rollout]:
    """Sample ``samples_per_prompt`` responses per prompt, one request (own seed) each.

    Returns:
        Rollouts ordered by (prompt, sample); ``seq_id`` is that order's index.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    jobs = [(p, s) for p in prompts for s in range(samples_per_prompt)]
    params = [_sampling_params(SamplingParams, spec, p.prompt_id, s) for p, s in jobs]
    inputs = [TokensPrompt(prompt_token_ids=list(p.token_ids)) for p, _ in jobs]
    with running("generation"):
        outputs = llm.generate(inputs, params, use_tqdm=progress)
    return [
        _to_rollout(seq_id, p, s, out.outputs[0])
        for seq_id, ((p, s), out) in enumerate(zip(jobs, outputs, strict=True))
    ]


def _sampling_params(cls: Any, spec: SamplingSpec, prompt_id: int, sample_id: int) -> Any:
    return cls(
        n=1,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k if spec.top_k > 0 else -1,
        min_p=0.0,
        repetition_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        max_tokens=spec.max_tokens,
        seed=request_seed(spec, prompt_id, sample_id),
        logprobs=0,  # the sampled token's log-probability only
        detokenize=True,
    )


def _to_rollout(seq_id: int, prompt: EncodedPrompt, sample_id: int, out: Any) -> Rollout:
    ids = list(out.token_ids)
    logprobs = [float(step[tok].logprob) for tok, step in zip(ids, out.logprobs, strict=True)]
    return Rollout(
        seq_id=seq_id,
        prompt_id=prompt.prompt_id,
        sample_id=sample_id,
        prompt_ids=list(prompt.token_ids),
        response_ids=ids,
        rollout_logprobs=logprobs,
        finish_reason=str(out.finish_reason or "unknown"),
        response_text=out.text,
        routed_experts=getattr(out, "routed_experts", None),
    )


def score_forced(llm: Any, rollouts: Sequence[Rollout]) -> list[list[float]]:
    """The engine's log-probabilities of given responses, fed as forced continuations.

    Each prompt + response is one prompt; vLLM's prompt log-probabilities (``prompt_logprobs=0``:
    the actual token's) are *raw* (no temperature, top-k, top-p) and come from prefill kernels.

    Returns:
        Per rollout, ``[R]`` log-probabilities of its response tokens.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=[*r.prompt_ids, *r.continuation()]) for r in rollouts]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    with running("forced scoring"):
        outputs = llm.generate(inputs, params, use_tqdm=False)
    scores = []
    for r, out in zip(rollouts, outputs, strict=True):
        steps = out.prompt_logprobs[len(r.prompt_ids) :]
        at = r.scored_positions()  # a multi-turn trajectory: its generated tokens only
        scores.append(
            [float(steps[i][tok].logprob) for tok, i in zip(r.response_ids, at, strict=True)]
        )
    return scores
