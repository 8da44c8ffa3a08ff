"""``probe`` commands in processes forked from one that has imported everything already.

A ``probe scan`` process spends most of a tiny scan importing torch, vLLM and transformers
(20 s on a slow CPU). ``Forker`` starts one process that imports them and ``mismatch_probe.cli``
once, then forks a child per command: the child is a fresh process with its own session (a
process group to signal, as ``start_new_session``), stdout to a file or /dev/null, stderr to a
file, its own working directory, environment and ``sys.argv``, and runs ``cli.main()`` to its
exit code, as the console script does. The forking process has started no thread or engine,
so a child is as clean as a new process that has just imported the same modules. A test that
checks the console script itself or the output of the imports (``--verbose``) starts a real
subprocess instead.

Protocol: one JSON line per command on the forker's stdin (``args``, ``env``, ``stderr``,
``stdout`` (null: /dev/null), ``cwd`` (null: the forker's), ``pid_file``, ``exit_file``); the
forker writes the child's pid to ``pid_file`` once forked and its exit code (negative: killed
by that signal) to ``exit_file`` once reaped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

FORKER = r"""
import json, os, select, sys
from mismatch_probe import cli
from mismatch_probe.engine.process import import_vllm_quietly
import_vllm_quietly()
import transformers, vllm.entrypoints.llm  # noqa: F401  (what a scan imports anyway)

def child(job):
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    out = job.get("stdout")
    os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if out else null, 1)
    os.dup2(os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    if job.get("cwd"):
        os.chdir(job["cwd"])
    os.environ.update(job["env"])
    sys.argv = ["probe", *job["args"]]
    code = 1
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

exits, stdin_open, pending = {}, True, b""
while stdin_open or exits:
    if stdin_open and select.select([0], [], [], 0.05)[0]:
        data = os.read(0, 1 << 16)  # unbuffered: no line may wait in a buffer select cannot see
        stdin_open = bool(data)
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            job = json.loads(line)
            pid = os.fork()
            if pid == 0:
                child(job)
            exits[pid] = job["exit_file"]
            with open(job["pid_file"] + ".tmp", "w") as f:
                f.write(str(pid))
            os.replace(job["pid_file"] + ".tmp", job["pid_file"])
    elif not stdin_open:
        select.select([], [], [], 0.05)
    while exits:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        path = exits.pop(pid)
        with open(path + ".tmp", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(path + ".tmp", path)
"""


class Forker:
    """The forking process; ``start`` forks a ``probe`` command, ``exit_code`` polls it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lock = threading.Lock()

    def start(
        self,
        args: list[str],
        env: dict[str, str],
        stderr: Path,
        stdout: Path | None = None,
        cwd: Path | None = None,
    ) -> tuple[int, Path]:
        """Fork ``probe ARGS``: its pid and the file its exit code will be written to."""
        pid_file, exit_file = stderr.with_suffix(".pid"), stderr.with_suffix(".exit")
        job = {"args": args, "env": env, "stderr": str(stderr)}
        job |= {"stdout": str(stdout) if stdout else None, "cwd": str(cwd) if cwd else None}
        job |= {"pid_file": str(pid_file), "exit_file": str(exit_file)}
        with self.lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        deadline = time.monotonic() + 300
        while not pid_file.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the forking process ended ({self.proc.returncode})")
            time.sleep(0.05)
        return int(pid_file.read_text()), exit_file

    def run(self, args: list[str], env: dict[str, str], stderr: Path, stdout: Path,
            cwd: Path, timeout: float = 1800) -> int:  # fmt: skip
        """Fork ``probe ARGS`` and wait for its exit code (negative: killed by that signal)."""
        _, exit_file = self.start(args, env, stderr, stdout, cwd)
        deadline = time.monotonic() + timeout
        while not exit_file.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"probe {' '.join(args)} did not end ({self.proc.returncode})")
            time.sleep(0.05)
        return int(exit_file.read_text())

    def close(self) -> None:
        """Wait for every child to be reaped, then for the forker to end."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=600)
