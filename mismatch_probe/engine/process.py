"""What an engine does to the process it runs in, and how the process gets it back.

An in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) starts in seconds instead of
tens of seconds, but it changes the process: its CPU platform writes a dozen environment
variables (``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``, ``NUMEXPR_MAX_THREADS``, ...), its CPU worker
replaces ``torch.set_num_threads`` with a function that refuses to change the thread count and
binds memory allocation to a NUMA node (``set_mempolicy(MPOL_BIND)``). ``preserved`` snapshots
everything of this kind that later work in the process depends on (torch's thread counts and
``set_num_threads``, the CPU affinity, the NUMA memory policy, the environment) and restores it
exactly when the engine is gone.

``captured`` sends what the engine and its libraries print (vLLM's log, Triton's and torch's
warnings, C++ messages; also the output of engine processes started meanwhile, which inherit
the descriptors) to a log file, while the tool's own output (progress bars, written to
``sys.stderr``) still reaches the terminal. ``root_cause`` finds the real error of a failed
start in that log.

The garbage collector: vLLM, torch and transformers build about 700,000 objects that live as
long as the process, and every full collection traverses all of them (0.3 s each on a fast
CPU). Python's thresholds trigger about ten while they are imported, vLLM runs five per engine
start and more at shutdown. A scan runs in ``frozen_heap`` (so does each engine): what exists
on entry, and what ``importing`` blocks build, is frozen (``gc.freeze``), hidden from every
collection of the scan; ``collect_later`` skips the collections of an engine's teardown, which
free nothing its reference counts do not already free. ``make bench`` (``lifecycle``)
measures an engine's start and stop with and without the frozen heap.
"""

from __future__ import annotations

import ctypes
import gc
import io
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

# get_mempolicy / set_mempolicy system call numbers (Linux): x86-64, aarch64.
_MEMPOLICY_SYSCALLS = {"x86_64": (239, 238), "aarch64": (236, 237)}
_MAX_NODES = 1024  # bits of the node mask
KEEP_LOGS = 20  # engine logs kept in the cache, newest first


@dataclass(frozen=True)
class ProcessState:
    """The parts of a process an engine changes that later work depends on."""

    torch_threads: int
    set_num_threads: Any  # torch.set_num_threads (vLLM's CPU worker replaces it)
    affinity: frozenset[int] | None  # os.sched_getaffinity(0), None where unsupported
    mempolicy: tuple[int, tuple[int, ...]] | None  # (mode, node mask words), None: unknown
    environ: dict[str, str] = field(repr=False)

    def differences(self, other: ProcessState) -> list[str]:
        """What differs from ``other``, by name (``[]``: the same state)."""
        names = ["torch_threads", "set_num_threads", "affinity", "mempolicy"]
        changed = [n for n in names if getattr(self, n) != getattr(other, n)]
        keys = set(self.environ) | set(other.environ)
        changed += sorted(f"env {k}" for k in keys if self.environ.get(k) != other.environ.get(k))
        return changed


def capture_state() -> ProcessState:
    import torch

    return ProcessState(
        torch_threads=torch.get_num_threads(),
        set_num_threads=torch.set_num_threads,
        affinity=frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        mempolicy=_get_mempolicy(),
        environ=dict(os.environ),
    )


def restore_state(state: ProcessState) -> None:
    """Put ``state`` back: environment, ``set_num_threads``, thread count, affinity, NUMA."""
    import torch

    for key in [k for k in os.environ if k not in state.environ]:
        del os.environ[key]
    for key, value in state.environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    torch.set_num_threads = state.set_num_threads
    if torch.get_num_threads() != state.torch_threads:
        torch.set_num_threads(state.torch_threads)
    if state.affinity is not None and frozenset(os.sched_getaffinity(0)) != state.affinity:
        os.sched_setaffinity(0, state.affinity)
    if state.mempolicy is not None and _get_mempolicy() != state.mempolicy:
        _set_mempolicy(*state.mempolicy)


@contextmanager
def preserved() -> Iterator[ProcessState]:
    """Restore the process state of entry on exit (also when the body raises)."""
    state = capture_state()
    try:
        yield state
    finally:
        restore_state(state)


def _mempolicy_call(number: int, *args: Any) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(ctypes.c_long(number), *args))


def _get_mempolicy() -> tuple[int, tuple[int, ...]] | None:
    """The calling thread's NUMA memory policy (mode, node mask), or None where unknown."""
    numbers = _MEMPOLICY_SYSCALLS.get(os.uname().machine)
    if numbers is None or not sys.platform.startswith("linux"):
        return None
    mode = ctypes.c_int(0)
    words = _MAX_NODES // (8 * ctypes.sizeof(ctypes.c_ulong))
    mask = (ctypes.c_ulong * words)()
    args = (ctypes.byref(mode), mask, ctypes.c_ulong(_MAX_NODES), None, ctypes.c_ulong(0))
    if _mempolicy_call(numbers[0], *args) != 0:
        return None
    return mode.value, tuple(mask)


def _set_mempolicy(mode: int, mask: tuple[int, ...]) -> None:
    numbers = _MEMPOLICY_SYSCALLS[os.uname().machine]
    words = (ctypes.c_ulong * len(mask))(*mask)
    # MPOL_DEFAULT (0) takes no node mask
    nodes = (None, ctypes.c_ulong(0)) if mode == 0 else (words, ctypes.c_ulong(_MAX_NODES))
    if _mempolicy_call(numbers[1], ctypes.c_int(mode), *nodes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy: {os.strerror(err)}")


@contextmanager
def collect_later() -> Iterator[None]:
    """Run the body with ``gc.collect`` a no-op (an engine's teardown calls it several times;
    reference counting frees the engine's tensors, cycles are left to the automatic collector)."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


_GC_FREEZE = gc.freeze  # the collector's own, whatever a scope has put in the module's place


@dataclass
class _Scope:
    """The ``frozen_heap`` scope in force (one per process at a time: shards run in turn)."""

    active: bool = False
    freezes: bool = False  # the heap was not frozen on entry: the scope freezes and unfreezes


_SCOPE = _Scope()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the garbage collector's heap for the body (a scan, or an engine's life); unfreeze
    it on exit.

    Full collections in the body, the two vLLM runs while it loads the model and the three of
    its ``freeze_gc_heap`` among them, then traverse only what the body created. vLLM's own
    ``gc.freeze`` and ``gc.unfreeze`` are no-ops meanwhile: its freeze is a serving-time
    optimisation that would keep the engine's objects (and the tensors their cycles hold) from
    ever being collected here, its unfreeze at shutdown would hand the whole heap back early.
    On exit the heap is unfrozen, so garbage frozen meanwhile is collected later as usual. A
    heap the caller froze before is the caller's: it is neither frozen further nor unfrozen (only
    vLLM's calls are silenced). A nested use changes nothing. Process-wide: one scope at a time.
    """
    if _SCOPE.active:
        yield
        return
    saved = gc.freeze, gc.unfreeze
    _SCOPE.freezes = gc.get_freeze_count() == 0
    try:
        _SCOPE.active = True
        gc.freeze = gc.unfreeze = _no_op
        if _SCOPE.freezes:
            _GC_FREEZE()
        yield
    finally:
        gc.freeze, gc.unfreeze = saved
        if _SCOPE.freezes:
            gc.unfreeze()
        _SCOPE.active = _SCOPE.freezes = False


@contextmanager
def importing() -> Iterator[None]:
    """Imports in the body: no automatic collection while they build modules that live as long
    as the process. Inside a ``frozen_heap`` that froze the heap, and when the body imported
    anything, the heap is frozen again afterwards, so no later collection of the scope traverses
    the new modules (nor the garbage of the imports not yet collected: a few MB, freed after the
    scope like the rest)."""
    enabled = gc.isenabled()
    modules = len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if _SCOPE.freezes and len(sys.modules) > modules:
            _GC_FREEZE()
        if enabled:
            gc.enable()


def _no_op() -> None:
    pass


# --- output capture ---------------------------------------------------------------------------


def new_log_path(directory: Path) -> Path:
    """A fresh engine log file in ``directory`` (older ones beyond ``KEEP_LOGS`` removed)."""
    directory.mkdir(parents=True, exist_ok=True)
    old = sorted(directory.glob("engine-*.log"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in old[KEEP_LOGS - 1 :]:
        path.unlink(missing_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return directory / f"engine-{stamp}-{os.getpid()}.log"


_current_log: list[Path] = []  # the log of the innermost ``captured`` block


def current_log() -> Path | None:
    """The file the engine's output goes to now (None: not captured, e.g. ``--verbose``)."""
    return _current_log[-1] if _current_log else None


@contextmanager
def captured(log: Path) -> Iterator[TextIO]:
    """Send file descriptors 1 and 2 to ``log``: everything printed meanwhile (by Python through
    ``sys.stdout``/``sys.stderr`` (warnings, logging), by C and C++ code, by child processes).

    Yields:
        A text stream to the original stderr (the terminal), for the tool's own output.
    """
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    log.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    terminal = open(os.dup(saved[2]), "w", encoding=encoding, errors="backslashreplace")  # noqa: SIM115
    try:
        for fd in (1, 2):
            os.dup2(log_fd, fd)
        _current_log.append(log)
        yield terminal
    finally:
        _current_log.pop()
        for stream in (sys.stdout, sys.stderr, terminal):
            _flush(stream)
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        terminal.close()
        os.close(log_fd)


def writes_to_fd(stream: Any, fd: int) -> bool:
    """True when ``stream`` writes to file descriptor ``fd`` (False for an in-memory buffer)."""
    try:
        return bool(stream.fileno() == fd)
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return False


def _flush(stream: Any) -> None:
    try:
        if stream is not None:
            stream.flush()
    except (OSError, ValueError):
        pass


# --- failures ---------------------------------------------------------------------------------

# ``module.TypeError: message``, alone on its line or after a log prefix (``... [file.py:12] ``)
_EXCEPTION_LINE = re.compile(
    r"(?:^|\] )(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.+)$"
)
_WRAPPERS = (
    "See root cause above",
    "Engine core initialization failed",
    "See stack trace for root cause",
    "See stack trace (above) for the root cause",
)


def is_wrapper(text: str) -> bool:
    """True for vLLM's message about an engine process that failed (the cause is in its log)."""
    return any(w in text for w in _WRAPPERS)


def root_cause(log: Path | None, offset: int = 0) -> str | None:
    """The last exception line (``Type: message``, module path dropped) that ``log`` got after
    byte ``offset`` and that is not vLLM's wrapper of a failed engine process, or None."""
    if log is None or not log.is_file():
        return None
    with open(log, "rb") as file:
        file.seek(offset)
        text = file.read().decode("utf-8", errors="replace")
    found = None
    for line in text.splitlines():
        match = _EXCEPTION_LINE.search(line.strip())
        if match and not is_wrapper(match.group(2)):
            found = f"{match.group(1)}: {match.group(2)}"
    return found


def append_traceback(log: Path, exc: BaseException) -> None:
    """Append ``exc``'s traceback (with its causes) to ``log``."""
    import traceback

    with open(log, "a", encoding="utf-8") as file:
        file.write("".join(traceback.format_exception(exc)))


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` on one line, the causes' messages appended where they add to it."""
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" ({type(cause).__name__}: {' '.join(str(cause).split())})"
    return text


# --- child processes --------------------------------------------------------------------------


def descendants(pid: int | None = None) -> list[int]:
    """Every live process below ``pid`` (default: this one), through ``psutil`` (zombies are
    gone, only not yet reaped, and left out)."""
    import psutil

    try:
        children = psutil.Process(os.getpid() if pid is None else pid).children(recursive=True)
    except psutil.Error:
        return []
    return [c.pid for c in children if _status(c) != psutil.STATUS_ZOMBIE]


def _status(proc: Any) -> str | None:
    import psutil

    try:
        return str(proc.status())
    except psutil.Error:
        return None  # gone meanwhile


def _is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker exits by itself when this process does, after
    removing any shared memory left behind: it is not stopped early."""
    import psutil

    try:
        return any("resource_tracker" in part for part in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def stop_children(
    timeout: float = 3.0, exclude: set[int] | frozenset[int] = frozenset()
) -> list[int]:
    """Terminate what is left below this process (an engine that outlived its shutdown, e.g.
    after an interrupt during its start), SIGKILL what is still there after ``timeout``.

    Returns:
        The process ids that were signalled.
    """
    import signal

    pids = [p for p in descendants() if p not in exclude and not _is_resource_tracker(p)]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and set(pids) & set(descendants()):
        time.sleep(0.05)
    for pid in set(pids) & set(descendants()):
        _signal(pid, signal.SIGKILL)
    return pids


def _signal(pid: int, signum: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def import_vllm_quietly(verbose: bool = False) -> None:
    """Import vLLM's platform layer once, with its import-time chatter silenced unless
    ``verbose``: Triton's "installed, but doesn't include CPU backend" (a warning of vLLM's
    logger, which has no handler yet at import, so Python's last-resort handler would print it)
    and torch's ``reduce_op`` FutureWarning. The logger's level is restored afterwards."""
    import logging
    import warnings

    if "vllm" in sys.modules:
        return
    logger = logging.getLogger("vllm")
    level = logger.level
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            if not verbose:
                warnings.simplefilter("ignore")
            import vllm.triton_utils  # noqa: F401  (where the Triton message comes from)
            from vllm.platforms import current_platform

            current_platform.is_cpu()  # resolve the platform now, inside the quiet import
    finally:
        logger.setLevel(level)
