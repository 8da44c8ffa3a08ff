"""Data integrity in every report (first), in integrity.json and in ``probe check``; and the
report faults of issue 22 that integrity explains: positive log-probs shown as probabilities
above 1 (fault 7), a log-prob of 710+ overflowing the report (fault 11), bare URLs from model
text left as live links (fault 16), and baselines of another run kind (fault 4)."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from mismatch_probe import store
from mismatch_probe.pipeline.publish import publish
from mismatch_probe.report.comment import run_comment
from mismatch_probe.report.integrity import CLEAN, integrity_markdown, integrity_text
from mismatch_probe.report.markdown import escape
from mismatch_probe.report.terminal import render_run
from mismatch_probe.rundir import load_report
from tests.cli_runner import run_probe
from tests.test_report_fixtures import Seq, make_run, mixed_seqs, uniform_run

LP = math.log(0.5)
POSITIVE = (
    "1 log-probs above 0 (largest 5): a log-probability is at most 0, so these are not "
    "log-probs (probabilities, logits or a sign error?)"
)


def positive_run(path: Path, value: float = 5.0) -> Path:
    """Three responses; the first token of the second has a training log-prob of ``value``
    (5: a 'probability' of 148)."""
    seqs = mixed_seqs()
    bad = seqs[1]
    seqs[1] = bad._replace(train=[value, *bad.train[1:]])
    return make_run(path, seqs, metrics=False)


def terminal(renderable: Any) -> str:
    console = Console(file=io.StringIO(), width=100, color_system=None, force_terminal=False)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


# --- rendering -------------------------------------------------------------------------------


def test_a_clean_run_says_so_in_one_line_first(tmp_path: Path) -> None:
    run = uniform_run(tmp_path / "run", 0.01, [4, 6])
    ctx, entries = load_report(run)
    paths = publish(ctx, entries)
    assert json.loads(paths["integrity"].read_text()) == {"findings": [], "masks_applied": []}
    md = (run / store.REPORT_FILE).read_text().splitlines()
    assert md[:4] == ["# Mismatch report: tiny-llama", "", f"✅ {escape(CLEAN)}", ""]
    assert terminal(integrity_text(ctx.integrity)) == f"✔ {CLEAN}\n"
    out = io.StringIO()
    render_run(ctx, Console(file=out, width=100, color_system=None))
    assert out.getvalue().startswith(f"✔ {CLEAN}\nmismatch_probe report\n")
    comment = run_comment(ctx).splitlines()
    assert comment[4:6] == [f"✅ {escape(CLEAN)}", ""]  # right after the header
    assert "Data integrity: clean" in (run / "report.html").read_text()


def test_findings_are_shown_first_everywhere(tmp_path: Path) -> None:
    run = positive_run(tmp_path / "run")
    ctx, entries = load_report(run)
    publish(ctx, entries)
    assert json.loads((run / "integrity.json").read_text()) == {
        "findings": [
            {
                "check": "positive_logprob",
                "severity": "error",
                "tokens": 1,
                "sequences": 1,
                "message": POSITIVE,
                "share": 1 / 3,
                "steps": None,
            }
        ],
        "masks_applied": [],
    }
    md = (run / store.REPORT_FILE).read_text().splitlines()
    assert md[2:8] == [
        "## Data integrity",
        "",
        "Data integrity: 1 error (numbers below may not mean what they say)",
        "",
        f"- ❌ **error** `positive_logprob` (1 tokens, 1 sequences): {escape(POSITIVE)}",
        "",
    ]
    # the integrity error turns the recommendation (right below) into "investigate first"
    assert md[8].startswith("**Recommendation:** Investigate first: the integrity check ")
    assert "positive\\_logprob" in md[8] and md.index("## Settings") > 8
    assert terminal(integrity_text(ctx.integrity)).splitlines() == [
        "Data integrity: 1 error (numbers below may not mean what they say)",
        "  ✘ error positive_logprob (1 tokens, 1 sequences): 1 log-probs above 0 (largest 5): a ",
        "log-probability is at most 0, so these are not log-probs (probabilities, logits or a sign "
        "error?)",
    ]
    comment = run_comment(ctx)
    assert comment.index("#### Data integrity") < comment.index("#### Verdicts")
    html = (run / "report.html").read_text()
    assert html.index("Data integrity") < html.index("Settings")


def test_accepted_and_applied_masks_are_said(tmp_path: Path) -> None:
    from mismatch_probe.metrics.integrity import Finding, Integrity

    found = Integrity(
        (Finding("placeholder_logprob", "error", 3, 2, "m"),),
        masks_applied=({"rule": "sample_loss_mask", "detail": "2 samples"},),
    )
    lines = integrity_markdown(found, accepted=["placeholder_logprob"])
    assert lines[4] == "- ❌ **error (accepted)** `placeholder_logprob` (3 tokens, 2 sequences): m"
    assert lines[-2] == "Masks applied as the framework does: sample\\_loss\\_mask (2 samples)."


# --- probe report and probe metrics -----------------------------------------------------------


def test_probe_report_recomputes_integrity_from_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    run = positive_run(tmp_path / "run")
    (run / "integrity.json").write_text('{"findings": []}')  # stale or edited: not trusted
    code, out, _ = run_probe(["report", str(run)], monkeypatch, capsys)
    assert code == 0 and out.startswith("Data integrity: 1 error")
    data = json.loads((run / "integrity.json").read_text())
    assert [f["check"] for f in data["findings"]] == ["positive_logprob"]


def test_metrics_json_shows_integrity_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    run = positive_run(tmp_path / "run")
    code, out, _ = run_probe(["metrics", str(run), "--json"], monkeypatch, capsys)
    data = json.loads(out)
    assert code == 0 and next(iter(data)) == "integrity"
    assert [f["check"] for f in data["integrity"]["findings"]] == ["positive_logprob"]


# --- probe check ------------------------------------------------------------------------------


def test_check_fails_on_an_integrity_error_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    run = str(positive_run(tmp_path / "run"))
    bound = ["--max", "k3_kl=1e9"]
    code, out, _ = run_probe(["check", run, *bound], monkeypatch, capsys)
    assert code == 1
    assert out.splitlines()[-1] == (
        "all bounds hold; integrity error: positive_logprob (--accept CHECK if it is known and "
        "harmless)"
    )
    code, out, _ = run_probe(
        ["check", run, *bound, "--accept", "positive_logprob"], monkeypatch, capsys
    )
    assert code == 0 and "error (accepted) positive_logprob" in out
    assert out.splitlines()[-1] == "all bounds hold"
    code, _, err = run_probe(["check", run, *bound, "--accept", "bogus"], monkeypatch, capsys)
    assert code == 2 and err.startswith("error: --accept bogus: not an integrity check (")


def test_check_warnings_do_not_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """One placeholder in 200 tokens: a warning, exit 0 (noise of both signs: a one-sided
    shift on every token would be a truncated support)."""
    noisy = [-1.01, -0.99] * 50
    seqs = [Seq(["w"] * 100, [-1.0] * 100, list(noisy), [False] * 100) for _ in range(2)]
    seqs[0].train[5] = 0.0
    run = make_run(tmp_path / "run", seqs)
    code, out, _ = run_probe(["check", str(run), "--max", "k3_kl=1"], monkeypatch, capsys)
    assert code == 0 and "⚠ warning placeholder_logprob (1 tokens, 1 sequences)" in out


def test_check_names_nonfinite_log_probs_when_no_metric_can_be_computed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    seqs = mixed_seqs()
    seqs[0].train[2] = math.nan
    run = make_run(tmp_path / "run", seqs, metrics=False)
    code, out, _ = run_probe(["check", str(run), "--max", "k3_kl=1"], monkeypatch, capsys)
    assert code == 1 and "✘ error nonfinite_logprob (1 tokens, 1 sequences)" in out
    assert out.splitlines()[-1].startswith("no bound evaluated (the metrics cannot be computed)")
    args = ["check", str(run), "--max", "k3_kl=1", "--accept", "nonfinite_logprob"]
    code, _, err = run_probe(args, monkeypatch, capsys)
    assert code == 2 and "nonfinite_logprob" in err  # accepted, but still no metric to bound


def ingested_run(path: Path, bad_step: int) -> Path:
    """An ingested run of steps 1..3, one response each; ``bad_step`` has a positive log-prob."""
    path.mkdir(parents=True)
    train, rollout = [], []
    for step in (1, 2, 3):
        t = [LP + 0.01 * i for i in range(5)]
        if step == bad_step:
            t[0] = 2.0
        train += t
        rollout += [LP] * 5
    table = pa.table(
        {
            "setting": ["verl-dp: a vs b"] * 15,
            "step": pa.array(np.repeat([1, 2, 3], 5), pa.int64()),
            "seq_id": pa.array(np.repeat([0, 1, 2], 5), pa.int64()),
            "position": pa.array(np.tile(np.arange(5), 3), pa.int32()),
            "rollout_logprob": pa.array(rollout, pa.float32()),
            "train_logprob": pa.array(train, pa.float32()),
        }
    )
    pq.write_table(table, path / store.TOKENS_FILE)
    run = {"kind": "ingest", "source": {"format": "verl-dp"}, "setting": "verl-dp: a vs b"}
    store.write_json(path / store.RUN_FILE, run)
    return path


def test_check_per_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    run = str(ingested_run(tmp_path / "run", bad_step=2))
    bound = ["--max", "k3_kl=1e9"]
    code, out, _ = run_probe(["check", run, *bound, "--step", "1"], monkeypatch, capsys)
    assert code == 0 and out.startswith(f"✔ {CLEAN.replace('integrity:', 'integrity at step 1:')}")
    code, out, _ = run_probe(["check", run, *bound, "--step", "2"], monkeypatch, capsys)
    assert code == 1 and out.startswith("Data integrity at step 2: 1 error")
    code, out, _ = run_probe(["check", run, *bound], monkeypatch, capsys)
    assert code == 1 and "positive_logprob" in out.splitlines()[-1]


# --- fault 4: a baseline of another run kind ---------------------------------------------------


@pytest.mark.parametrize(
    ("head", "base", "what"),
    [
        (
            {},
            {"kind": "ingest", "source": {"format": "verl-dp"}},
            "head: scan; baseline: ingest of verl-dp",
        ),
        (
            {"kind": "ingest", "source": {"format": "skyrl"}},
            {"kind": "ingest", "source": {"format": "verl-dp"}},
            "head: ingest of skyrl; baseline: ingest of verl-dp",
        ),
    ],
)
def test_baseline_of_another_run_kind_is_not_comparable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, head: dict, base: dict, what: str
) -> None:
    runs = []
    for name, extra in (("head", head), ("base", base)):
        run = uniform_run(tmp_path / name, 0.01, [4, 6])
        data = {**json.loads((run / store.RUN_FILE).read_text()), **extra}
        store.write_json(run / store.RUN_FILE, data)
        runs.append(str(run))
    args = ["check", runs[0], "--baseline", runs[1], "--max-increase", "k3_kl=2x"]
    code, _, err = run_probe(args, monkeypatch, capsys)
    assert code == 2 and f"run kind differs ({what})" in err
    code, out, _ = run_probe([*args, "--allow-different"], monkeypatch, capsys)
    assert code == 0 and f"⚠ run kind differs ({what})" in out


def test_same_ingest_format_is_comparable(tmp_path: Path, monkeypatch, capsys) -> None:
    runs = []
    for name in ("head", "base"):
        run = uniform_run(tmp_path / name, 0.01, [4, 6])
        data = {**json.loads((run / store.RUN_FILE).read_text()), "kind": "ingest"}
        store.write_json(run / store.RUN_FILE, {**data, "source": {"format": "verl-dp"}})
        runs.append(str(run))
    args = ["check", runs[0], "--baseline", runs[1], "--max-increase", "k3_kl=2x"]
    assert run_probe(args, monkeypatch, capsys)[0] == 0


# --- faults 7 and 11: positive and huge log-probs in a report ---------------------------------


@pytest.mark.parametrize("value", [5.0, 710.0, 1e6])
def test_a_positive_log_prob_is_never_a_probability_above_1(tmp_path: Path, value: float) -> None:
    """5 is a 'probability' of 148; 710 and above overflowed math.exp in the worst tokens."""
    run = positive_run(tmp_path / "run", value)
    ctx, entries = load_report(run)
    publish(ctx, entries)
    md = (run / store.REPORT_FILE).read_text()
    worst = next(line for line in md.splitlines() if line.startswith("| 1 |"))
    cells = [c.strip() for c in worst.split("|")[1:-1]]
    assert cells[5] == f"log p {value:+.4g}"  # p train: said to be no probability
    for cell in cells[4:6]:  # and no cell is a number above 1
        assert not re.fullmatch(r"[0-9.e+-]+", cell) or float(cell) <= 1.0
    out = io.StringIO()
    render_run(ctx, Console(file=out, width=140, color_system=None))
    assert f"log p {value:+.3g}" in out.getvalue()
    assert "positive_logprob" in md.splitlines()[6]


# --- fault 16: bare URLs -----------------------------------------------------------------------

URLS = ["Visit http://evil.example/a", " or https://x.y", " or www.evil.com", " mailto:a"]


def test_bare_urls_from_model_text_are_not_links(tmp_path: Path) -> None:
    lp = math.log(0.4)
    seqs = [Seq(URLS, [lp] * 4, [lp, lp, lp - 2.0, lp], [False] * 4), *mixed_seqs()]
    run = make_run(tmp_path / "run", seqs)
    ctx, entries = load_report(run)
    publish(ctx, entries)
    outputs = {
        "report.md": (run / store.REPORT_FILE).read_text(),
        "comment": run_comment(ctx),
    }
    for name, text in outputs.items():
        assert "evil" in text, name  # the text is there ...
        for live in ("http://", "https://", "www.", "mailto:"):
            assert live not in text.lower(), (name, live)  # ... but no autolink can form
    assert escape("see http://a.b and WWW.c.d") == "see http:\u200b//a.b and WWW\u200b.c.d"


# --- probe compare ------------------------------------------------------------------------------


def test_compare_shows_each_runs_integrity_first(tmp_path: Path) -> None:
    from mismatch_probe.gate.compare import load_comparison
    from mismatch_probe.report.comment import comparison_comment
    from mismatch_probe.report.compare import write_comparison

    clean = uniform_run(tmp_path / "main", 0.01, [4, 6])
    bad = positive_run(tmp_path / "pr")
    comparison = load_comparison([clean, bad], intervals=True)
    paths = write_comparison(comparison, tmp_path / "cmp")
    labels = [e.label for e in comparison.entries]
    md = paths["report"].read_text().splitlines()
    assert md[2:7] == [
        "## Data integrity",
        "",
        f"- {escape(labels[0])}: clean",
        f"- {escape(labels[1])}: 1 error",
        f"  - ❌ **error** `positive_logprob` (1 tokens, 1 sequences): {escape(POSITIVE)}",
    ]
    comment = comparison_comment(comparison)
    assert comment.index("#### Data integrity") < comment.index("#### Verdicts")
    both_clean = load_comparison([clean, uniform_run(tmp_path / "b", 0.02, [4, 6])], intervals=True)
    text = comparison_comment(both_clean)
    assert "\n✅ Data integrity: clean in every run (" in text and "#### Data integrity" not in text


@pytest.mark.parametrize("value", [5.0, 800.0])
def test_ingest_of_positive_log_probs_reports_them(tmp_path: Path, value: float) -> None:
    """Faults 7 and 11 through ``probe ingest``: a training log-prob of 5 (a 'probability' of
    148) or 800 (math.exp overflowed in the report) is an integrity error, not a number."""
    from mismatch_probe.ingest import IngestConfig, run_ingest
    from tests.ingest_fixtures import synthetic_steps, write_prime_rl

    data = synthetic_steps([1, 2], seqs=3)
    data[2][1].train[0] = value
    src = write_prime_rl(tmp_path / "src", data)
    result = run_ingest(IngestConfig("prime-rl", src, tmp_path / "run"))
    integrity = json.loads((result.out / "integrity.json").read_text())
    assert [f["check"] for f in integrity["findings"]] == ["positive_logprob"]
    assert integrity["steps"]["1"] == [] and len(integrity["steps"]["2"]) == 1
    md = (result.out / store.REPORT_FILE).read_text()
    assert md.splitlines()[2] == "## Data integrity" and f"log p {value:+.4g}" in md


def test_metrics_terminal_shows_integrity_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    run = positive_run(tmp_path / "run")
    code, out, _ = run_probe(["metrics", str(run)], monkeypatch, capsys)
    assert code == 0 and out.startswith("Data integrity: 1 error")
    assert out.index("positive_logprob") < out.index("k3_kl")
