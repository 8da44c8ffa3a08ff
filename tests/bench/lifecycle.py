"""A scan's overhead (wall time outside generation and rescoring) and the engine's lifecycle.

* ``single``: a default scan (the embedded model, all bundled prompts, default options).
* ``matrix``: the ``make demo`` precision comparison (16 prompts, 64 tokens, bf16/fp16/fp32
  rollouts x KV cache auto/fp8: 6 engines).
* ``rescoring_around_engine``: the rescorer's tokens/s in one process before and after an
  in-process engine started and stopped there (the engine binds memory, replaces
  ``torch.set_num_threads``, writes the environment; all restored), and what differs in the
  process state afterwards (``[]``: nothing).
* ``engine_modes``: start and stop seconds of the default model's engine in process and as
  vLLM's engine-core and worker processes.
* ``frozen_heap``: start and stop seconds of the same in-process engine, alternately with the
  garbage collector's heap of before the engine frozen (``process.frozen_heap``, what a
  scan does) and without (vLLM's five full collections per start then traverse every object
  torch, transformers and vLLM built).
* ``import_floor``: the seconds a scan's imports take alone (torch, transformers, vLLM's
  ``LLM`` and the CPU worker's modules, collection paused as in a scan); each scan reports the
  share they would be of its wall time if nothing but them, generation and rescoring took any.

Each measurement runs in a fresh spawned process, imports included, as a user's ``probe scan``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The share of wall time outside generation and rescoring that issue 11 allows.
GOALS = {"single": 0.25, "matrix": 0.15}
MATRIX_PROMPTS, MATRIX_TOKENS = 16, 64
MATRIX_DTYPES, MATRIX_KV = ("bfloat16", "float16", "float32"), ("auto", "fp8")
REPEATS = 3
LEAK_ROUNDS = 4


def _scan(kind: str) -> dict[str, Any]:
    """Runs in a spawned child: one scan, its wall time and phase split."""
    import io

    from rich.console import Console

    from mismatch_probe.pipeline.config import ScanConfig
    from mismatch_probe.pipeline.scan import run_scan
    from mismatch_probe.sampling import SamplingSpec

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "single":
            cfg = ScanConfig(out=Path(tmp))
        else:
            cfg = ScanConfig(
                num_prompts=MATRIX_PROMPTS,
                sampling=SamplingSpec(max_tokens=MATRIX_TOKENS),
                rollout_dtypes=MATRIX_DTYPES,
                kv_cache_dtypes=MATRIX_KV,
                out=Path(tmp),
            )
        result = run_scan(cfg, Console(file=io.StringIO()))
    wall = time.perf_counter() - start
    phases = dict(result.run["timings"])
    phases["other"] = wall - sum(phases.values())  # imports outside phases, setup
    useful = phases.get("generation", 0.0) + phases.get("rescoring", 0.0)
    return {
        "settings": len(result.settings),
        "engine_modes": sorted({r["engine_mode"] for r in result.run["rollouts"]}),
        "response_tokens": sum(m["num_tokens"] for m in result.settings.values()),
        "wall_s": wall,
        "phases_s": phases,
        "overhead_share": (wall - useful) / wall,
        "goal": GOALS[kind],
        "meets_goal": (wall - useful) / wall <= GOALS[kind],
    }


def _import_floor() -> dict[str, Any]:
    """Runs in a spawned child: the imports a scan cannot do without, timed alone."""
    import gc

    modules = len(sys.modules)
    start = time.perf_counter()
    gc.disable()  # as process.importing does in a scan
    import torch  # noqa: F401

    torch_s = time.perf_counter() - start
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    transformers_s = time.perf_counter() - start - torch_s
    from mismatch_probe.engine.process import import_vllm_quietly

    import_vllm_quietly()
    from vllm import LLM  # noqa: F401
    from vllm.model_executor.models import llama  # noqa: F401
    from vllm.v1.worker import cpu_model_runner, cpu_worker  # noqa: F401

    total = time.perf_counter() - start
    gc.enable()
    return {
        "torch_s": torch_s,
        "transformers_s": transformers_s,
        "vllm_s": total - torch_s - transformers_s,
        "total_s": total,
        "modules": len(sys.modules) - modules,
    }


def _frozen_heap_ab() -> dict[str, Any]:
    """Runs in a spawned child: one in-process engine started and stopped ``REPEATS`` times
    with the heap frozen and as many without, alternately, after a first start (imports)."""
    from contextlib import nullcontext

    from mismatch_probe import models
    from mismatch_probe.engine import process, rollout
    from mismatch_probe.sampling import SamplingSpec
    from mismatch_probe.settings import RolloutSetting

    model_dir = models.prepare_default_model()
    kwargs = rollout.engine_kwargs(model_dir, RolloutSetting("bfloat16"), SamplingSpec(), 1024, {})
    with rollout.engine(kwargs):
        pass
    frozen_heap = process.frozen_heap
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(REPEATS):
        for name, scope in (("frozen", frozen_heap), ("not_frozen", nullcontext)):
            process.frozen_heap = scope  # type: ignore[assignment]
            start = time.perf_counter()
            with rollout.engine(kwargs):
                started = time.perf_counter()
            stopped = time.perf_counter()
            process.frozen_heap = frozen_heap
            entry = times.setdefault(name, {"start_s": [], "stop_s": []})
            entry["start_s"].append(started - start)
            entry["stop_s"].append(stopped - started)
    best = {name: {k: min(v) for k, v in entry.items()} for name, entry in times.items()}
    return {
        "repeats": REPEATS,
        **best,
        "start_ratio_not_frozen_over_frozen": best["not_frozen"]["start_s"]
        / best["frozen"]["start_s"],
        "stop_ratio_not_frozen_over_frozen": best["not_frozen"]["stop_s"]
        / best["frozen"]["stop_s"],
    }


def _requests(vocab: int) -> list[Any]:
    import numpy as np

    from mismatch_probe.training.rescore import ScoreRequest

    rng = np.random.default_rng(0)
    return [
        ScoreRequest(
            rng.integers(0, vocab, rng.integers(20, 80)).tolist(),
            rng.integers(0, vocab, rng.integers(30, 160)).tolist(),
        )
        for _ in range(32)
    ]


def _rescoring_around_engine() -> dict[str, Any]:
    """Runs in a spawned child: rescoring tokens/s before and after an in-process engine."""
    from mismatch_probe import models
    from mismatch_probe.engine import process, rollout
    from mismatch_probe.prompts import EncodedPrompt
    from mismatch_probe.sampling import SamplingSpec
    from mismatch_probe.settings import RolloutSetting
    from mismatch_probe.training import rescore

    model_dir = models.prepare_default_model()
    model = rescore.load_model(model_dir, "float32")
    requests = _requests(model.config.vocab_size)
    tokens = sum(len(r.response_ids) for r in requests)
    spec = SamplingSpec()

    def best_tokens_per_s() -> float:
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            rescore.rescore(model, requests, spec, 1e-4)
            seconds.append(time.perf_counter() - start)
        return tokens / min(seconds)

    rescore.rescore(model, requests, spec, 1e-4)  # warm-up
    import vllm.platforms  # noqa: F401  (its import sets variables of its own, once)

    before_state = process.capture_state()
    before = best_tokens_per_s()
    kwargs = rollout.engine_kwargs(model_dir, RolloutSetting("bfloat16"), spec, 1024, {})
    prompt = EncodedPrompt(0, "", tuple(requests[0].prompt_ids))
    with rollout.engine(kwargs) as llm:
        rollout.generate(llm, [prompt], spec, 4)  # the engine's threads at work
    after = best_tokens_per_s()
    return {
        "response_tokens": tokens,
        "repeats": REPEATS,
        "before_tokens_per_s": before,
        "after_tokens_per_s": after,
        "after_over_before": after / before,
        "state_differences_after": before_state.differences(process.capture_state()),
    }


def _engine_modes() -> dict[str, Any]:
    """Runs in a spawned child: start/stop seconds of each engine mode, default model; then
    the resident memory and Python objects left after each of several in-process engines."""
    import gc

    from mismatch_probe import models
    from mismatch_probe.engine import rollout
    from mismatch_probe.sampling import SamplingSpec
    from mismatch_probe.settings import RolloutSetting

    model_dir = models.prepare_default_model()
    kwargs = rollout.engine_kwargs(model_dir, RolloutSetting("bfloat16"), SamplingSpec(), 1024, {})
    out: dict[str, Any] = {}
    for mode, value in ((rollout.IN_PROCESS, "0"), (rollout.MULTIPROCESS, "1")):
        args = dict(kwargs)
        if value == "1":
            args.pop("distributed_executor_backend", None)
        env = {**rollout.engine_env(kwargs=args), rollout.MULTIPROCESSING_ENV: value}
        assert os.environ.get(rollout.MULTIPROCESSING_ENV) is None
        start = time.perf_counter()
        with rollout.engine(args, env):
            started = time.perf_counter()
        stopped = time.perf_counter()
        out[mode] = {"start_s": started - start, "stop_s": stopped - started}
    out["start_ratio"] = out[rollout.MULTIPROCESS]["start_s"] / out[rollout.IN_PROCESS]["start_s"]
    rss, objects = [], []  # after each of several in-process engines: what stays behind
    for _ in range(LEAK_ROUNDS):
        with rollout.engine(kwargs):
            pass
        rss.append(_rss_mb())
        objects.append(len(gc.get_objects()))
    out["in_process_rss_mb_after_each_stop"] = rss
    out["in_process_rss_mb_growth_per_engine"] = (rss[-1] - rss[0]) / (LEAK_ROUNDS - 1)
    out["in_process_python_objects_after_each_stop"] = objects
    return out


def _rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _run(conn: Any, fn: Any, args: tuple[Any, ...]) -> None:
    conn.send(fn(*args))
    conn.close()


def _in_child(fn: Any, *args: Any) -> dict[str, Any]:
    """``fn(*args)`` in a fresh spawned process (not a daemon: an engine starts processes)."""
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_run, args=(send, fn, args))
    child.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        raise RuntimeError(f"{fn.__name__} failed in its child process") from None
    finally:
        child.join()
    return dict(result)


def bench_lifecycle() -> dict[str, Any]:
    scans = {"single": _in_child(_scan, "single"), "matrix": _in_child(_scan, "matrix")}
    floor = _in_child(_import_floor)
    for scan in scans.values():  # the share if the imports were the only overhead
        useful = scan["phases_s"].get("generation", 0.0) + scan["phases_s"].get("rescoring", 0.0)
        scan["import_floor_share"] = floor["total_s"] / (floor["total_s"] + useful)
    return {
        **scans,
        "import_floor": floor,
        "frozen_heap": _in_child(_frozen_heap_ab),
        "rescoring_around_engine": _in_child(_rescoring_around_engine),
        "engine_modes": _in_child(_engine_modes),
    }
