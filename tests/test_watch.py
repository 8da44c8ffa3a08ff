"""``probe watch`` against real writers: a process that writes prime-rl steps (each rank file
half-written for a while before ``STABLE``) or hook steps (two batches per step) every second
while ``probe watch`` runs in a process of its own. Every step is read once, its metrics equal
``probe ingest`` of the finished directory, the alert fires on the step a fault is injected in
and ``--on-alert`` receives it, SIGINT leaves a complete run; a rewritten step replaces the
earlier attempt and the report says so; a removed step keeps its data; a full disk (a real
tmpfs) stops nothing."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mismatch_probe.ingest import IngestConfig, parse_steps, run_ingest
from tests.ingest_fixtures import synthetic_steps, write_prime_rl
from tests.watch_writer import FAULT_SHIFT, steps_data

ROOT = Path(__file__).resolve().parent.parent
STEP_TIMEOUT = 120.0  # seconds for a step to appear in RUN on a loaded machine


def _probe(args: list[str], **kw: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mismatch_probe.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,  # type: ignore[arg-type]
    )


@contextmanager
def _writer(
    fmt: str, src: Path, steps: int, fault: int | None = None
) -> Iterator[subprocess.Popen]:
    args = [sys.executable, "-m", "tests.watch_writer", fmt, str(src), "--steps", str(steps)]
    args += ["--fault", str(fault)] if fault is not None else []
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _lines(run: Path) -> list[dict]:
    path = run / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(check, what: str, proc: subprocess.Popen, timeout: float = STEP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"probe watch exited {proc.returncode} before {what}: {err}{out}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout:g} s")
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _steps_json(run: Path) -> dict[str, dict[str, float]]:
    return json.loads((run / "steps.json").read_text())["steps"]


def test_watch_follows_a_prime_rl_writer(tmp_path: Path) -> None:
    src, run, alerts = tmp_path / "outputs", tmp_path / "run", tmp_path / "alerts"
    alerts.mkdir()
    hook = f"cat > {alerts}/alert-$$.json"
    with _writer("prime-rl", src, steps=5, fault=3) as writer:
        args = ["--until", "5", "--max", "k3_kl=0.05", "--on-alert", hook, "--interval", "0.3"]
        watch = _probe(["watch", "prime-rl", str(src), "--out", str(run), *args])
        code, out, err = _finish(watch)
        assert writer.wait(timeout=60) == 0
    assert code == 0, err
    lines = _lines(run)
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]  # every step read once, in order
    assert all(x["attempt"] == 1 for x in lines)
    # the metrics of each step are probe ingest's of the finished directory
    ingested = run_ingest(IngestConfig("prime-rl", src, tmp_path / "ingest"))
    watched = _steps_json(run)
    assert watched == {str(s): m for s, m in ingested.steps.items()}
    assert [x["sequences"] for x in lines] == [4] * 5  # never a half-written step
    # the alert fired on step 3 alone, and --on-alert got it as JSON
    assert [line for line in out.splitlines() if line.startswith("ALERT")] == [
        f"ALERT step 3: k3_kl = {watched['3']['k3_kl']:.4g} > 0.05 (max)"
    ]
    received = [json.loads(p.read_text()) for p in alerts.iterdir()]
    assert [(a["step"], a["type"]) for a in received] == [(3, "bound")]
    assert received[0]["bounds"] == [
        {"metric": "k3_kl", "kind": "max", "limit": 0.05, "value": watched["3"]["k3_kl"]}
    ]
    assert watched["3"]["k3_kl"] > 0.3  # the fault: e^-1 - 1 + 1 on every token
    assert FAULT_SHIFT == 1.0
    # RUN is a complete run: report and check read it like an ingest
    check = subprocess.run([sys.executable, "-m", "mismatch_probe.cli", "check", str(run),
                            "--step", "3", "--max", "k3_kl=0.05"], cwd=ROOT,
                           capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 1, check.stderr
    assert (run / "report.md").read_text().count("## Trend over training steps") == 1


def test_sigint_leaves_a_complete_run_of_hook_steps(tmp_path: Path) -> None:
    """Hook steps in two batches each: a step is read once its manifest is there (both
    batches); SIGINT finishes RUN as a complete run and exits 130."""
    src, run = tmp_path / "logs", tmp_path / "run"
    with _writer("probe", src, steps=30):
        watch = _probe(["watch", "probe", str(src), "--out", str(run), "--interval", "0.3"])
        _wait_for(lambda: len(_lines(run)) >= 3, "3 stored steps", watch)
        # a reader sees the last complete step while watch writes (no steps.json yet)
        check = subprocess.run([sys.executable, "-m", "mismatch_probe.cli", "check", str(run),
                                "--step", "last", "--max", "k3_kl=1"], cwd=ROOT,
                               capture_output=True, text=True)  # fmt: skip
        assert check.returncode == 0, check.stderr
        assert "✔ PASS  k3_kl" in check.stdout
        watch.send_signal(signal.SIGINT)
        code, _, err = _finish(watch)
    assert code == 130, err
    lines = _lines(run)
    stored = [x["step"] for x in lines]
    assert stored == list(range(1, len(stored) + 1))
    assert all(x["sequences"] == 4 for x in lines)  # both batches of every step
    assert f"{run} is a complete run of steps 1..{stored[-1]}" in err
    report = subprocess.run([sys.executable, "-m", "mismatch_probe.cli", "report", str(run)],
                            cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert report.returncode == 0, report.stderr
    # the stored steps are probe ingest's of the same steps of the finished directory
    ingested = run_ingest(
        IngestConfig("probe", src, tmp_path / "ingest", steps=parse_steps(f"1:{stored[-1]}"))
    )
    assert _steps_json(run) == {str(s): m for s, m in ingested.steps.items()}


def _rewrite_prime_step(src: Path, step: int, shift: float) -> None:
    """A restarted trainer writes ``step`` again: STABLE removed, the file rewritten, STABLE."""
    data = synthetic_steps([step], seqs=2, seed=7, growth=0.0)
    for s in data[step]:
        s.train = [x - shift for x in s.rollout]
    directory = src / "token_exports" / f"step_{step}"
    (directory / "STABLE").unlink()
    write_prime_rl(src, data, stable=False)
    (directory / "STABLE").touch()


def test_a_rewritten_step_replaces_and_a_removed_one_stays(tmp_path: Path) -> None:
    src, run = tmp_path / "outputs", tmp_path / "run"
    write_prime_rl(src, steps_data(2, None))
    watch = _probe(["watch", "prime-rl", str(src), "--out", str(run), "--until", "3",
                    "--interval", "0.2"])  # fmt: skip
    _wait_for(lambda: len(_lines(run)) >= 2, "2 stored steps", watch)
    _rewrite_prime_step(src, 2, shift=0.1)
    _wait_for(lambda: len(_lines(run)) >= 3, "step 2 read again", watch)
    shutil.rmtree(src / "token_exports" / "step_1")
    time.sleep(1.0)  # a few looks: the removal is seen
    write_prime_rl(src, {3: steps_data(3, None)[3]})
    code, out, err = _finish(watch)
    assert code == 0, err
    lines = _lines(run)
    assert [(x["step"], x["attempt"]) for x in lines] == [(1, 1), (2, 1), (2, 2), (3, 1)]
    steps = _steps_json(run)
    assert steps["2"]["kl"] == pytest.approx(0.1, rel=1e-5)  # the later attempt's numbers
    assert sorted(steps) == ["1", "2", "3"]  # step 1's data stays though its files went
    meta = json.loads((run / "run.json").read_text())
    assert meta["rewritten_steps"] == [{"step": 2, "attempts": 2}]
    assert meta["watch"]["removed"] == [{"step": 1, "after_reading": True}]
    assert meta["counts"]["sequences"] == 4 + 2 + 4  # step 2 counted once, its later attempt
    assert "step 1's files were removed after it was read: its data stays in RUN" in out
    assert "Step 2 was written again (a restarted trainer)" in (run / "report.md").read_text()


def test_exit_on_alert_stops_at_the_faulty_step(tmp_path: Path) -> None:
    src, run = tmp_path / "outputs", tmp_path / "run"
    write_prime_rl(src, steps_data(3, fault=2))
    exported = tmp_path / "live.jsonl"
    watch = _probe(["watch", "prime-rl", str(src), "--out", str(run), "--exit-on-alert",
                    "--max", "k3_kl=0.05", "--interval", "0.2", "--export", "jsonl",
                    "--export-out", str(exported)])  # fmt: skip
    code, out, err = _finish(watch)
    assert code == 1, err
    assert [x["step"] for x in _lines(run)] == [1, 2]
    # --export wrote each step as it was stored, verl's file-logger lines
    lines = [json.loads(x) for x in exported.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    steps = _steps_json(run)
    assert lines[1]["data"]["rollout_corr/k3_kl"] == steps["2"]["k3_kl"]
    assert lines[1]["data"]["probe/integrity/errors"] == 0.0
    assert "stopped: alert at step 2 (--exit-on-alert)" in out
    assert json.loads((run / "run.json").read_text())["counts"]["last_step"] == 2
    assert (run / "report.md").is_file()


@contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode:
        pytest.skip(f"a small tmpfs is needed for a real full disk: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_stops_nothing(tmp_path: Path) -> None:
    """RUN on a 24 MB tmpfs: filled up after step 1, step 2 is not stored (said once) and is
    stored once space is back; nothing of step 1 is lost."""
    src = tmp_path / "outputs"
    with _tmpfs(tmp_path / "disk", "24m") as disk:
        run = disk / "run"
        write_prime_rl(src, steps_data(1, None))
        watch = _probe(["watch", "prime-rl", str(src), "--out", str(run), "--until", "2",
                        "--interval", "0.2"])  # fmt: skip
        _wait_for(lambda: len(_lines(run)) >= 1, "step 1", watch)
        filler = disk / "filler"
        with filler.open("wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass
        write_prime_rl(src, {2: steps_data(2, None)[2]})
        time.sleep(3.0)
        assert len(_lines(run)) == 1
        filler.unlink()
        code, out, err = _finish(watch)
        assert code == 0, err
        assert [x["step"] for x in _lines(run)] == [1, 2]
        assert out.count("disk full writing step 2") == 1
        assert "space again: step 2 stored" in out
        assert sorted(_steps_json(run)) == ["1", "2"]
        assert not [p for p in run.rglob(".*") if p.name != ".probe-lock"]  # no leftovers
