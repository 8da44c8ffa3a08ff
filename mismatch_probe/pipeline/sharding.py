"""Sharded scans: the prompts split into shards, each shard a scan of its own prompts.

``probe scan --shards N`` cuts the prompts into N contiguous ranges. Each shard runs rollout and
rescoring for its prompts (``run_shard``: the same stages as ``scan.run_scan``, same engine
arguments, same per-request seeds) and writes its part of the store (``dataset``:
``tokens/shard=K/part-0.parquet``, ``sequences/shard=K/part-0.parquet``, then the markers).
Shards run one after another in this process, or as Ray tasks (``--ray``, ``raycluster``). The
driver then streams the metrics over all parts and writes ``run.json`` and the reports.

Sequence ids are those of the unsharded scan: shard k's sequences start at
``first_prompt * samples_per_prompt`` and each setting's at ``setting_index * total``, so a
sharded store holds the same (setting, seq_id) rows as one file, and, seeds being per request,
the same sampled tokens (up to the engine's batch variance: a shard batches fewer requests).

``shards.json`` records the options and the plan when the run starts; ``--resume`` refuses
options that differ from it, skips shards whose ``_SUCCESS`` marker is present and redoes the
others (their partial parts are removed first).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.engine import process
from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline import scan
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.records import RolloutRun, ScanResult
from mismatch_probe.store import dataset

PLAN_FILE = "shards.json"
RUNNING = "_RUNNING"  # in tokens/shard=K while the shard runs: {"pid", "host", "started"}
NOT_RECORDED = ("ray", "resume")  # options that may change between a run and its --resume


def plan_shards(num_prompts: int, shards: int) -> list[tuple[int, int]]:
    """``[start, stop)`` prompt ranges of nearly equal size, in order."""
    if shards > num_prompts:
        raise ProbeError(f"--shards {shards}: more shards than prompts ({num_prompts})")
    bounds = [num_prompts * k // shards for k in range(shards + 1)]
    return list(itertools.pairwise(bounds))


def recorded_options(cfg: ScanConfig) -> dict[str, Any]:
    """The options a resumed run must share with the recorded one (as JSON values)."""
    options = {k: v for k, v in cfg.to_dict().items() if k not in NOT_RECORDED}
    return dict(json.loads(json.dumps(options, sort_keys=True, default=str)))


def prompts_digest(prep: Any) -> str:
    """SHA-256 of the encoded prompts: a changed prompts file is a different run."""
    h = hashlib.sha256()
    for p in prep.prompts:
        h.update(json.dumps([p.prompt_id, list(p.token_ids)]).encode())
        if p.turns is not None:  # a multi-turn prompt's given messages belong to it too
            h.update(json.dumps([p.turns.after_end, p.turns.after_cut]).encode())
    return h.hexdigest()


def start_or_resume(out: Path, cfg: ScanConfig, prep: Any, plan: list[tuple[int, int]]) -> set[int]:
    """Record a new run (clearing an earlier store in ``out``) or check a resumed one.

    Returns:
        The shards already finished (empty for a new run).

    Raises:
        ProbeError: ``--resume`` without a recorded run, or with different options or prompts.
    """
    path = out / PLAN_FILE
    options = recorded_options(cfg)
    record = {
        "options": options,
        "prompts_sha256": prompts_digest(prep),
        "plan": [list(b) for b in plan],
    }
    if not cfg.resume:
        from mismatch_probe.pipeline import routes

        for name in (store.TOKENS_DIR, store.SEQUENCES_DIR, store.ROUTING_DIR):
            shutil.rmtree(out / name, ignore_errors=True)
        for name in (store.TOKENS_FILE, store.SEQUENCES_FILE):
            (out / name).unlink(missing_ok=True)  # a single-file store would shadow the parts
        routes.remove_outputs(out)  # an earlier run's routing files
        store.write_json(path, record)
        return set()
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ProbeError(f"--resume: {out} holds no sharded run to resume ({PLAN_FILE})") from None
    changed = _differences(recorded.get("options", {}), options)
    if recorded.get("prompts_sha256") != record["prompts_sha256"]:
        changed.append("prompts (their content changed)")
    if changed:
        raise ProbeError(f"--resume: options differ from the run in {out}: {'; '.join(changed)}")
    return set(dataset.done_shards(out / store.TOKENS_DIR)) & set(range(len(plan)))


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``"sampling.max_tokens was 8, now 16"`` for each option that changed."""
    old, new = _flat(old), _flat(new)
    keys = sorted(set(old) | set(new))
    return [f"{k} was {old.get(k)!r}, now {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def _flat(options: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@process.frozen_heap()  # as a whole scan: collections skip what existed before it
def run_shard(cfg: ScanConfig, shard: int, bounds: tuple[int, int], out: str) -> dict[str, Any]:
    """Run one shard (rollout + rescoring of prompts ``bounds``) and write its parts.

    Runs in a Ray worker or in this process; everything it needs comes in its arguments.

    Returns:
        The shard's record (also its ``_SUCCESS`` marker): prompts, rows, per-setting runs,
        timings, the training side's device map, host and process.
    """
    from rich.console import Console

    from mismatch_probe.pipeline import routes
    from mismatch_probe.pipeline.runinfo import run_metadata
    from mismatch_probe.progress import make_progress

    tokens_dir, seq_dir = Path(out) / store.TOKENS_DIR, Path(out) / store.SEQUENCES_DIR
    routing_dir = Path(out) / store.ROUTING_DIR
    _reset(tokens_dir, seq_dir, routing_dir, shard)
    timer = scan.Timer()
    with timer("prepare"):
        prep = scan.prepare(cfg)
    first = bounds[0] * cfg.samples_per_prompt
    total = len(prep.prompts) * cfg.samples_per_prompt
    prep.prompts = prep.prompts[bounds[0] : bounds[1]]
    console = Console(stderr=True, quiet=True)
    with make_progress(console) as progress:
        runs, scored = scan.sample_and_rescore(cfg, prep, timer, progress, console)
    for i, rescored in enumerate(scored.values()):  # the unsharded scan's seq_ids
        rescored.seq_offset = i * total + first
    info = {
        "shard": shard,
        "prompts": list(bounds),
        "sequences": sum(len(r.rollouts) for r in scored.values()),
        "tokens": sum(len(x.response_ids) for r in scored.values() for x in r.rollouts),
        "runs": [_run_record(r) for r in runs],
        "train_device_map": dict(prep.train_devices),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    with timer("writing"):
        run = {**run_metadata(cfg, prep, runs, timer.seconds), "shard": info}
        parts = dataset.part_path(tokens_dir, shard), dataset.part_path(seq_dir, shard)
        scan.write_tables(*parts, *scan.store_tables(scored, prep.tokenizer), run)
        if prep.routing is not None:
            part = dataset.part_path(routing_dir, shard)
            routes.write_routing(Path(out), scored, prep.routing, run, path=part)
    info["timings"] = dict(timer.seconds)
    if prep.routing is not None:
        dataset.mark_done(routing_dir, shard, info)
    dataset.mark_done(seq_dir, shard, info)
    dataset.mark_done(tokens_dir, shard, info)  # last: the shard counts as finished from here
    (dataset.shard_dir(tokens_dir, shard) / RUNNING).unlink(missing_ok=True)
    return info


def _reset(tokens_dir: Path, seq_dir: Path, routing_dir: Path, shard: int) -> None:
    """Remove an earlier attempt's parts and say who runs the shard now (``_RUNNING``)."""
    for table_dir in (tokens_dir, seq_dir, routing_dir):
        shutil.rmtree(dataset.shard_dir(table_dir, shard), ignore_errors=True)
    folder = dataset.shard_dir(tokens_dir, shard)
    folder.mkdir(parents=True, exist_ok=True)
    who = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    store.write_json(folder / RUNNING, who)


def _run_record(run: Any) -> dict[str, Any]:
    return {
        "setting": run.setting.name,
        "skipped": run.skipped,
        "generation_seconds": run.generation_seconds,
        "tokens": sum(len(r.response_ids) for r in run.rollouts),
    }


def run_sharded(cfg: ScanConfig, console: Any) -> ScanResult:
    """``probe scan --shards N [--ray ADDRESS] [--resume]``."""
    from contextlib import nullcontext

    from mismatch_probe.pipeline import raycluster

    timer = scan.Timer()
    with timer("prepare"):
        prep = scan.prepare(cfg)
        out = cfg.out_dir(prep.model_dir.name)
        plan = plan_shards(len(prep.prompts), cfg.shards)
    # Ray is joined before anything in --out is touched: a wrong address loses nothing.
    with raycluster.connected(cfg.ray) if cfg.ray is not None else nullcontext():
        with timer("prepare"):
            out.mkdir(parents=True, exist_ok=True)
            done = start_or_resume(out, cfg, prep, plan)
        pending = [k for k in range(len(plan)) if k not in done]
        if done:
            console.print(f"resume: shard(s) {sorted(done)} finished, running {pending}")
        # Workers may start elsewhere (another directory, another node): absolute paths only.
        worker_cfg = replace(
            cfg,
            model=prep.model_dir.resolve(),
            prompts=prep.prompts_path.resolve(),
            out=out.resolve(),
            resume=False,
        )
        with timer("shards"):
            if cfg.ray is not None:
                raycluster.run_shards(run_shard, worker_cfg, plan, pending, console)
            else:
                for k in pending:
                    run_shard(worker_cfg, k, plan[k], str(out.resolve()))
                    console.print(f"shard {k} of {len(plan)} done", highlight=False)
    return _finish(cfg, prep, out, timer)


def _finish(cfg: ScanConfig, prep: Any, out: Path, timer: Any) -> Any:
    """Metrics over every part, ``run.json`` (with each shard's record) and the reports."""
    from mismatch_probe.pipeline import routes
    from mismatch_probe.pipeline.runinfo import run_metadata
    from mismatch_probe.report import load_report, write_outputs
    from mismatch_probe.routing import store as routing_store

    infos = dataset.done_shards(out / store.TOKENS_DIR)
    runs, tokens = _merged_runs(cfg, infos)
    skipped = {r.setting.name: r.skipped for r in runs if r.skipped}
    present = [s for s in cfg.settings() if s.rollout.name not in skipped]
    paths = {"tokens": out / store.TOKENS_DIR, "sequences": out / store.SEQUENCES_DIR}
    speed = {r.setting: _rate(tokens, r) for r in runs}  # runs carry no rollouts here
    with timer("metrics"):
        results = scan.setting_metrics(paths["tokens"], present)  # streamed over all parts
        flat = scan.settings_json(paths, results, speed)
        if prep.routing is not None:
            paths["routing"] = out / store.ROUTING_DIR
            paths.update(routes.routing_outputs(out, present))
    run = run_metadata(cfg, prep, runs, timer.seconds)
    if prep.routing is not None:
        shape, capture_path = prep.routing.shape, prep.routing.setup.capture_path
        run["routing"] = routing_store.routing_metadata(shape, capture_path)
    for record, r in zip(run["rollouts"], runs, strict=True):  # throughput from the shards
        record["tokens_per_s"] = speed[r.setting]
    run["train_device_map"] = {f"shard={k}": i.get("train_device_map") for k, i in infos.items()}
    run["shards"] = {"count": cfg.shards, "ray": cfg.ray, "records": list(infos.values())}
    paths["run"] = out / store.RUN_FILE
    store.write_json(paths["run"], run)
    with timer("reports"):
        computed = {s.name: m.to_json_dict() for s, m in results.items()}
        report, entries = load_report(out, computed=computed)
        paths.update(write_outputs(report, entries))
    run["timings"] = dict(timer.seconds)
    store.write_json(paths["run"], run)
    return ScanResult(out, paths, run, flat, skipped, report, entries)


def _merged_runs(cfg: ScanConfig, infos: dict[int, Any]) -> tuple[list[Any], dict[str, int]]:
    """One ``RolloutRun`` per rollout setting (generation seconds summed over shards, skipped
    when a shard skipped it) and each setting's sampled tokens."""

    runs = {r.name: RolloutRun(r) for r in cfg.rollout_settings()}
    tokens = dict.fromkeys(runs, 0)
    for info in infos.values():
        for record in info["runs"]:
            run = runs[record["setting"]]
            run.generation_seconds += record["generation_seconds"]
            run.skipped = run.skipped or record["skipped"]
            tokens[record["setting"]] += record["tokens"]
    return list(runs.values()), tokens


def _rate(tokens: dict[str, int], run: RolloutRun) -> float:
    """A rollout setting's generation tokens/s over every shard."""
    seconds = run.generation_seconds
    return tokens[run.setting.name] / seconds if seconds > 0 else 0.0
