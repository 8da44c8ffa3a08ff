"""``probe scan``: the one pipeline of a scan, whole or sharded.

prompts -> rollout engines (vLLM, ``engines``) -> training-side rescoring (transformers,
``rescoring``) -> token store (Parquet) -> metrics -> reports. A scan is: ``prepare`` (every path
and option value checked by ``check_inputs`` before vLLM or transformers is imported, then the
tokenizer and the prompts), ``run_range`` on a range of prompts (engines, rescoring, the optional
parts: attribution rungs, MoE routes, each a no-op where it does not apply; then the range's
tables written), and ``finish`` (the metrics once, ``settings.json``, the reports, handed the run
metadata in memory, then ``run.json``). A whole scan (``run_scan``) is the one-range case; a
sharded scan (``sharding.run_sharded``) runs ``run_range`` once per shard, then the same
``finish``.

A scan runs one or more precision *settings* (``settings.py``). Work is shared: one engine per
rollout setting (started, used, shut down in turn, so the training model never shares memory
with an engine), then one training model per training dtype, which rescores every rollout
setting's tokens.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa

from mismatch_probe import interrupt, models, store
from mismatch_probe.engine import batch_invariant, process, turns
from mismatch_probe.engine.args import check_engine_args
from mismatch_probe.errors import ProbeError
from mismatch_probe.models.checkpoint import check_weights
from mismatch_probe.pipeline import attribution, engines, layers, rescoring, routes, trajectory
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.records import Prepared, Rescored, RolloutRun, ScanResult
from mismatch_probe.pipeline.runinfo import run_metadata, run_record
from mismatch_probe.pipeline.tables import (
    mismatch_columns,
    sequence_table,
    token_table,
    with_setting_columns,
)
from mismatch_probe.pipeline.timing import Timer
from mismatch_probe.progress import make_progress, phase_lines
from mismatch_probe.prompts import (
    Prompt,
    default_prompts_path,
    encode_prompts,
    load_prompts,
    select_prompts,
)
from mismatch_probe.settings import RolloutSetting, Setting
from mismatch_probe.training import devices

if TYPE_CHECKING:
    from mismatch_probe.metrics import MetricsResult


class Inputs(NamedTuple):
    """What ``check_inputs`` found: every path checked, the prompts read (not yet encoded)."""

    model_dir: Path
    prompts_path: Path  # resolved
    prompts: list[Prompt]
    out: Path | None  # None: not checked (a shard's worker: the driver checked it)


def check_inputs(cfg: ScanConfig, out: bool = True) -> Inputs:
    """Every check of a path or an option value that needs neither vLLM nor transformers, run
    before either is imported (a typo fails in a fraction of a second, not after the imports).

    Args:
        out: check the output directory (``check_out``); a shard's worker leaves it to the
            driver.

    Raises:
        ProbeError: an unwritable or occupied ``--out``, a missing model or prompts file,
            malformed prompts, options attribution cannot measure, Ray not installed.
    """
    if cfg.ray is not None:
        from mismatch_probe.pipeline.raycluster import require_ray

        require_ray()
    out_dir = check_out(cfg, cfg.out, create=False) if out and cfg.out is not None else None
    attribution.check(cfg)
    layers.check(cfg)
    model_dir = models.resolve_model(cfg.model)
    attribution.check_stale(cfg.stale_model, model_dir)
    check_weights(model_dir)  # what the engine will load, checked before it starts
    if out and out_dir is None:
        out_dir = check_out(cfg, cfg.out_dir(models.model_name(model_dir)), create=False)
    prompts_path = (cfg.prompts or default_prompts_path()).resolve()
    if cfg.prompt_ids is None:
        prompts = load_prompts(prompts_path, cfg.num_prompts)
    else:  # ids are line indices: a selected prompt keeps its id, hence its request seeds
        prompts = select_prompts(load_prompts(prompts_path), cfg.prompt_ids, prompts_path)
    return Inputs(model_dir, prompts_path, prompts, out_dir)


def prepare(cfg: ScanConfig, out: bool = True) -> Prepared:
    """Check the inputs (``check_inputs``, before the heavy imports), then check the options the
    backend must support, load the tokenizer and encode the prompts (no engine yet)."""
    inputs = check_inputs(cfg, out)
    with process.importing():
        from transformers import AutoConfig, AutoTokenizer

        if cfg.ray is None:  # on Ray, each worker checks its own devices (run_shard)
            devices.check_available(cfg.train_device_map)
        process.import_vllm_quietly(cfg.verbose)  # before anything else touches vLLM
    check_engine_args(cfg.vllm_args)  # their types are vLLM's own: known once it is imported
    invariant = batch_invariant.check(cfg.batch_invariant)
    model_dir = inputs.model_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:300]
        raise ProbeError(f"transformers could not load {model_dir}: {reason}") from None
    routing = routes.prepare(config, cfg.routing_replay)
    context = _context_length(config, tokenizer)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.chat and not has_template:
        raise ProbeError(f"--chat: the tokenizer of {model_dir} has no chat template")
    chat = has_template if cfg.chat is None else cfg.chat
    encoded = encode_prompts(inputs.prompts, tokenizer, chat, context, cfg.sampling.max_tokens)
    trajectory.check(encoded, routing)
    # +1: a forced continuation (--same-tokens) asks for one token after a full response
    longest = max(p.longest_trajectory(cfg.sampling.max_tokens) for p in encoded) + 1
    max_len = min(context, longest)
    return Prepared(
        model_dir,
        inputs.prompts_path,
        chat,
        encoded,
        max_len,
        tokenizer,
        routing,
        invariant,
        out=inputs.out,
        engine_defaults=turns.engine_defaults(encoded),
    )


def _context_length(config: Any, tokenizer: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None) or getattr(
            getattr(config, "text_config", None), name, None
        )
        if isinstance(value, int) and value > 0:
            return value
    return int(min(tokenizer.model_max_length, 1 << 20))


@dataclass(frozen=True)
class Part:
    """Where one prompt range's rows go: the single files of a whole scan, or one shard's parts
    of a sharded store (``sharding.shard_part``).

    Attributes:
        bounds: ``[start, stop)`` prompt indices.
        tokens, sequences, routing: the files the range's tables are written to.
        shard: the shard number (None: the whole scan, one range).
        stale: files an earlier run left that the range's rows make wrong (its ``run.json``,
            removed when they are written: never beside another run's tokens).
    """

    bounds: tuple[int, int]
    tokens: Path
    sequences: Path
    routing: Path
    shard: int | None = None
    stale: tuple[Path, ...] = ()


def whole_part(out: Path, prompts: int) -> Part:
    """The one range of a whole scan: every prompt, into ``tokens.parquet`` and its siblings
    (an earlier run's ``run.json`` is removed when they are written)."""
    names = STORE_NAMES[False]
    tokens, sequences = out / names["tokens"], out / names["sequences"]
    stale = (out / store.RUN_FILE,)
    return Part((0, prompts), tokens, sequences, out / store.ROUTING_FILE, stale=stale)


# The token store's names: single files (one range) or one directory of parts per table.
STORE_NAMES = {
    False: {"tokens": store.TOKENS_FILE, "sequences": store.SEQUENCES_FILE},
    True: {"tokens": store.TOKENS_DIR, "sequences": store.SEQUENCES_DIR},
}
DEVICE_MAPS = ("train_device_map", "attribution_device_map")  # what a range records, per map


@process.frozen_heap()  # no collection of the scan traverses what existed before it
def run_scan(cfg: ScanConfig, console: Any) -> ScanResult:
    """Run the whole pipeline: one prompt range holding every prompt (``run_range``), then the
    finishing step (``finish``). Writes the token store (``store.TOKENS_FILE``,
    ``SEQUENCES_FILE``), the metrics (``METRICS_FILE``, ``SETTINGS_FILE``), ``RUN_FILE`` and the
    reports into the output directory (plus ``ROUTING_FILE`` and ``ROUTING_METRICS_FILE`` for a
    mixture-of-experts model). A sharded scan is ``sharding.run_sharded``: the same range step
    per shard, the same finishing step."""
    if cfg.sharded:
        raise ProbeError("a sharded scan (shards > 1) runs with sharding.run_sharded")
    timer = Timer()
    started = time.time()
    with timer("prepare"):
        prep = prepare(cfg)
        out = store.writable_dir(prep.out_dir, "--out")  # every check passed: now created
    with writer_of(cfg, out):
        timer.announce = phase_lines(console)  # bad input is one line: phases only from here
        interrupt.writing_to(out, started)
        with make_progress(console) as progress:
            part = whole_part(out, len(prep.prompts))
            record = run_range(cfg, prep, part, timer, progress, console)
        return finish(cfg, prep, [record], timer)


@contextmanager
def writer_of(cfg: ScanConfig, out: Path) -> Iterator[None]:
    """Be the one writer of ``out`` for the block (``store.lock.run_lock``, held until the
    scan's last file is in place: a second scan or ingest into it is refused at once), and
    ``check_out`` again under the lock: a scan that finished there since the first check is
    not replaced without ``--force``."""
    from mismatch_probe.store.lock import run_lock

    with run_lock(out):
        check_out(cfg, out, create=False)
        yield


def check_out(cfg: ScanConfig, out: Path, create: bool = True) -> Path:
    """The output directory, proven writable (and created, with ``create``) before any engine
    starts: a scan must not run for minutes to fail at its first write. One that holds a run
    already (one file, or a sharded run's parts) is refused unless ``cfg.force`` (its files
    would be replaced) or ``cfg.resume``."""
    names = (store.RUN_FILE, store.TOKENS_FILE, store.TOKENS_DIR)  # TOKENS_DIR: a sharded run
    held = [name for name in names if (out / name).exists()]
    if held and not (cfg.force or cfg.resume):
        raise ProbeError(
            f"--out {out} holds a run already ({held[0]}); choose another directory, or give "
            "--force to replace its files"
        )
    return store.writable_dir(out, "--out") if create else store.check_writable(out, "--out")


def run_range(
    cfg: ScanConfig, prep: Prepared, part: Part, timer: Timer, progress: Any, console: Any
) -> dict[str, Any]:
    """The engine and training stages on the prompts of ``part.bounds``, and its tables written
    to ``part``: every rollout setting sampled (or scored on the first setting's tokens with
    ``same_tokens``), then every setting rescored (with the attribution rungs under
    ``--attribute``; routes for an MoE model). The whole scan is the one-range case; a shard of a
    sharded scan is another.

    Returns:
        The range's record (a shard's ``_SUCCESS`` marker): prompts, rows, per-setting engine
        runs, where each training-side model ran, timings, host and process.
    """
    first, stop = part.bounds
    total = len(prep.prompts) * cfg.samples_per_prompt  # the whole scan's sequences per setting
    rng = replace(prep, prompts=prep.prompts[first:stop])
    runs = engines.run_engines(cfg, rng, timer, progress, console)
    found_layers: dict[Setting, Any] = {}  # --layers: per-layer sums of each setting
    try:
        scored = rescoring.rescore_all(cfg, rng, runs, timer, progress, found_layers)
        views = layers.precision_views(cfg, rng, runs, timer, rescoring.load_model)
    finally:
        layers.discard(runs)  # the engine streams' chunk files
    assign_seq_ids(scored, cfg.settings(), total, first * cfg.samples_per_prompt)
    ran = next((r.setting for r in runs if r.rollouts), None)  # the views' sequences
    first_rollout = next((s for s in scored if s.rollout == ran), None)
    view_offset = scored[first_rollout].seq_offset if first_rollout is not None else 0
    attribution.train_step(cfg, rng, runs, scored, timer)  # nothing without --attribute
    record = {
        "shard": part.shard,
        "prompts": list(part.bounds),
        "sequences": sum(len(r.rollouts) for r in scored.values()),
        "tokens": sum(len(x.response_ids) for r in scored.values() for x in r.rollouts),
        "runs": [engine_run_record(r) for r in runs],
        "train_device_map": dict(rng.train_devices),
        "attribution_device_map": dict(rng.attribution_devices),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "layers": layers.finish(
            found_layers,
            {s: r.seq_offset for s, r in scored.items()},
            views,
            view_offset,
            layers.compared_routes(cfg, scored, found_layers),  # MoE: routing flips marked
        ),
    }
    with timer("writing"):
        run = run_metadata(cfg, rng, runs, timer.seconds)
        if part.shard is not None:
            run["shard"] = record
        for path in part.stale:
            path.unlink(missing_ok=True)
        write_tables(part.tokens, part.sequences, *store_tables(scored, prep.tokenizer), run)
        routes.write_routing(part.routing, scored, prep.routing, run)  # no-op for a dense model
    record["timings"] = dict(timer.seconds)
    return record


def assign_seq_ids(
    scored: dict[Setting, Rescored], settings: Sequence[Setting], total: int, first: int
) -> None:
    """The one seq_id rule: setting ``i`` of the scan's settings (every one requested, whether
    it ran or not, so every range of a sharded scan agrees even where a setting could not run
    on one node) takes ``[i * total, (i + 1) * total)``, and a range starting at sequence
    ``first`` of the whole scan keeps its place in it, so a sharded store holds the same
    (setting, seq_id) rows as one file.

    Args:
        scored: the range's settings that ran (updated in place: ``seq_offset``).
        settings: the scan's settings in order (``ScanConfig.settings()``).
        total: sequences per setting in the whole scan (prompts x samples per prompt).
        first: the range's first sequence (its first prompt x samples per prompt).
    """
    place = {setting: i for i, setting in enumerate(settings)}
    for setting, rescored in scored.items():
        rescored.seq_offset = place[setting] * total + first


def engine_run_record(run: RolloutRun) -> dict[str, Any]:
    """A rollout setting's engine run in a range: what ``run.json`` reports of it, and the tokens
    it sampled (so throughput can be summed over ranges)."""
    return {**run_record(run), "tokens": sum(len(r.response_ids) for r in run.rollouts)}


def finish(
    cfg: ScanConfig, prep: Prepared, records: list[dict[str, Any]], timer: Timer
) -> ScanResult:
    """The one finishing step, after every range has written its rows: the metrics of every
    setting (computed once, streamed over the store), ``settings.json``, the MoE routing
    metrics, the attribution; the run's view built from them in memory (``rundir.RunData``:
    nothing reads a ``run.json`` an earlier run left), its data files, the reports, then
    ``run.json``."""
    from mismatch_probe.pipeline.publish import publish
    from mismatch_probe.rundir import RunData, build_report
    from mismatch_probe.rundir.layers import write_layers

    out = prep.out_dir
    runs, speed = merged_runs(cfg, records)
    skipped = {r.setting.name: r.skipped for r in runs if r.skipped}
    present = [s for s in cfg.settings() if s.rollout.name not in skipped]
    paths = {name: out / file for name, file in STORE_NAMES[cfg.sharded].items()}
    with timer("metrics"):
        results = setting_metrics(paths["tokens"], present)
        flat = settings_json(paths, results, speed)
        run = run_metadata(cfg, prep, runs, timer.seconds)
        run["setting"] = present[0].name  # the reference: the first setting that ran
        for entry, r in zip(run["rollouts"], runs, strict=True):  # throughput over the ranges
            entry["tokens_per_s"] = speed[r.setting]
            entry.update(prefix_cache(records, r.setting.name))
        run.update(range_fields(cfg, records))
        routing_paths, routing = routes.finish(out, prep.routing, present, run)  # {} for dense
        paths.update(routing_paths)
        found = attribution.finish(paths["tokens"])  # {} without --attribute
        layers_data = records[0].get("layers") or {}  # {} without --layers
        paths.update(write_layers(out, layers_data))
    with timer("reports"):
        data = RunData(
            run,
            order=[s.name for s in present],
            metrics={s.name: m.to_json_dict() for s, m in results.items()},
            throughput={s.name: speed[s.rollout] for s in present},
            routing=routing,
            attribution=found,
            layers=layers_data,
        )
        report, entries = build_report(out, data)
        paths.update(publish(report, entries, out))
    paths["run"] = out / store.RUN_FILE
    run["timings"] = dict(timer.seconds)
    with interrupt.stage("writing"):
        store.write_json(paths["run"], run)
    return ScanResult(out, paths, run, flat, skipped, report, entries)


def merged_runs(
    cfg: ScanConfig, records: list[dict[str, Any]]
) -> tuple[list[RolloutRun], dict[RolloutSetting, float]]:
    """One ``RolloutRun`` per rollout setting over every range (generation seconds summed,
    skipped when a range skipped it, the engine arguments of the first range that started an
    engine) and each rollout setting's generation throughput (tokens/s over every range)."""
    runs = {r.name: RolloutRun(r) for r in cfg.rollout_settings()}
    tokens = dict.fromkeys(runs, 0)
    for record in records:
        for entry in record["runs"]:
            run = runs[entry["setting"]]
            run.generation_seconds += entry["generation_seconds"]
            run.skipped = run.skipped or entry["skipped"]
            tokens[entry["setting"]] += entry["tokens"]
            if run.engine_mode is None and entry.get("engine_mode") is not None:
                run.engine_args, run.engine_env = entry["engine_args"], entry["engine_env"]
                run.engine_mode = entry["engine_mode"]
    speed = {
        r.setting: tokens[name] / r.generation_seconds if r.generation_seconds > 0 else 0.0
        for name, r in runs.items()
    }
    return list(runs.values()), speed


def prefix_cache(records: list[dict[str, Any]], setting: str) -> dict[str, Any]:
    """A multi-turn setting's ``prefix_cache`` record summed over the ranges ({} without
    multi-turn): the later turns' requests, their prompt tokens, how many the cache held."""
    found = [
        e["prefix_cache"] for r in records for e in r["runs"]
        if e["setting"] == setting and "prefix_cache" in e
    ]  # fmt: skip
    if not found:
        return {}
    summed = {key: (max if key == "block_size" else sum)(f.get(key, 0) for f in found)
              for key in found[0]}  # fmt: skip
    return {"prefix_cache": summed}


def range_fields(cfg: ScanConfig, records: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``run.json`` says of the ranges: where each training-side model ran (one map per
    shard in a sharded scan) and, sharded, each shard's record."""
    if not cfg.sharded:
        (record,) = records
        return {key: record[key] for key in DEVICE_MAPS}
    fields: dict[str, Any] = {
        key: {f"shard={r['shard']}": r.get(key) for r in records} for key in DEVICE_MAPS
    }
    fields["shards"] = {"count": cfg.shards, "ray": cfg.ray, "records": records}
    return fields


def store_tables(scored: dict[Setting, Rescored], tokenizer: Any) -> tuple[pa.Table, pa.Table]:
    """The token and sequence tables of every setting (each setting's sequences contiguous,
    with their own seq_id range; the ``--attribute`` rung columns where present)."""
    tokens, sequences = [], []
    for setting, r in scored.items():
        table = token_table(setting.name, r.rollouts, r.scored, tokenizer, r.seq_offset)
        table = attribution.with_rungs(table, r.rungs) if r.rungs else table
        tokens.append(with_setting_columns(table, setting))
        seqs = sequence_table(setting.name, r.rollouts, tokenizer, r.seq_offset)
        for name, column in mismatch_columns(r.scored, r.rollouts).items():
            seqs = seqs.append_column(name, column)
        sequences.append(with_setting_columns(seqs, setting))
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
