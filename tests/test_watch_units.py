"""Units of ``probe watch``: the renderers on exact output, the follower's rule for formats
without a completion marker (a file counts once it stopped changing and a later step exists, or
after ``settle`` seconds), the hook manifests' rule (every rank), the on-alert command."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from mismatch_probe.ingest import ProbeWriter
from mismatch_probe.ingest.alerts import run_on_alert
from mismatch_probe.ingest.follow import LAYOUTS, Follower
from mismatch_probe.report.watch import LiveView, StepRow, plain_line, render_live, sparkline
from tests.cli_runner import run_probe
from tests.ingest_fixtures import synthetic_steps, write_nemo_rl


def _row(step: int, k3: float, alert: str = "", **kw: object) -> StepRow:
    metrics = {"k3_kl": k3, "chi2_token": 2 * k3, "token_mult_prob_error": 1.0 + k3,
               "f_tau_2": 0.0}  # fmt: skip
    return StepRow(step, 1, 1234, metrics, alert, **kw)  # type: ignore[arg-type]


def test_plain_line() -> None:
    assert plain_line(_row(7, 1e-4)) == (
        "step 7: 1,234 tokens, k3_kl 0.0001, chi2_token 0.0002, token_mult_prob_error 1, "
        "f_tau_2 0, ok"
    )
    row = _row(8, 0.5, "k3_kl = 0.5 > 0.001 (max)", worst="error shifted_by_one", lag=2.0)
    assert plain_line(row).endswith(
        "lag 2, integrity error shifted_by_one, ALERT: k3_kl = 0.5 > 0.001 (max)"
    )
    empty = StepRow(9, 2, 0, {}, note="no trained token")
    assert plain_line(empty) == "step 9 (attempt 2): 0 tokens, no trained token, —"


def test_sparkline_is_log_scaled() -> None:
    assert sparkline([1e-6, 1e-4, 1e-2]) == "▁▅█"
    assert sparkline([0.0, 1.0, 1.0]) == "▁▁▁"
    assert sparkline([]) == ""


def test_live_view_renders_exactly() -> None:
    view = LiveView("probe watch: prime-rl", rows=(_row(1, 1e-5), _row(2, 2e-3, "k3 > 1e-3")),
                    k3=(1e-5, 2e-3), worst="", status="watching")  # fmt: skip
    console = Console(file=io.StringIO(), width=100, force_terminal=True, color_system=None)
    console.print(render_live(view))
    lines = [line.rstrip() for line in console.file.getvalue().splitlines()]  # type: ignore[attr-defined]
    assert lines == [
        "probe watch: prime-rl",
        "┏━━━━━━┳━━━━━━━━┳━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━┳━━━━━━━━━━━━━━━━━━┓",
        "┃ step ┃ tokens ┃ k3_kl ┃ χ² token ┃ mult. prob. err. ┃ ρ∉[½,2] ┃ lag ┃ verdict          ┃",  # noqa: E501
        "┡━━━━━━╇━━━━━━━━╇━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━╇━━━━━━━━━━━━━━━━━━┩",
        "│    1 │  1,234 │ 1e-05 │    2e-05 │                1 │       0 │   — │ ok               │",  # noqa: E501
        "│    2 │  1,234 │ 0.002 │    0.004 │            1.002 │       0 │   — │ ALERT: k3 > 1e-3 │",  # noqa: E501
        "└──────┴────────┴───────┴──────────┴──────────────────┴─────────┴─────┴──────────────────┘",
        "k3_kl, last 2 steps: ▁█  (last 0.002)",
        "worst integrity finding: none",
        "watching",
    ]


def test_a_file_step_counts_once_it_stopped_changing(tmp_path: Path) -> None:
    follower = Follower(LAYOUTS["nemo-rl"], tmp_path, settle=30.0)
    first = tmp_path / "train_data_step1.jsonl"
    first.write_text('{"a": 1}\n')
    assert not follower.look(now=0.0)[1].complete  # new: look once more first
    assert not follower.look(now=1.0)[1].complete  # unchanged, but no later step and not settled
    assert follower.look(now=31.0)[1].complete  # settled
    (tmp_path / "train_data_step2.jsonl").write_text('{"a"')  # being written
    seen = follower.look(now=32.0)
    assert seen[1].complete and not seen[2].complete
    with first.open("a") as fh:  # step 1 grows again: not complete until it stops
        fh.write('{"b": 2}\n')
    assert not follower.look(now=33.0)[1].complete
    assert follower.look(now=34.0)[1].complete  # a later step exists and it stopped changing


def test_a_hook_step_needs_every_ranks_manifest(tmp_path: Path) -> None:
    follower = Follower(LAYOUTS["probe"], tmp_path, settle=30.0)
    ranks = [ProbeWriter(tmp_path, rank=r, world_size=2) for r in (0, 1)]
    for writer in ranks:
        writer.write_step(1, [[5, 6]], [[1, 1]], [[-1.0, -2.0]], [[-1.1, -2.1]])
    assert not follower.look()[1].complete
    ranks[0].close()
    assert not follower.look()[1].complete  # rank 1 may still write step 1
    ranks[1].close()
    seen = follower.look()[1]
    assert seen.complete and follower.stamp_now(seen) == seen.stamp


def test_on_alert_gets_the_alert_on_stdin(tmp_path: Path) -> None:
    target = tmp_path / "got.json"
    assert run_on_alert(f"cat > {target}", {"step": 3, "message": "x"}) == ""
    assert json.loads(target.read_text()) == {"message": "x", "step": 3}
    assert run_on_alert("echo bad >&2; exit 3", {"step": 3}) == ("--on-alert command exited 3: bad")
    assert run_on_alert("sleep 5", {"step": 3}, timeout=0.2) == (
        "--on-alert command still running after 0.2 s: stopped"
    )


def test_watch_reads_a_marker_less_format_once_settled(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    """NeMo-RL's one file per step: step 1 is read once step 2 exists, step 2 (the last) once
    it has not changed for --settle seconds; the numbers are probe ingest's."""
    from mismatch_probe.ingest import IngestConfig, run_ingest

    src, run = tmp_path / "logs", tmp_path / "run"
    write_nemo_rl(src, synthetic_steps([1, 2], seqs=3))
    args = ["watch", "nemo-rl", str(src), "--out", str(run), "--until", "2", "--settle", "1",
            "--interval", "0.2"]  # fmt: skip
    code, out, err = run_probe(args, monkeypatch, capsys)
    assert code == 0, err
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("step")] == [
        "step 1", "step 2"
    ]  # fmt: skip
    watched = json.loads((run / "steps.json").read_text())["steps"]
    ingested = run_ingest(IngestConfig("nemo-rl", src, tmp_path / "ingest")).steps
    assert watched == {str(s): m for s, m in ingested.items()}


def test_a_bound_on_no_metric_is_exit_2_and_run_is_still_finished(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    from tests.ingest_fixtures import write_prime_rl

    src, run = tmp_path / "outputs", tmp_path / "run"
    write_prime_rl(src, synthetic_steps([1], seqs=2))
    args = ["watch", "prime-rl", str(src), "--out", str(run), "--max", "k3_kll=1",
            "--interval", "0.1"]  # fmt: skip
    code, _, err = run_probe(args, monkeypatch, capsys)
    assert code == 2
    assert err.startswith("error: --max k3_kll: unknown metric (did you mean k3_kl")
    assert sorted(json.loads((run / "steps.json").read_text())["steps"]) == ["1"]
