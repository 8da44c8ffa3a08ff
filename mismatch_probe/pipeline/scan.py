"""``probe scan``: the pipeline, stage by routes.

prompts -> rollout engine (vLLM) -> training-side rescorer (transformers) -> token store
(Parquet) -> metrics. Everything that can be wrong with the input (model, prompts, options) is
checked before any engine starts.

A scan runs one or more precision *settings* (``settings.py``). Work is shared: one engine per
rollout setting (started, used, shut down in turn, so the training model never shares memory
with an engine), then one training model per training dtype, which rescores every rollout
setting's tokens. With ``same_tokens`` the first rollout setting samples and every engine scores
those tokens as forced continuations (raw prefill log-probabilities), so that settings differ
only by numerics.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from mismatch_probe import interrupt, models, store
from mismatch_probe.engine import batch_invariant, process, rollout, turns
from mismatch_probe.errors import ProbeError
from mismatch_probe.models.checkpoint import check_weights
from mismatch_probe.pipeline import attribution, routes, trajectory
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.records import Prepared, Rescored, RolloutRun, ScanResult
from mismatch_probe.pipeline.runinfo import run_metadata
from mismatch_probe.pipeline.tables import sequence_table, token_table
from mismatch_probe.progress import make_progress, vllm_progress
from mismatch_probe.prompts import default_prompts_path, encode_prompts, load_prompts
from mismatch_probe.settings import RolloutSetting, Setting
from mismatch_probe.training import rescore

if TYPE_CHECKING:
    from mismatch_probe.metrics import MetricsResult


class Timer:
    """Wall-clock seconds per phase: ``with timer("generation"): ...`` (also names the stage an
    interrupt reports)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with interrupt.stage(phase):
                yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def prepare(cfg: ScanConfig) -> Prepared:
    """Check the options the backend must support, resolve the model, load the tokenizer, read
    and encode the prompts (no engine yet)."""
    with process.importing():
        from transformers import AutoConfig, AutoTokenizer

        process.import_vllm_quietly(cfg.verbose)  # before anything else touches vLLM
    attribution.check(cfg)
    invariant = batch_invariant.check(cfg.batch_invariant)
    model_dir = models.resolve_model(cfg.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:300]
        raise ProbeError(f"transformers could not load {model_dir}: {reason}") from None
    check_weights(model_dir)  # what the engine will load, checked before it starts
    routing = routes.prepare(config, cfg.routing_replay)
    context = _context_length(config, tokenizer)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.chat and not has_template:
        raise ProbeError(f"--chat: the tokenizer of {model_dir} has no chat template")
    chat = has_template if cfg.chat is None else cfg.chat
    prompts_path = (cfg.prompts or default_prompts_path()).resolve()
    raw = load_prompts(prompts_path, cfg.num_prompts)
    encoded = encode_prompts(raw, tokenizer, chat, context, cfg.sampling.max_tokens)
    trajectory.check(encoded, routing)
    # +1: a forced continuation (--same-tokens) asks for one token after a full response
    longest = max(p.longest_trajectory(cfg.sampling.max_tokens) for p in encoded) + 1
    max_len = min(context, longest)
    return Prepared(model_dir, prompts_path, chat, encoded, max_len, tokenizer, routing, invariant)


def _context_length(config: Any, tokenizer: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None) or getattr(
            getattr(config, "text_config", None), name, None
        )
        if isinstance(value, int) and value > 0:
            return value
    return int(min(tokenizer.model_max_length, 1 << 20))


@process.frozen_heap()  # no collection of the scan traverses what existed before it
def run_scan(cfg: ScanConfig, console: Any) -> ScanResult:
    """Run the whole pipeline and write the token store (``store.TOKENS_FILE``,
    ``SEQUENCES_FILE``), the metrics (``METRICS_FILE``, ``SETTINGS_FILE``), ``RUN_FILE`` and the
    reports into the output directory (plus ``ROUTING_FILE`` and ``ROUTING_METRICS_FILE`` for a
    mixture-of-experts model). A sharded scan is ``sharding.run_sharded``."""
    from mismatch_probe.report import load_report, write_outputs

    if cfg.sharded:
        raise ProbeError("a sharded scan (shards > 1) runs with sharding.run_sharded")
    timer = Timer()
    started = time.time()
    with timer("prepare"):
        prep = prepare(cfg)
        out = check_out(cfg, cfg.out_dir(prep.model_dir.name))
    with make_progress(console) as progress:
        runs, scored = sample_and_rescore(cfg, prep, timer, progress, console)
    with timer("writing"):
        interrupt.writing_to(out, started)
        run = run_metadata(cfg, prep, runs, timer.seconds)
        paths = write_store(out, scored, prep.tokenizer, run)
        if prep.routing is not None:
            paths.update(routes.write_routing(out, scored, prep.routing, run))
        else:
            routes.remove_outputs(out)  # an earlier MoE run's routing files in the same --out
    with timer("metrics"):
        results = setting_metrics(paths["tokens"], scored)
        flat = settings_json(paths, results, {r.setting: r.tokens_per_s for r in runs})
        if prep.routing is not None:
            paths.update(routes.routing_outputs(out, list(scored)))
    paths["run"] = out / store.RUN_FILE
    with timer("reports"):
        computed = {s.name: m.to_json_dict() for s, m in results.items()}
        report, entries = load_report(out, computed=computed)
        paths.update(write_outputs(report, entries))
    run["timings"] = dict(timer.seconds)
    with interrupt.stage("writing"):
        store.write_json(paths["run"], run)
    skipped = {r.setting.name: r.skipped for r in runs if r.skipped}
    return ScanResult(out, paths, run, flat, skipped, report, entries)


def check_out(cfg: ScanConfig, out: Path) -> Path:
    """The output directory, created and proven writable before any engine starts (a scan
    must not run for minutes to fail at its first write). One that holds a run already is
    refused unless ``cfg.force``: its files would be replaced."""
    held = [name for name in (store.RUN_FILE, store.TOKENS_FILE) if (out / name).exists()]
    if held and not cfg.force:
        raise ProbeError(
            f"--out {out} holds a run already ({held[0]}); choose another directory, or give "
            "--force to replace its files"
        )
    return store.writable_dir(out, "--out")


def sample_and_rescore(
    cfg: ScanConfig, prep: Prepared, timer: Timer, progress: Any, console: Any
) -> tuple[list[RolloutRun], dict[Setting, Rescored]]:
    """The engine and training stages: every rollout setting sampled (or scored on the first
    setting's tokens with ``same_tokens``), the engines' output captured (``_engine_output``),
    then every setting rescored (with the attribution rungs under ``--attribute``). Used by a
    whole scan and by each shard of a sharded one."""
    with _engine_output(cfg, console):
        runs = [_generate(cfg, prep, r, timer, progress) for r in cfg.rollout_settings()]
        if cfg.same_tokens:
            _share_tokens(cfg, prep, runs, timer)
    return runs, _rescore_all(cfg, prep, runs, timer, progress)


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
            extra = {**turns.engine_defaults(prep.prompts), **cfg.vllm_args}
            kwargs = rollout.engine_kwargs(
                prep.model_dir, run.setting, cfg.sampling, prep.max_model_len, extra
            )
            run.engine_args = {**kwargs, **routes.engine_kwargs(prep.routing)}
            env = {
                **routes.engine_env(prep.routing),
                **batch_invariant.engine_env(cfg.batch_invariant),
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


def _generate(
    cfg: ScanConfig, prep: Prepared, setting: RolloutSetting, timer: Timer, progress: Any
) -> RolloutRun:
    """Start this setting's engine and sample; a setting the backend can't run is skipped."""
    run = RolloutRun(setting)
    if cfg.same_tokens and setting != cfg.rollout_settings()[0]:
        return run  # scored on the reference tokens by _share_tokens
    total = len(prep.prompts) * cfg.samples_per_prompt
    with _started(cfg, prep, run, timer) as llm:
        if llm is None:
            return run
        start = time.perf_counter()
        bar = vllm_progress(progress, f"gen {setting.name}", total)
        with interrupt.stage("generation"):
            run.rollouts = turns.generate(
                llm, prep.prompts, cfg.sampling, cfg.samples_per_prompt, bar
            )
        run.generation_seconds = time.perf_counter() - start
        timer.seconds["generation"] = timer.seconds.get("generation", 0.0) + run.generation_seconds
        if cfg.attribute:
            with timer("attribution_prefill"):
                run.rungs = attribution.engine_rungs(llm, run.rollouts)
        if prep.routing is not None and not cfg.same_tokens:
            with timer("route_capture"):
                run.routes = routes.capture(llm, run.rollouts, prep.routing)
    return run


def _share_tokens(cfg: ScanConfig, prep: Prepared, runs: list[RolloutRun], timer: Timer) -> None:
    """Score the reference setting's tokens in every engine (forced continuations)."""
    reference = runs[0].rollouts
    if not reference:
        raise ProbeError(f"--same-tokens: the first setting did not run ({runs[0].skipped})")
    for run in runs:
        with _started(cfg, prep, run, timer) as llm:
            if llm is None:
                run.rollouts = []  # the reference's own sampled log-probs are not comparable
                continue
            with timer("forced_scoring"):
                start = time.perf_counter()
                scores = rollout.score_forced(llm, reference)
                run.generation_seconds = time.perf_counter() - start
            if cfg.attribute:
                with timer("attribution_prefill"):
                    run.rungs = attribution.engine_rungs(llm, reference)
            if prep.routing is not None:
                with timer("route_capture"):
                    run.routes = routes.capture(llm, reference, prep.routing)
        run.rollouts = [
            replace(r, rollout_logprobs=lp) for r, lp in zip(reference, scores, strict=True)
        ]


def _rescore_all(
    cfg: ScanConfig, prep: Prepared, runs: list[RolloutRun], timer: Timer, progress: Any
) -> dict[Setting, Rescored]:
    """One training model per dtype rescores every rollout setting that ran, once per routing
    replay mode."""
    done = [r for r in runs if r.rollouts]
    if not done:
        reasons = "; ".join(f"{r.setting.name}: {r.skipped}" for r in runs)
        raise ProbeError(f"no setting could run ({reasons})")
    scored: dict[Setting, Rescored] = {}
    for train_dtype in cfg.train_dtypes:
        with timer("model_load"):
            model = rescore.load_model(prep.model_dir, train_dtype, cfg.train_device_map)
            prep.train_devices[train_dtype] = model.probe_device_map
        for run, mode in itertools.product(done, cfg.routing_replay):
            setting = Setting(run.setting, train_dtype, mode)
            with timer("rescoring"):
                scored[setting] = _rescore_one(cfg, prep, model, run, setting, progress)
        del model
    order = {s: i for i, s in enumerate(cfg.settings())}
    ordered = dict(sorted(scored.items(), key=lambda item: order[item[0]]))
    offset = 0
    for rescored in ordered.values():  # each setting gets its own seq_id range
        rescored.seq_offset, offset = offset, offset + len(rescored.rollouts)
    if cfg.attribute:
        with timer("attribution_rescoring"):
            attribution.add_train_rungs(cfg, prep, done, ordered)
    return ordered


def _rescore_one(
    cfg: ScanConfig, prep: Prepared, model: Any, run: RolloutRun, setting: Setting, progress: Any
) -> Rescored:
    requests = [trajectory.score_request(r) for r in run.rollouts]
    total = sum(len(r.response_ids) for r in run.rollouts)
    task = progress.add_task(f"score {setting.name}", total=total, unit="tokens")
    routing = routes.train_routing(model, requests, prep.routing, setting.replay, run.routes)
    result = rescore.rescore(
        model,
        requests,
        cfg.rescoring_spec(),
        cfg.flip_eps_for(setting),
        cfg.batch_tokens,
        on_batch=partial(_advance, progress, task),
        batch_context=routing.batch if routing else None,
    )
    return Rescored(run.rollouts, result, run.routes, routing.recorded if routing else None)


def _advance(progress: Any, task: Any, n: int) -> None:
    progress.update(task, advance=n)


def store_tables(scored: dict[Setting, Rescored], tokenizer: Any) -> tuple[pa.Table, pa.Table]:
    """The token and sequence tables of every setting (each setting's sequences contiguous,
    with their own seq_id range; the ``--attribute`` rung columns where present)."""
    tokens, sequences = [], []
    for setting, r in scored.items():
        table = token_table(setting.name, r.rollouts, r.scored, tokenizer, r.seq_offset)
        tokens.append(attribution.with_rungs(table, r.rungs) if r.rungs else table)
        sequences.append(sequence_table(setting.name, r.rollouts, tokenizer, r.seq_offset))
    return pa.concat_tables(tokens, promote_options="default"), pa.concat_tables(sequences)


def write_store(
    out: Path, scored: dict[Setting, Rescored], tokenizer: Any, run: dict[str, Any]
) -> dict[str, Path]:
    """Write ``tokens.parquet`` and ``sequences.parquet`` (atomically), every setting in one
    file."""
    paths = {"tokens": out / store.TOKENS_FILE, "sequences": out / store.SEQUENCES_FILE}
    write_tables(paths["tokens"], paths["sequences"], *store_tables(scored, tokenizer), run)
    return paths


def write_tables(
    tokens_path: Path, sequences_path: Path, tokens: pa.Table, sequences: pa.Table, run: Any
) -> None:
    """The two tables of ``store_tables`` into their files (or a shard's parts), atomically."""
    store.write_table(tokens_path, tokens, store.token_schema(tokens.column_names), run)
    store.write_table(sequences_path, sequences, store.sequence_schema(sequences.column_names), run)


def setting_metrics(tokens: Path, settings: Iterable[Setting]) -> dict[Setting, MetricsResult]:
    """Every setting's metrics (default ``MetricsConfig``), computed once: the reports and
    ``settings.json`` are made from these."""
    from mismatch_probe.metrics import MetricsConfig, compute_metrics

    return {s: compute_metrics(tokens, MetricsConfig(), setting=s.name) for s in settings}


def settings_json(
    paths: dict[str, Path],
    results: dict[Setting, MetricsResult],
    speed: dict[RolloutSetting, float],
) -> dict[str, dict[str, float]]:
    """``settings.json``: every setting's flat metrics with its rollout setting's generation
    throughput (``speed``, tokens/s), least mismatch (``k3_kl``) first. Returns the same flat
    metrics in the scan's setting order."""
    flat = {
        s.name: {**m.flat(), "rollout_tokens_per_s": speed[s.rollout]} for s, m in results.items()
    }
    ranked = dict(sorted(flat.items(), key=lambda item: item[1]["k3_kl"]))
    paths["settings"] = paths["tokens"].with_name(store.SETTINGS_FILE)
    store.write_json(paths["settings"], {"order": list(ranked), "settings": ranked})
    return flat
