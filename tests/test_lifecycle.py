"""The engine's life in a scan, from the outside: interrupts, failed starts, quiet output.

Each test runs ``probe scan`` on the tiny model in a process of its own (forked from one that
imported torch, vLLM and transformers once, ``tests/forked_cli.py``, or the console script; its
own process group, so that a signal reaches the scan as Ctrl-C reaches it in a terminal) and
watches the process table while it runs: no process the scan started may outlive it. The stage to
interrupt is read from the scan's stage trace (``MISMATCH_PROBE_STAGE_TRACE``); stages shorter
than a signal's round trip are held open with ``MISMATCH_PROBE_STAGE_HOLD``. The scans run
side by side (module fixture ``outcomes``); the tests then read their outcomes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe import store
from mismatch_probe.engine.process import descendants, root_cause
from tests.forked_cli import Forker

pytestmark = pytest.mark.engine

KV = f"kv_cache_memory_bytes={64 << 20}"
STOP_BOUND_S = 60.0  # a hang (the 600 s ready-timeout, an engine left running) is far above


@dataclass
class Outcome:
    code: int
    stderr: str
    stages: list[str]
    seen: dict[int, str]  # every process below the scan while it ran: pid -> start time
    after_signal_s: float
    tmp_path: Path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n{"prompt": "What is the capital of France?"}\n')
    return path


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return None if fields[0] == "Z" else fields[19]


def survivors(seen: dict[int, str], grace_s: float = 10.0) -> list[int]:
    """The processes of ``seen`` still alive (same pid, same start time) after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [pid for pid, start in seen.items() if _start_time(pid) == start]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def run_scan(
    args: list[str],
    tmp_path: Path,
    at_stage: str | None = None,
    signum: int = signal.SIGINT,
    env: dict[str, str] | None = None,
    forker: Forker | None = None,
) -> Outcome:
    """Run ``probe scan ARGS`` (forked by ``forker``, else the console script); when
    ``at_stage`` is given, signal the process group as soon as the scan enters that stage."""
    trace = tmp_path / "stages.txt"
    stderr_path = tmp_path / "stderr.txt"
    scan_env = {"MISMATCH_PROBE_STAGE_TRACE": str(trace), **(env or {})}
    if forker is not None:
        pid, exit_file = forker.start(["scan", *args], scan_env, stderr_path)
        proc = None
    else:
        probe = Path(sys.executable).with_name("probe")
        with open(stderr_path, "w") as stderr:
            proc = subprocess.Popen(
                [str(probe), "scan", *args],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env={**os.environ, **scan_env},
                start_new_session=True,
            )
        pid = proc.pid

    def running() -> bool:
        return proc.poll() is None if proc is not None else not exit_file.is_file()

    seen: dict[int, str] = {}
    signalled_at = None
    deadline = time.monotonic() + 600
    stages: list[str] = []
    while running() and time.monotonic() < deadline:
        for child in descendants(pid):
            start = _start_time(child)
            if start is not None:
                seen.setdefault(child, start)
        stages = trace.read_text().split("\n")[:-1] if trace.exists() else []
        if at_stage and signalled_at is None and stages and stages[-1] == at_stage:
            os.killpg(pid, signum)
            signalled_at = time.monotonic()
        time.sleep(0.1)
    if running():
        os.killpg(pid, signal.SIGKILL)
        pytest.fail(f"probe scan did not finish; stages {stages}")
    code = proc.returncode if proc is not None else int(exit_file.read_text())
    after = time.monotonic() - signalled_at if signalled_at is not None else 0.0
    stages = trace.read_text().split("\n")[:-1] if trace.exists() else []
    return Outcome(code, stderr_path.read_text(), stages, seen, after, tmp_path)


def scan_args(model: Path, prompts: Path, out: Path, max_tokens: int = 8) -> list[str]:
    return [
        "--model", str(model), "--prompts", str(prompts), "--out", str(out),
        "--rollout-dtype", "float32", "--max-tokens", str(max_tokens), "--vllm-arg", KV,
    ]  # fmt: skip


INTERRUPTS = {
    # stage: (signal, exit code, hold the stage open, max tokens)
    "engine start": (signal.SIGINT, 130, False, 8),
    "generation": (signal.SIGTERM, 143, False, 400),
    "rescoring": (signal.SIGINT, 130, True, 8),
    "metrics": (signal.SIGTERM, 143, True, 8),
}
MULTIPROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
PARALLEL = 3  # scans run side by side (each mostly waits on one core): the suite's wall time


# A weights file that is valid safetensors (the checks before an engine starts pass) holding a
# tensor the model does not have: the engine fails while it loads the weights.
BOGUS = "bogus_down_proj"
ENGINE_CAUSE = "There is no module or parameter named"


def misnamed_model(tiny_model: Path, tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    model = tmp_path / "misnamed"
    model.mkdir(exist_ok=True)
    for path in tiny_model.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    weights = load_file(model / "model.safetensors")
    name = next(k for k in weights if ".mlp.down_proj." in k)
    weights[name.replace("down_proj", BOGUS)] = weights.pop(name)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def _scenarios(model: Path, prompts: Path, root: Path) -> dict[str, dict[str, Any]]:
    """Every subprocess scan of this module: ``run_scan`` keyword arguments by name."""
    out: dict[str, dict[str, Any]] = {}
    for stage, (signum, _, hold, max_tokens) in INTERRUPTS.items():
        tmp = root / stage.replace(" ", "_")
        args = [*scan_args(model, prompts, tmp / "run", max_tokens), "--samples-per-prompt", "8"]
        env = {"MISMATCH_PROBE_STAGE_HOLD": stage} if hold else {}
        out[stage] = {"args": args, "tmp_path": tmp, "at_stage": stage, "signum": signum}
        out[stage]["env"] = env
    tmp = root / "mp_sigterm"
    out["mp_sigterm"] = {
        "args": [*scan_args(model, prompts, tmp / "run", 400), "--verbose"],
        "tmp_path": tmp,
        "at_stage": "generation",
        "signum": signal.SIGTERM,
        "env": MULTIPROCESS,
    }
    tmp = root / "mp_multiturn"  # trajectories in the engine's request loop: none outlives
    turns_file = tmp / "turns.jsonl"
    turns_file.parent.mkdir(parents=True, exist_ok=True)
    conversation = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": None},
    ]
    turns_file.write_text(json.dumps({"messages": conversation}) + "\n")  # fmt: skip
    out["mp_multiturn"] = {
        "args": [*scan_args(model, turns_file, tmp / "run", 200), "--samples-per-prompt", "4"],
        "tmp_path": tmp,
        "at_stage": "generation",
        "signum": signal.SIGTERM,
        "env": MULTIPROCESS,
    }
    for name, env in (("mp_failed", MULTIPROCESS), ("in_process_failed", {})):
        tmp = root / name
        tmp.mkdir(parents=True)
        bad = misnamed_model(model, tmp)
        out[name] = {"args": scan_args(bad, prompts, tmp / "run"), "tmp_path": tmp, "env": env}
    return out


@pytest.fixture(scope="module")
def outcomes(
    tiny_model: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Outcome]:
    """The module's scans, run ``PARALLEL`` at a time: forked from one process that imported
    torch, vLLM and transformers once (``tests/forked_cli.py``), except ``mp_sigterm``, whose
    ``--verbose`` output includes what those imports print, so it runs the console script."""
    from concurrent.futures import ThreadPoolExecutor

    scenarios = _scenarios(tiny_model, prompts, tmp_path_factory.mktemp("scans"))
    for kwargs in scenarios.values():
        kwargs["tmp_path"].mkdir(parents=True, exist_ok=True)
    forker = Forker()
    try:
        with ThreadPoolExecutor(PARALLEL) as pool:
            longest_first = sorted(scenarios, key=lambda name: not name.startswith("mp_"))
            futures = {
                name: pool.submit(
                    run_scan, **scenarios[name], forker=None if name == "mp_sigterm" else forker
                )
                for name in longest_first  # multiprocess engines: two more processes to start
            }
            return {name: future.result() for name, future in futures.items()}
    finally:
        forker.close()


@pytest.mark.parametrize("stage", list(INTERRUPTS))
def test_interrupt_stops_with_one_line_and_no_engine_left(
    stage: str, outcomes: dict[str, Outcome]
) -> None:
    _, code, _, _ = INTERRUPTS[stage]
    result = outcomes[stage]
    out = result.tmp_path / "run"
    lines = result.stderr.strip().splitlines()
    assert result.code == code, result.stderr[-3000:]
    assert lines[-1].startswith(f"interrupted during {stage}; "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.after_signal_s < STOP_BOUND_S
    assert survivors(result.seen) == []
    if stage == "metrics":  # the token store was written before the metrics: kept, complete
        assert "complete files kept: " in lines[-1]
        assert store.TOKENS_FILE in lines[-1] and store.SEQUENCES_FILE in lines[-1]
        assert (out / store.TOKENS_FILE).is_file()
        assert not (out / store.RUN_FILE).exists()
    else:
        assert lines[-1].endswith("; nothing written")
        assert not (out / store.TOKENS_FILE).exists()
    assert not list(out.rglob(".*partial*")) if out.exists() else True


def test_sigterm_stops_a_multiprocess_engine(outcomes: dict[str, Outcome]) -> None:
    """The engine-core and worker processes of a multiprocess engine (the GPU default) end
    with the scan; --verbose shows the engine's log on the terminal."""
    result = outcomes["mp_sigterm"]
    assert result.code == 143, result.stderr[-3000:]
    # (--verbose: Python's resource tracker may add its own note after ours, on its exit)
    assert "interrupted during generation; nothing written" in result.stderr.splitlines()
    assert len(result.seen) >= 2  # the engine core and its worker ran in their own processes
    assert survivors(result.seen) == []
    assert "Triton is installed" in result.stderr  # --verbose: the engine's own output


def test_an_interrupted_multi_turn_scan_leaves_no_engine(outcomes: dict[str, Outcome]) -> None:
    """SIGTERM while multi-turn trajectories advance in a multiprocess engine's request loop:
    one line, nothing written, no engine process left."""
    result = outcomes["mp_multiturn"]
    assert result.code == 143, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("interrupted during generation; ")
    assert "Traceback" not in result.stderr
    assert len(result.seen) >= 2 and survivors(result.seen) == []


def test_failed_engine_start_names_the_root_cause(outcomes: dict[str, Outcome]) -> None:
    """Weights the model does not have, in-process engine: one line that names the loader's
    error, and the engine log (traceback included) named in it."""
    result = outcomes["in_process_failed"]
    lines = result.stderr.strip().splitlines()
    assert result.code == 2, result.stderr[-3000:]
    assert len(lines) == 1 and ENGINE_CAUSE in lines[0] and BOGUS in lines[0], lines
    log = Path(lines[0].rsplit("(engine log: ", 1)[1].rstrip(")"))
    assert "Traceback" in log.read_text() and BOGUS in log.read_text()


def test_failed_multiprocess_engine_start_leaves_no_process(
    outcomes: dict[str, Outcome],
) -> None:
    """The same in a multiprocess engine: vLLM's own message says "see root cause above"; ours
    names the worker's error, found in the engine log; no engine process is left."""
    result = outcomes["mp_failed"]
    lines = result.stderr.strip().splitlines()
    assert result.code == 2, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert ENGINE_CAUSE in lines[0] and "root cause above" not in lines[0]
    assert len(result.seen) >= 2  # the engine core and the worker were started
    assert survivors(result.seen) == []


def test_a_signal_a_library_swallowed_still_ends_as_interrupted() -> None:
    """pydantic-core, building a validator inside vLLM's engine start, turned our exception into
    a ``SchemaError`` (seen once in the suite): the run must still end as interrupted."""
    from mismatch_probe import interrupt

    with (
        pytest.raises(interrupt.Interrupted) as info,
        interrupt.handled(),
        interrupt.stage("engine start"),
    ):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here
        except BaseException:
            raise ValueError("SchemaError: Error building validator") from None
    assert (info.value.stage, info.value.exit_code) == ("engine start", 130)
    interrupt.reraise_swallowed()  # handled() forgot the signal on exit: nothing to raise


def test_root_cause_skips_vllm_wrappers(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(
        "old: ValueError: from an earlier engine\n"
        "(Worker pid=1) ERROR 12-01 02:20:02 [multiproc_executor.py:953] "
        "safetensors._safetensors_rust.SafetensorError: Error while deserializing header\n"
        "Exception: WorkerProc initialization failed. See stack trace for root cause.\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    offset = len("old: ValueError: from an earlier engine\n")
    found = root_cause(log, offset)
    assert found == "SafetensorError: Error while deserializing header"
    assert root_cause(log, len(log.read_text())) is None


def test_in_process_engine_gives_the_process_back(engines: Any) -> None:
    """What an in-process engine changes (NUMA memory policy, ``torch.set_num_threads``, a
    dozen environment variables) is back as it was once the engine is gone; the engine stops
    without the full garbage collections of vLLM's teardown."""
    import gc

    import vllm  # noqa: F401  (its import sets variables of its own, once: not the engine's)

    from mismatch_probe.engine.process import capture_state

    engines.close()
    before, freeze = capture_state(), gc.freeze
    engines.get("float32", "processed")
    during = before.differences(capture_state())
    frozen_during = gc.get_freeze_count()
    collect = gc.collect
    engines.close()
    assert gc.collect is collect  # put back after the shutdown
    assert "set_num_threads" in during and "env LD_PRELOAD" in during  # the engine changed them
    assert before.differences(capture_state()) == []
    assert frozen_during > 100_000  # the heap of before the engine (torch, vLLM, transformers)
    assert gc.get_freeze_count() == 0 and gc.freeze is freeze  # given back


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _import_afresh(name: str) -> None:
    """Import the standard library module ``name`` as if for the first time."""
    import importlib

    sys.modules.pop(name, None)
    importlib.import_module(name)


# A frozen object freed meanwhile (by reference counting, on any thread) leaves the frozen
# generation, so "nothing was frozen or unfrozen" is: the count did not grow, and fell by no
# more than this; each body keeps 1000 new objects alive, which a freeze would add.
_FREED_MEANWHILE = 500


def _unchanged(before: int) -> bool:
    import gc

    return before - _FREED_MEANWHILE <= gc.get_freeze_count() <= before


def test_frozen_heap_hides_the_old_heap_and_gives_it_back() -> None:
    """In ``frozen_heap`` a full collection sees only what the body created (a cycle made
    there is still freed), ``gc.freeze`` and ``gc.unfreeze`` are no-ops (vLLM's), ``importing``
    freezes the heap again when its body imported something; on exit everything is unfrozen,
    nested scopes change nothing, and a heap the caller froze stays as the caller left it."""
    import gc
    import weakref

    from mismatch_probe.engine.process import frozen_heap, importing

    gc.collect()
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        gc.unfreeze()  # as vLLM's shutdown does: nothing happens
        assert _unchanged(frozen)
        cycle = _Cycle()
        dead = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert dead() is None  # what the body created is still collected
        with importing():
            assert not gc.isenabled()
            kept = [_Cycle() for _ in range(2000)]
            _import_afresh("tabnanny")
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + 1000
        with frozen_heap():  # nested: nothing changes
            pass
        count = gc.get_freeze_count()
        with importing():  # nothing imported (an engine after the first): nothing frozen
            garbage = [_Cycle() for _ in range(1000)]
        assert _unchanged(count) and len(garbage) == 1000
        assert gc.get_freeze_count() >= frozen + 1000
    assert gc.get_freeze_count() == 0 and len(kept) == 2000
    gc.freeze()  # a heap the caller froze is the caller's: not frozen further, not unfrozen
    try:
        theirs = gc.get_freeze_count()
        with frozen_heap():
            gc.unfreeze()  # vLLM's: silenced
            with importing():
                mine = [_Cycle() for _ in range(1000)]
                _import_afresh("pyclbr")
            assert _unchanged(theirs) and len(mine) == 1000
        assert _unchanged(theirs)
    finally:
        gc.unfreeze()


def test_frozen_heap_and_importing_give_the_collector_back_on_errors() -> None:
    import gc

    from mismatch_probe.engine.process import frozen_heap, importing

    freeze, unfreeze = gc.freeze, gc.unfreeze
    with pytest.raises(KeyError), frozen_heap(), importing():
        raise KeyError("interrupted")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert (gc.freeze, gc.unfreeze) == (freeze, unfreeze)
    with frozen_heap():  # and the next scope works as the first did
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
