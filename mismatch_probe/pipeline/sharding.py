"""Sharded scans: the prompts split into shards, each shard a scan of its own prompts.

``probe scan --shards N`` cuts the prompts into N contiguous ranges. This module keeps only what
is particular to shards: the plan, the record of a run and its ``--resume``, and the dispatch.
Each shard is ``scan.run_range`` on its prompts (``run_shard``: the same stages as a whole scan,
same engine arguments, same per-request seeds, same seq_id rule, ``scan.assign_seq_ids``) into
its part of the store (``dataset``: ``tokens/shard=K/part-0.parquet``,
``sequences/shard=K/part-0.parquet``, then the markers). Shards run one after another in this
process, or as Ray tasks (``--ray``, ``raycluster``). The driver then runs the whole scan's
finishing step (``scan.finish``: metrics streamed over all parts, reports, ``run.json``).

Sequence ids are those of the unsharded scan, so a sharded store holds the same (setting,
seq_id) rows as one file, and, seeds being per request, the same sampled tokens (up to the
engine's batch variance: a shard batches fewer requests).

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
from functools import partial
from pathlib import Path
from typing import Any

from mismatch_probe import interrupt, store
from mismatch_probe.engine import process
from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline import scan
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.pipeline.records import ScanResult
from mismatch_probe.pipeline.timing import Timer
from mismatch_probe.store import dataset

PLAN_FILE = "shards.json"
RUNNING = "_RUNNING"  # in tokens/shard=K while the shard runs: {"pid", "host", "started"}
NOT_RECORDED = ("ray", "ray_timeout", "resume")  # may change between a run and its --resume


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
        for name in (store.TOKENS_FILE, store.SEQUENCES_FILE, store.RUN_FILE):
            (out / name).unlink(missing_ok=True)  # would shadow the parts, or describe another run
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
    """Run one shard (``scan.run_range`` on prompts ``bounds``) into its parts and mark it done.

    Runs in a Ray worker or in this process; everything it needs comes in its arguments.

    Returns:
        The shard's record (also its ``_SUCCESS`` marker): prompts, rows, per-setting runs,
        timings, the training side's device maps, host and process.
    """
    from rich.console import Console

    from mismatch_probe.progress import make_progress
    from mismatch_probe.training import devices

    devices.check_available(cfg.train_device_map)  # this worker's devices, before its engine
    folder = Path(out)
    _reset(folder, shard)
    part = shard_part(folder, shard, bounds)
    timer = Timer()
    with timer("prepare"):
        prep = scan.prepare(cfg, out=False)  # the driver checked --out
    console = Console(stderr=True, quiet=True)
    with make_progress(console) as progress:
        info = scan.run_range(cfg, prep, part, timer, progress, console)
    for name in (store.ROUTING_DIR, store.SEQUENCES_DIR):
        if dataset.shard_dir(folder / name, shard).is_dir():  # routing: an MoE model's only
            store.mark_done(folder / name, shard, info)
    tokens_dir = folder / store.TOKENS_DIR
    store.mark_done(tokens_dir, shard, info)  # last: the shard counts as finished from here
    (dataset.shard_dir(tokens_dir, shard) / RUNNING).unlink(missing_ok=True)
    return info


def shard_part(out: Path, shard: int, bounds: tuple[int, int]) -> scan.Part:
    """Where shard ``shard``'s rows go: ``tokens/shard=K/part-0.parquet`` and its siblings
    (the routing part's directory is made when an MoE model writes it)."""
    tokens = dataset.part_path(out / store.TOKENS_DIR, shard)
    sequences = dataset.part_path(out / store.SEQUENCES_DIR, shard)
    routing = dataset.shard_dir(out / store.ROUTING_DIR, shard) / dataset.PART
    return scan.Part(bounds, tokens, sequences, routing, shard=shard)


def _reset(out: Path, shard: int) -> None:
    """Remove an earlier attempt's parts and say who runs the shard now (``_RUNNING``)."""
    for name in (store.TOKENS_DIR, store.SEQUENCES_DIR, store.ROUTING_DIR):
        shutil.rmtree(dataset.shard_dir(out / name, shard), ignore_errors=True)
    folder = dataset.shard_dir(out / store.TOKENS_DIR, shard)
    folder.mkdir(parents=True, exist_ok=True)
    who = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    store.write_json(folder / RUNNING, who)


def run_sharded(cfg: ScanConfig, console: Any) -> ScanResult:
    """``probe scan --shards N [--ray ADDRESS] [--resume]``: plan, record or resume, dispatch
    the pending shards (here or on Ray), then ``scan.finish`` over every shard's record."""
    from contextlib import ExitStack, nullcontext

    from mismatch_probe.pipeline import raycluster
    from mismatch_probe.progress import phase_lines

    timer = Timer()
    with timer("prepare"):
        prep = scan.prepare(cfg)
        out = prep.out_dir
        plan = plan_shards(len(prep.prompts), cfg.shards)
    # Ray is joined before anything in --out is touched: a wrong address loses nothing.
    ray = cfg.ray
    joined = (
        nullcontext() if ray is None else raycluster.connected(ray, cfg.ray_timeout, cfg.verbose)
    )
    with ExitStack() as held:  # the one writer of --out (scan.writer_of) until finish is done
        with joined:
            with timer("prepare"):
                store.writable_dir(out, "--out")
                held.enter_context(scan.writer_of(cfg, out))
                done = start_or_resume(out, cfg, prep, plan)
            timer.announce = phase_lines(console)  # bad input is one line: phases from here
            pending = [k for k in range(len(plan)) if k not in done]
            interrupt.resumable(partial(kept_shards, out, len(plan)))
            if done:
                console.print(f"resume: shard(s) {sorted(done)} finished, running {pending}")
            # Workers may start elsewhere (another directory, another node): absolute paths.
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
        records = list(dataset.done_shards(out / store.TOKENS_DIR).values())
        result = scan.finish(cfg, prep, records, timer)
    interrupt.resumable(None)  # finished: an interrupt from here on keeps nothing of the shards
    return result


def kept_shards(out: Path, count: int) -> str:
    """What an interrupted sharded scan keeps: its finished shards, and how to continue."""
    done = sorted(dataset.done_shards(out / store.TOKENS_DIR))
    resume = "rerun the same command with --resume to continue"
    if not done:
        return f"no shard finished yet (the plan is in {out / PLAN_FILE}); {resume}"
    listed = ", ".join(str(k) for k in done)
    return f"finished shard(s) {listed} of {count} kept in {out}; {resume} with the others"
