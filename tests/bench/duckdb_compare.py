"""probe against DuckDB on the same files, in one run (A/B alternated, best of ``REPEATS``):

* ``ingest_duckdb``: ``probe ingest prime-rl`` of 168 MB of JSONL (20 steps of 200,000 trained
  tokens, ``ingest.write_export``) end to end (the store, the integrity checks, every metric of
  the run and of each step: ``IngestResult.timings`` ``store + metrics``, the metric pass
  measuring the row groups as they are written; the plots' and reports' fixed cost reported
  apart) against DuckDB reading the same files and computing k3
  per step. The goal: within 3x. Also the integrity checks alone on the written store (do they
  dominate?), and the largest relative difference of the per-step k3.
* ``ingest_nemo_duckdb``: ``probe ingest nemo-rl`` of NeMo-RL GRPO logs (``NEMO_STEPS`` steps
  of ``train_data_step<N>.jsonl``, the logger's one-element lists, padded lines,
  ``write_nemo_logs``) end to end as above, against DuckDB reading the same files and computing
  NeMo's ``gen_kl_error`` (k3 over the token mask, within ``input_lengths``, samples of
  ``sample_loss_mask`` 1; the logs hold only weights 0 and 1, which both count alike) per
  step; and the store written by the reference (record by record) reader, what the fast
  reader is measured against (``speedup_store_fast_over_reference``: the reference parses on
  one core, the fast reader on every core). ``same_tokens_fast_and_reference`` compares the
  two stores' token counts (``tests/test_ingest_fast.py`` compares stores column by column).
* ``metrics_duckdb``: ``compute_metrics`` (every metric) of the 10 M-token bench store
  (``metrics.write_synthetic_store``) on every core and on one, against DuckDB's kl, k3_kl,
  chi2_token, chi2_seq and TIS mean. The goal: within 2x. The probe runs must agree bit
  for bit (``bit_identical_1_vs_all_workers``). Also one worker with glibc's default malloc
  (what ``malloc.keep_freed_memory`` is worth), and one worker in each of two processes at
  once (how much the cores slow each other down: the ceiling of any parallel speed-up here).

Each measurement runs in a fresh ``spawn`` child (its own imports, its own peak RSS), malloc
set as the probe command sets it (``malloc.keep_freed_memory``). DuckDB is
a dev dependency of this bench only. The machine's load average is recorded before and after:
these machines are shared, so only ratios measured side by side mean anything.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPEATS = 3
INGEST_STEPS = 20
INGEST_TOKENS_PER_STEP = 200_000
METRICS_TOKENS = 10_000_000
TIS = 2.0  # MetricsConfig's default rollout_is_threshold (token TIS)
B = 20.0  # verl's safety bound

K3_QUERY = """
WITH t AS (
  SELECT regexp_extract(filename, 'step_([0-9]+)', 1)::INTEGER AS step,
         unnest(loss_mask) AS m, unnest(inference_logprobs) AS lr,
         unnest(trainer_logprobs) AS lt, generate_subscripts(loss_mask, 1) AS i
  FROM read_json('{glob}', format = 'newline_delimited', filename = true,
                 columns = {{'loss_mask': 'BOOLEAN[]', 'inference_logprobs': 'DOUBLE[]',
                            'trainer_logprobs': 'DOUBLE[]'}}))
SELECT step, avg(exp(lt - lr) - 1 - (lt - lr)) AS k3 FROM t
WHERE m AND i > 1 AND lr IS NOT NULL AND lt IS NOT NULL GROUP BY step ORDER BY step
"""

NEMO_STEPS = 10
NEMO_TOKENS_PER_STEP = 200_000
NEMO_PROMPT, NEMO_RESPONSE, NEMO_PAD = 100, 500, 40  # tokens per line; padding to the batch's
NEMO_QUERY = """
WITH t AS (
  SELECT regexp_extract(filename, 'step([0-9]+)\\.jsonl', 1)::INTEGER AS step,
         input_lengths[1] AS len, sample_loss_mask[1] AS sample,
         unnest(token_loss_mask[1]) AS m, unnest(generation_logprobs[1]) AS lg,
         unnest(prev_logprobs[1]) AS lp, generate_subscripts(token_loss_mask[1], 1) AS i
  FROM read_json('{glob}', format = 'newline_delimited', filename = true,
                 columns = {{'input_lengths': 'BIGINT[]', 'sample_loss_mask': 'DOUBLE[]',
                            'token_loss_mask': 'DOUBLE[][]', 'generation_logprobs': 'DOUBLE[][]',
                            'prev_logprobs': 'DOUBLE[][]'}}))
SELECT step, avg(exp(lp - lg) - 1 - (lp - lg)) AS k3 FROM t
WHERE m = 1 AND i > 1 AND i <= len AND sample = 1 GROUP BY step ORDER BY step
"""

FIVE_QUERY = """
WITH t AS (
  SELECT seq_id, train_logprob::DOUBLE - rollout_logprob::DOUBLE AS r
  FROM read_parquet('{path}')
  WHERE train_logprob IS NOT NULL AND rollout_logprob IS NOT NULL),
s AS (SELECT sum(r) AS s FROM t GROUP BY seq_id)
SELECT avg(-r), avg(exp(r) - 1 - r), avg(pow(exp(least(greatest(r, -{b}), {b})), 2)) - 1,
       (SELECT avg(exp(2 * least(greatest(s, -{b}), {b}))) - 1 FROM s),
       avg(least(exp(least(greatest(r, -{b}), {b})), {tis}))
FROM t
"""
FIVE = ("kl", "k3_kl", "chi2_token", "chi2_seq", "rollout_is_mean")


def _peak_mb() -> float:
    from tests.bench.metrics import _peak_rss_kb

    return _peak_rss_kb() / 1024


def _probe_ingest(src: str, out: str, fmt: str = "prime-rl") -> dict[str, Any]:
    from mismatch_probe.ingest import IngestConfig, run_ingest
    from mismatch_probe.metrics.integrity import compute_integrity

    start = time.perf_counter()
    result = run_ingest(IngestConfig(fmt, Path(src), Path(out)))
    wall = time.perf_counter() - start
    t = result.timings
    start = time.perf_counter()
    compute_integrity(Path(out), result.run)
    integrity = time.perf_counter() - start
    return {
        "wall_s": t["store"] + t["metrics"],
        "store_with_the_pass_beside_s": t["store"],  # the pass measures row groups as written
        "pass_after_the_store_s": t["metrics"],
        "reports_s": t["reports"],
        "whole_command_s": wall,
        "integrity_alone_s": integrity,
        "peak_rss_mb": _peak_mb(),
        "pandas_imported": "pandas" in sys.modules,
        "k3": {str(s): m["k3_kl"] for s, m in result.steps.items()},
    }


def _reference_store(src: str, out: str) -> dict[str, Any]:
    """The store of a NeMo-RL log written from the reference reader's records (the record
    readers as ``from_records`` gathers them), what the fast reader replaces."""
    from mismatch_probe.ingest import nemo_rl
    from mismatch_probe.ingest.batches import from_records
    from mismatch_probe.ingest.records import parse_steps
    from mismatch_probe.ingest.writer import RunStoreWriter

    Path(out).mkdir()
    start = time.perf_counter()
    writer = RunStoreWriter(Path(out), {"kind": "ingest", "tool": "mismatch_probe"})
    try:
        for batch in from_records(nemo_rl.read(Path(src), parse_steps(None))):
            writer.add_batch(batch)
    finally:
        counts = writer.close()
    return {"wall_s": time.perf_counter() - start, "tokens": counts.tokens}


def _fast_store(src: str, out: str) -> dict[str, Any]:
    """The same store from the fast reader's batches (``nemo_rl.read_batches``)."""
    from mismatch_probe.ingest import nemo_rl
    from mismatch_probe.ingest.records import parse_steps
    from mismatch_probe.ingest.writer import RunStoreWriter

    Path(out).mkdir()
    start = time.perf_counter()
    writer = RunStoreWriter(Path(out), {"kind": "ingest", "tool": "mismatch_probe"})
    try:
        for batch in nemo_rl.read_batches(Path(src), parse_steps(None)):
            writer.add_batch(batch)
    finally:
        counts = writer.close()
    return {"wall_s": time.perf_counter() - start, "tokens": counts.tokens}


def write_nemo_logs(root: Path, steps: int, tokens_per_step: int, seed: int = 0) -> int:
    """``root/train_data_step<N>.jsonl`` as NeMo-RL's logger writes them: a line per sample,
    each field a one-element list, arrays padded to the batch's length, prompts untrained;
    every 20th sample of ``sample_loss_mask`` 0. Returns the trained tokens kept."""
    import numpy as np

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    kept = 0
    n = NEMO_PROMPT + NEMO_RESPONSE
    width = n + NEMO_PAD
    for step in range(1, steps + 1):
        with (root / f"train_data_step{step}.jsonl").open("w") as fh:
            for i in range(tokens_per_step // (NEMO_RESPONSE - 1)):
                gen = np.zeros(width)
                gen[NEMO_PROMPT:n] = np.log(rng.uniform(0.01, 1.0, NEMO_RESPONSE)).round(6)
                prev = gen.copy()
                prev[NEMO_PROMPT:n] += rng.normal(0, 0.01 * step / steps, NEMO_RESPONSE).round(6)
                mask = [0] * NEMO_PROMPT + [1] * NEMO_RESPONSE + [1] * NEMO_PAD
                sample = 0.0 if i % 20 == 19 else 1.0
                line = {
                    "content": [[{"role": "user", "content": f"question {i}"}]],
                    "rewards": [1.0], "input_lengths": [n],
                    "token_ids": [rng.integers(0, 50_000, width).tolist()],
                    "token_loss_mask": [mask], "sample_loss_mask": [sample],
                    "advantages": [[0.5] * width], "generation_logprobs": [gen.tolist()],
                    "prev_logprobs": [prev.tolist()], "idx": i,
                }  # fmt: skip
                fh.write(json.dumps(line) + "\n")
                kept += NEMO_RESPONSE if sample else 0
    return kept


def _fast_files(src: Path, fmt: str) -> dict[str, str]:
    """``"k of n"``: the files a fast reader reads itself (the rest fall back to the
    reference reader, which would make the row measure that instead), and those the compiled
    reader parses (``jsonl.read_columns``; the rest: pyarrow's JSON reader)."""
    from mismatch_probe.ingest import jsonl, nemo_rl, prime_rl
    from mismatch_probe.ingest.records import parse_steps

    module: Any = {"prime-rl": prime_rl, "nemo-rl": nemo_rl}[fmt]
    files = module.step_files(src, parse_steps(None))
    fast = sum(module.fast_batch(f, s) is not None for s, f in files)
    compiled = {"prime-rl": lambda f: jsonl.read_columns(f, prime_rl._COLUMNS),
                "nemo-rl": nemo_rl._compiled}[fmt]  # fmt: skip
    parsed = sum(compiled(f) is not None for _, f in files)
    return {"files_on_the_fast_path": f"{fast} of {len(files)}",
            "files_parsed_by_the_compiled_reader": f"{parsed} of {len(files)}"}  # fmt: skip


def _duckdb_nemo_k3(src: str) -> dict[str, Any]:
    con = _duckdb()
    start = time.perf_counter()
    rows = con.sql(NEMO_QUERY.format(glob=f"{src}/train_data_step*.jsonl")).fetchall()
    return {"wall_s": time.perf_counter() - start, "peak_rss_mb": _peak_mb(),
            "k3": {str(s): k for s, k in rows}}  # fmt: skip


def _duckdb_k3(src: str) -> dict[str, Any]:
    glob = f"{src}/token_exports/step_*/rank_*.jsonl"
    con = _duckdb()
    start = time.perf_counter()
    rows = con.sql(K3_QUERY.format(glob=glob)).fetchall()
    return {"wall_s": time.perf_counter() - start, "peak_rss_mb": _peak_mb(),
            "k3": {str(s): k for s, k in rows}}  # fmt: skip


def _probe_metrics(path: str, workers: int | None) -> dict[str, Any]:
    from mismatch_probe.metrics import compute_metrics

    start = time.perf_counter()
    result = compute_metrics(Path(path), workers=workers)
    wall = time.perf_counter() - start
    exact = json.dumps(result.to_json_dict(), sort_keys=True, default=str)
    flat = result.flat()
    return {"wall_s": wall, "peak_rss_mb": _peak_mb(), "exact": exact,
            "five": {k: flat[k] for k in FIVE},
            "pandas_imported": "pandas" in sys.modules}  # fmt: skip


def _duckdb_five(path: str) -> dict[str, Any]:
    con = _duckdb()
    start = time.perf_counter()
    (row,) = con.sql(FIVE_QUERY.format(path=path, b=B, tis=TIS)).fetchall()
    return {"wall_s": time.perf_counter() - start, "peak_rss_mb": _peak_mb(),
            "five": dict(zip(FIVE, row, strict=True))}  # fmt: skip


def _duckdb() -> Any:
    """A DuckDB connection on every core, without its progress bar."""
    import duckdb

    con = duckdb.connect()
    con.execute("SET enable_progress_bar = false")
    return con


def _child(fn: Any, *args: Any, tuned: bool = True) -> dict[str, Any]:
    """``fn(*args)`` in a fresh spawned process; ``tuned``: malloc as the probe command sets it
    (False: glibc's defaults, to measure what that setting is worth)."""
    start = _as_probe_starts if tuned else None
    with mp.get_context("spawn").Pool(1, initializer=start) as pool:
        return pool.apply(fn, args)


def _two_at_once(fn: Any, *args: Any) -> dict[str, Any]:
    """``fn(*args)`` in two fresh processes at the same time (each started as ``_child``'s):
    the slower one's result."""
    ctx = mp.get_context("spawn")
    pools = [ctx.Pool(1, initializer=_as_probe_starts) for _ in range(2)]  # one process each
    try:
        for pool in pools:  # both started and imported before either computes
            pool.apply(_import_metrics)
        runs = [pool.apply_async(fn, args) for pool in pools]
        return max((r.get() for r in runs), key=lambda r: r["wall_s"])
    finally:
        for pool in pools:
            pool.close()
            pool.join()


def _import_metrics() -> None:
    import mismatch_probe.metrics  # noqa: F401  (the imports done before the clock starts)


def _as_probe_starts() -> None:
    """Every child, DuckDB's too, starts with glibc's malloc tuned as the probe command tunes
    it (DuckDB allocates with its own allocator)."""
    from mismatch_probe.malloc import keep_freed_memory

    keep_freed_memory()


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _best(tries: list[tuple[str, dict[str, Any]]], name: str) -> dict[str, Any]:
    return min((r for n, r in tries if n == name), key=lambda r: r["wall_s"])


def _rel(a: dict[str, float], b: dict[str, float]) -> float:
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in b)


def bench_ingest_duckdb() -> dict[str, Any]:
    from tests.bench.ingest import write_export

    out: dict[str, Any] = {"load_before": _load(), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "export"
        tokens = write_export(src, INGEST_STEPS, tokens_per_step=INGEST_TOKENS_PER_STEP)
        out["jsonl_mb"] = sum(p.stat().st_size for p in src.rglob("*.jsonl")) / 2**20
        out["steps"], out["trained_tokens"] = INGEST_STEPS, tokens
        out.update(_fast_files(src, "prime-rl"))
        tries = []
        for k in range(REPEATS):
            tries.append(("probe", _child(_probe_ingest, str(src), str(Path(tmp) / f"run{k}"))))
            tries.append(("duckdb", _child(_duckdb_k3, str(src))))
    probe, duck = _best(tries, "probe"), _best(tries, "duckdb")
    out["probe_ingest"] = {k: v for k, v in probe.items() if k != "k3"}
    out["duckdb_read_and_k3"] = {k: v for k, v in duck.items() if k != "k3"}
    out["ratio_probe_over_duckdb"] = probe["wall_s"] / duck["wall_s"]
    out["within_3x"] = out["ratio_probe_over_duckdb"] <= 3.0
    out["k3_max_rel_diff"] = _rel(probe["k3"], duck["k3"])
    out["load_after"] = _load()
    return out


def bench_ingest_nemo_duckdb() -> dict[str, Any]:
    out: dict[str, Any] = {"load_before": _load(), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "logs"
        out["trained_tokens"] = write_nemo_logs(src, NEMO_STEPS, NEMO_TOKENS_PER_STEP)
        out["jsonl_mb"] = sum(p.stat().st_size for p in src.glob("*.jsonl")) / 2**20
        out["steps"] = NEMO_STEPS
        out.update(_fast_files(src, "nemo-rl"))
        tries = []
        for k in range(REPEATS):
            run = str(Path(tmp) / f"run{k}")
            tries.append(("probe", _child(_probe_ingest, str(src), run, "nemo-rl")))
            tries.append(("duckdb", _child(_duckdb_nemo_k3, str(src))))
            tries.append(("fast", _child(_fast_store, str(src), str(Path(tmp) / f"fast{k}"))))
            tries.append(("ref", _child(_reference_store, str(src), str(Path(tmp) / f"ref{k}"))))
    probe, duck, fast, ref = (_best(tries, n) for n in ("probe", "duckdb", "fast", "ref"))
    out["probe_ingest"] = {k: v for k, v in probe.items() if k != "k3"}
    out["duckdb_read_and_k3"] = {k: v for k, v in duck.items() if k != "k3"}
    out["ratio_probe_over_duckdb"] = probe["wall_s"] / duck["wall_s"]
    out["within_3x"] = out["ratio_probe_over_duckdb"] <= 3.0
    out["k3_max_rel_diff"] = _rel(probe["k3"], duck["k3"])
    out["store_fast_s"], out["store_reference_s"] = fast["wall_s"], ref["wall_s"]
    out["speedup_store_fast_over_reference"] = ref["wall_s"] / fast["wall_s"]
    out["same_tokens_fast_and_reference"] = fast["tokens"] == ref["tokens"]
    out["load_after"] = _load()
    return out


def bench_metrics_duckdb() -> dict[str, Any]:
    from tests.bench.metrics import write_synthetic_store

    out: dict[str, Any] = {"load_before": _load(), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.parquet"
        out["store"] = write_synthetic_store(path, METRICS_TOKENS)
        tries = []
        for _ in range(REPEATS):
            tries.append(("probe", _child(_probe_metrics, str(path), None)))
            tries.append(("duckdb", _child(_duckdb_five, str(path))))
            tries.append(("probe_1_worker", _child(_probe_metrics, str(path), 1)))
            tries.append(("untuned", _child(_probe_metrics, str(path), 1, tuned=False)))
            tries.append(("two_at_once", _two_at_once(_probe_metrics, str(path), 1)))
    probe, duck, serial, untuned, shared = (
        _best(tries, n) for n in ("probe", "duckdb", "probe_1_worker", "untuned", "two_at_once")
    )
    out["probe_all_metrics"] = {"wall_s": probe["wall_s"], "peak_rss_mb": probe["peak_rss_mb"],
                                "pandas_imported": probe["pandas_imported"]}  # fmt: skip
    out["probe_1_worker"] = {"wall_s": serial["wall_s"], "peak_rss_mb": serial["peak_rss_mb"]}
    out["duckdb_five_metrics"] = {"wall_s": duck["wall_s"], "peak_rss_mb": duck["peak_rss_mb"]}
    out["ratio_probe_over_duckdb"] = probe["wall_s"] / duck["wall_s"]
    out["within_2x"] = out["ratio_probe_over_duckdb"] <= 2.0
    out["speedup_all_workers_over_1"] = serial["wall_s"] / probe["wall_s"]
    out["probe_1_worker_glibc_default_malloc"] = {"wall_s": untuned["wall_s"]}
    # what two cores can give: one worker each in two processes at once, against one alone
    out["probe_1_worker_two_processes_at_once"] = {"wall_s": shared["wall_s"]}
    out["slowdown_two_processes_at_once"] = shared["wall_s"] / serial["wall_s"]
    out["speedup_kept_freed_memory_1_worker"] = untuned["wall_s"] / serial["wall_s"]
    exact = {r["exact"] for n, r in tries if n != "duckdb"}  # every probe run: the same bits
    out["bit_identical_1_vs_all_workers"] = len(exact) == 1
    out["five_max_rel_diff"] = _rel(probe["five"], duck["five"])
    out["load_after"] = _load()
    return out
