"""Progress where nobody watches a terminal (CI logs, ``| tee``): plain lines as the phases go,
with rate and ETA, no ANSI codes; rich bars on a terminal. The scan's own lines in a piped
stderr are checked by ``tests/test_scan_cli.py::test_scan_end_to_end_subprocess``."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import Progress

from mismatch_probe.progress import PlainProgress, make_progress, phase_lines, vllm_progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_terminal_gets_bars_and_a_pipe_gets_lines() -> None:
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert isinstance(make_progress(terminal), Progress)
    assert isinstance(make_progress(Console(file=io.StringIO())), PlainProgress)


def test_lines_at_the_start_each_tenth_every_interval_and_the_end() -> None:
    buffer, clock = io.StringIO(), Clock()
    with PlainProgress(Console(file=buffer), clock=clock) as progress:
        task = progress.add_task("score rollout=bf16", total=1000, unit="tokens")
        clock.now += 2
        progress.update(task, advance=50)  # 5%, 2 s: nothing yet
        clock.now += 2
        progress.update(task, advance=50)  # 10%: a line
        clock.now += 9
        progress.update(task, advance=10)  # 11%, 9 s since the last line: nothing
        clock.now += 1
        progress.update(task, advance=10)  # 12%, 10 s since the last line: a line
        clock.now += 30
        progress.update(task, advance=880)  # done
        progress.update(task, advance=5)  # past the end (a late callback): nothing more
        progress.refresh()
    assert buffer.getvalue().splitlines() == [
        "score rollout=bf16: started, 1000 tokens",
        "score rollout=bf16: 100/1000 tokens (10%), 25.0 tokens/s, elapsed 0:04, ETA 0:36",
        "score rollout=bf16: 120/1000 tokens (12%), 8.6 tokens/s, elapsed 0:14, ETA 1:43",
        "score rollout=bf16: done, 1000 tokens in 0:44 (22.7 tokens/s)",
    ]
    assert "\x1b" not in buffer.getvalue()


def test_vllm_callback_and_long_phases() -> None:
    """vLLM's ``use_tqdm`` callable drives the same lines; a phase over an hour shows hours."""
    buffer, clock = io.StringIO(), Clock()
    progress = PlainProgress(Console(file=buffer), clock=clock)
    bar = vllm_progress(progress, "gen rollout=fp32", 4)()
    assert vllm_progress(progress, "x", 1)(["prompts"]) == ["prompts"]  # passes iterables on
    clock.now += 3700
    bar.update(1)
    bar.refresh()
    clock.now += 7400
    bar.update(3)
    bar.close()
    assert buffer.getvalue().splitlines() == [
        "gen rollout=fp32: started, 4 responses",
        "gen rollout=fp32: 1/4 responses (25%), 0.00027 responses/s, elapsed 1:01:40, ETA 3:05:00",
        "gen rollout=fp32: done, 4 responses in 3:05:00 (0.00036 responses/s)",
    ]


def test_quiet_console_prints_nothing_and_the_stream_is_looked_up_per_line() -> None:
    quiet = io.StringIO()
    progress = PlainProgress(Console(file=quiet, quiet=True))
    progress.update(progress.add_task("gen", total=2, unit="responses"), advance=2)
    assert quiet.getvalue() == ""
    console = Console(file=io.StringIO())
    progress = PlainProgress(console)
    task = progress.add_task("gen", total=2, unit="responses")
    console.file = later = io.StringIO()  # the scan points the console elsewhere during a run
    progress.update(task, advance=2)
    assert later.getvalue().startswith("gen: done, 2 responses in ")


def test_each_timed_phase_says_when_it_starts_without_a_terminal() -> None:
    """The phases without a progress task (model load, metrics, reports) get one line as they
    start in a pipe; a terminal gets none (its bars show what runs)."""
    from mismatch_probe.pipeline.timing import Timer

    pipe = Console(file=io.StringIO(), width=200)
    timer = Timer(phase_lines(pipe))
    with timer("engine_start"):  # its "gen <setting>" line follows at once: silent
        pass
    with timer("model_load"):
        pass
    with timer("reports"):
        pass
    assert pipe.file.getvalue() == "model_load: started\nreports: started\n"
    assert set(timer.seconds) == {"engine_start", "model_load", "reports"}
    assert phase_lines(Console(file=io.StringIO(), force_terminal=True)) is None
