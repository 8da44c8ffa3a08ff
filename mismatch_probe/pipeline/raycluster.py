"""The shards of a sharded scan as Ray tasks (``probe scan --ray ADDRESS --shards N``).

Each shard is one Ray task running ``sharding.run_shard`` (passed in) on the resources it asks for
(``shard_resources``): on a GPU cluster as many GPUs as the engine's tensor x pipeline parallel
size (the training model then loads onto the same GPUs, once the engine has shut down); on a
CPU-only cluster the CPUs of the smallest node, so that one shard runs per node at a time.
Tasks are not retried by Ray (``max_retries=0``): a shard whose worker dies stays unfinished
and ``--resume`` redoes it. The driver waits for every task, then reports the failed ones.

The vLLM engine runs inside the worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set in
the task's runtime environment only), so a killed worker takes its engine (and the engine's
memory) with it instead of leaving an engine-core process behind. Every node must see the
model, the prompts and ``--out`` at the same paths (a shared filesystem), and have this package
installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.pipeline.config import ScanConfig

WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def shard_resources(
    vllm_args: Mapping[str, Any], cluster_gpus: float, node_cpus: Sequence[float]
) -> dict[str, float]:
    """The Ray resources of one shard's task.

    Args:
        vllm_args: the ``--vllm-arg`` values (``tensor_parallel_size``, ``pipeline_parallel_size``).
        cluster_gpus: GPUs in the cluster (0: a CPU-only cluster).
        node_cpus: CPUs of each alive node.
    """
    if cluster_gpus > 0:
        tp = int(vllm_args.get("tensor_parallel_size", 1))
        pp = int(vllm_args.get("pipeline_parallel_size", 1))
        return {"num_gpus": float(tp * pp), "num_cpus": 1.0}
    return {"num_cpus": float(min(node_cpus)) if node_cpus else 1.0}


def require_ray() -> None:
    """Fail with one line when Ray is not installed."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ProbeError("--ray needs Ray: pip install 'mismatch_probe[ray]'")


@contextmanager
def connected(address: str, timeout: float = 10.0, verbose: bool = False) -> Iterator[None]:
    """Join (or start, for ``local``) a Ray cluster for the block; a driver that was already
    connected (``ray.init`` by the caller) stays connected.

    Ray's own output while it starts and stops (log lines, warnings) goes to a log file under
    the cache, like an engine's (to the terminal with ``verbose``). A remote cluster has
    ``timeout`` seconds to answer: its host and port must accept a connection within it, and
    ``ray.init`` must return within it (Ray's client alone retries for about 30 s).
    """
    require_ray()
    import ray

    if ray.is_initialized():
        yield
        return
    if address not in LOCAL_ADDRESSES:
        _check_reachable(address, timeout)
    with _ray_output(verbose) as log:
        try:
            if address == "local":
                ray.init(address="local", include_dashboard=False, log_to_driver=False)
            else:
                _bounded(partial(ray.init, address=address, log_to_driver=False), timeout)
        except TimeoutError:
            raise ProbeError(
                f"--ray {address}: no Ray cluster answered within {timeout:g} s{_log_note(log)} "
                "(--ray-timeout to wait longer)"
            ) from None
        except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError, ...
            raise ProbeError(
                f"--ray {address}: could not connect ({_one_line(exc)}){_log_note(log)}"
            ) from None
    try:
        yield
    finally:
        with _ray_output(verbose):
            ray.shutdown()


LOCAL_ADDRESSES = ("local", "auto")  # no host and port to check first


def _check_reachable(address: str, timeout: float) -> None:
    """Fail at once (within ``timeout``) when nothing accepts a connection at the address's
    ``host:port`` (``ray://head:10001`` or ``head:6379``); other forms are left to Ray."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if isinstance(exc, TimeoutError):
            reason = f"no answer within {timeout:g} s"
        raise ProbeError(
            f"--ray {address}: nothing accepts a connection at {host}:{port} ({reason}); check "
            "the address (--ray-timeout to wait longer)"
        ) from None


def _bounded(call: Callable[[], Any], timeout: float) -> None:
    """``call()`` in a daemon thread; ``TimeoutError`` when it has not returned in ``timeout``
    seconds (the thread is left to finish or fail on its own), its exception when it raised."""
    import threading

    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="ray-connect", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError
    if "error" in outcome:
        raise outcome["error"]


@contextmanager
def _ray_output(verbose: bool) -> Iterator[Path | None]:
    """Ray's output in the block goes to a fresh log file (yielded), or stays on the terminal
    with ``verbose`` (None)."""
    if verbose:
        yield None
        return
    from mismatch_probe import models
    from mismatch_probe.engine import process

    log = process.new_log_path(models.cache_dir() / "logs")
    with process.captured(log):
        yield log


def _log_note(log: Path | None) -> str:
    """``; Ray's log: PATH`` when the log holds anything."""
    if log is None or not log.is_file() or log.stat().st_size == 0:
        return ""
    return f"; Ray's log: {log}"


def _one_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a RayTaskError wraps the task's own exception
    text = str(cause if isinstance(cause, BaseException) else exc)
    return " ".join(text.split())[:300] or type(exc).__name__


def run_shards(
    run_shard: Callable[..., dict[str, Any]],
    cfg: ScanConfig,
    plan: list[tuple[int, int]],
    pending: list[int],
    console: Any,
) -> None:
    """Run ``run_shard(cfg, k, plan[k], out)`` for each ``pending`` shard as a Ray task (inside
    ``connected``) and wait for them all.

    Raises:
        ProbeError: when a shard's task failed (the others are finished and kept).
    """
    if not pending or cfg.out is None:
        return
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    resources = shard_resources(
        cfg.vllm_args,
        ray.cluster_resources().get("GPU", 0.0),
        [n["Resources"].get("CPU", 1.0) for n in nodes],
    )
    task = ray.remote(run_shard).options(
        **resources, max_retries=0, runtime_env={"env_vars": WORKER_ENV}
    )
    refs = {task.remote(cfg, k, plan[k], str(cfg.out)): k for k in pending}
    failed = _wait_all(refs, len(plan), console)
    if failed:
        listed = ", ".join(f"{k} ({reason})" for k, reason in sorted(failed.items()))
        raise ProbeError(
            f"shard(s) failed: {listed}; the finished shards are kept, rerun the same command "
            "with --resume to redo the failed ones"
        )


def _wait_all(refs: dict[Any, int], count: int, console: Any) -> dict[int, str]:
    """Wait for every task; ``shard -> reason`` of the failed ones."""
    import ray

    failed: dict[int, str] = {}
    while refs:
        (ready,), _ = ray.wait(list(refs), num_returns=1)
        shard = refs.pop(ready)
        try:
            info = ray.get(ready)
        except ray.exceptions.RayError as exc:
            failed[shard] = _one_line(exc)
            console.print(f"shard {shard} of {count} failed: {failed[shard]}", highlight=False)
            continue
        console.print(f"shard {shard} of {count} done on {info['host']}", highlight=False)
    return failed
