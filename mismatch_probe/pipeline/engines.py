"""The engine stage of ``probe scan``: one vLLM engine per rollout setting, in turn.

Each rollout setting's engine is started (``_started``: a setting the backend cannot run is a
skip, or an error with ``--strict``), produces its tokens, and goes through the one post-engine
step (``_after_engine``: the attribution prefill rungs under ``--attribute``, the routes of an
MoE model; each a no-op where it does not apply), then shuts down before the next starts. The
tokens come from sampling, or with ``same_tokens`` from scoring the first setting's sampled
tokens as forced continuations (raw prefill log-probabilities), so that settings differ only by
numerics. This stage knows nothing of the training side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any

from mismatch_probe import interrupt, models
from mismatch_probe.engine import batch_invariant, process, rollout, turns
from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline import attribution, layers, routes
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.records import Prepared, RolloutRun
from mismatch_probe.pipeline.timing import Timer
from mismatch_probe.progress import vllm_progress

# What an engine does with the prompts: (engine, run) -> (rollouts, seconds), timed inside.
Produce = Callable[[Any, RolloutRun], tuple[list[rollout.Rollout], float]]


def run_engines(
    cfg: ScanConfig, prep: Prepared, timer: Timer, progress: Any, console: Any
) -> list[RolloutRun]:
    """Every rollout setting's engine run on ``prep.prompts``, in the scan's order.

    Raises:
        ProbeError: ``same_tokens`` and the first setting could not run; ``--strict`` and a
            setting the backend cannot run.
    """
    settings = cfg.rollout_settings()
    sample = _sampler(cfg, prep, timer, progress)
    with _engine_output(cfg, console):
        if not cfg.same_tokens:
            return [_engine_run(cfg, prep, RolloutRun(s), timer, sample) for s in settings]
        reference = _engine_run(cfg, prep, RolloutRun(settings[0]), timer, sample, post=False)
        if not reference.rollouts:
            raise ProbeError(f"--same-tokens: the first setting did not run ({reference.skipped})")
        forced = _forced(reference.rollouts, timer)
        return [_engine_run(cfg, prep, RolloutRun(s), timer, forced) for s in settings]


def _engine_run(
    cfg: ScanConfig,
    prep: Prepared,
    run: RolloutRun,
    timer: Timer,
    produce: Produce,
    post: bool = True,
) -> RolloutRun:
    """Start ``run``'s engine, produce its tokens, then the post-engine step (unless ``post``
    is off: the reference sampling of ``same_tokens``, whose tokens every engine scores again)."""
    with _started(cfg, prep, run, timer) as llm:
        if llm is None:
            return run  # skipped: no tokens
        run.rollouts, run.generation_seconds = produce(llm, run)
        if post:
            _after_engine(cfg, prep, llm, run, timer)
    return run


def _after_engine(cfg: ScanConfig, prep: Prepared, llm: Any, run: RolloutRun, timer: Timer) -> None:
    """The one post-engine step of sampling and same-tokens scoring, while the engine is up:
    the prefill rungs (``--attribute``) and the routes (MoE); no-ops where they don't apply."""
    run.rungs = attribution.engine_step(cfg, llm, run.rollouts, timer)
    run.routes = routes.capture(llm, run.rollouts, prep.routing, timer)
    layers.engine_step(cfg, llm, run, timer)  # --layers: the engine's streams


def _sampler(cfg: ScanConfig, prep: Prepared, timer: Timer, progress: Any) -> Produce:
    def sample(llm: Any, run: RolloutRun) -> tuple[list[rollout.Rollout], float]:
        # multi-turn: one step per turn of every trajectory, so that every turn shows
        total = turns.request_count(prep.prompts, cfg.samples_per_prompt)
        unit = "turns" if turns.multi_turn(prep.prompts) else "responses"
        bar = vllm_progress(progress, f"gen {run.setting.name}", total, unit)
        start = time.perf_counter()
        with interrupt.stage("generation"):
            rollouts = turns.generate(llm, prep.prompts, cfg.sampling, cfg.samples_per_prompt, bar)
        seconds = time.perf_counter() - start
        timer.add("generation", seconds)
        return rollouts, seconds

    return sample


def _forced(reference: list[rollout.Rollout], timer: Timer) -> Produce:
    def score(llm: Any, run: RolloutRun) -> tuple[list[rollout.Rollout], float]:
        with timer("forced_scoring"):
            start = time.perf_counter()
            scores = rollout.score_forced(llm, reference)
            seconds = time.perf_counter() - start
        rollouts = [
            replace(r, rollout_logprobs=lp) for r, lp in zip(reference, scores, strict=True)
        ]
        return rollouts, seconds

    return score


@contextmanager
def _engine_output(cfg: ScanConfig, console: Any) -> Iterator[None]:
    """The engines' output goes to a log file under the cache (named in an engine error), or
    to the terminal with ``verbose``; ``console`` (the progress bars) stays on the terminal."""
    if cfg.verbose:
        yield
        return
    log = process.new_log_path(models.cache_dir() / "logs")
    with process.captured(log) as terminal:
        if not process.writes_to_fd(console.file, 2):
            yield  # an in-memory console (tests) keeps its buffer
            return
        saved = console.file
        console.file = terminal
        try:
            yield
        finally:
            console.file = saved


@contextmanager
def _started(cfg: ScanConfig, prep: Prepared, run: RolloutRun, timer: Timer) -> Iterator[Any]:
    """The setting's engine (set up for route capture for an MoE model), or ``None`` when the
    backend cannot run the setting (recorded as a skip; an error with ``--strict``)."""
    stack = ExitStack()
    llm = None
    try:
        with timer("engine_start"):
            rollout.check_supported(run.setting)
            extra = {**prep.engine_defaults, **layers.engine_kwargs(cfg), **cfg.vllm_args}
            kwargs = rollout.engine_kwargs(
                prep.model_dir,
                run.setting,
                cfg.sampling,
                prep.max_model_len,
                extra,
                prefix_reuse=turns.multi_turn(prep.prompts),
            )
            run.engine_args = {**kwargs, **routes.engine_kwargs(prep.routing)}
            env = {
                **routes.engine_env(prep.routing),
                **batch_invariant.engine_env(cfg.batch_invariant),
                **layers.engine_env(cfg),
            }
            run.engine_env = rollout.engine_env(env, run.engine_args)
            run.engine_mode = rollout.engine_mode(run.engine_env)
            llm = stack.enter_context(rollout.engine(run.engine_args, run.engine_env))
    except rollout.EngineStartError as exc:
        stack.close()
        if cfg.strict:
            raise ProbeError(f"{run.setting.name}: {exc}") from None
        run.skipped = str(exc)
    try:
        yield llm
    finally:
        with timer("engine_stop"):
            stack.close()
