"""Faults and bad input beyond the scan's options (issue 10): unwritable outputs, corrupt
stores and files, control characters, non-finite stored numbers, interrupted writes.

Every case runs ``cli.main`` in-process (or, for a read-only mount, in a subprocess of its own
mount namespace) and expects one line on stderr and exit code 2, with nothing lost. No engine
starts here: every case fails before one would.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from mismatch_probe import store
from mismatch_probe.errors import ProbeError, printable
from tests.cli_runner import run_probe
from tests.test_report_fixtures import Seq, make_run, uniform_run


def run_main(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any) -> tuple[int, str]:
    """``probe ARGS`` in-process: (exit code, stderr); stdout stays in ``capsys``."""
    code, out, err = run_probe(args, monkeypatch, capsys)
    sys.stdout.write(out)  # left for the test to read
    return code, err


def one_error_line(code: int, err: str, expected: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    return lines[0]


def _writable(path: Path) -> bool:
    try:
        (path / ".t").write_bytes(b"")
        (path / ".t").unlink()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` (a directory) made unwritable for real: ``chmod`` for a normal user, the
    immutable attribute (``chattr +i``) for root, whom permission bits do not stop."""
    path.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode
    path.chmod(0o555)
    immutable = False
    if _writable(path) and shutil.which("chattr"):
        immutable = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    try:
        if _writable(path):
            pytest.skip("no way to make a directory read-only here (root without chattr)")
        yield path
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(mode)


# --- unwritable outputs ------------------------------------------------------------------------


def test_scan_out_in_a_read_only_directory(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    with read_only(tmp_path / "ro") as ro:
        code, err = run_main(
            ["scan", "--model", str(tiny_model), "--out", str(ro / "run")], monkeypatch, capsys
        )
    one_error_line(code, err, f"--out: cannot write to {ro / 'run'}")


def test_scan_out_on_a_read_only_filesystem(tiny_model: Path, tmp_path: Path) -> None:
    """A real read-only mount (a bind mount remounted ``ro`` in a mount namespace of its own)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a read-only mount needs root and unshare")
    ro = tmp_path / "mnt"
    ro.mkdir()
    mount = f"mount --bind {ro} {ro} && mount -o remount,ro,bind {ro}"
    tried = subprocess.run(["unshare", "-m", "sh", "-c", mount], capture_output=True, text=True)
    if tried.returncode != 0:  # a container without the right to mount
        pytest.skip(f"no read-only mount here: {tried.stderr.strip()}")
    probe = [sys.executable, "-m", "mismatch_probe.cli", "scan", "--model", str(tiny_model)]
    probe += ["--out", str(ro / "run")]
    script = f"{mount} && exec " + " ".join(map(str, probe))
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "(Read-only file system)" in lines[0] and "--out: cannot write to" in lines[0]


def test_out_holding_a_run_is_kept_unless_force(tmp_path: Path) -> None:
    from mismatch_probe.pipeline.config import ScanConfig
    from mismatch_probe.pipeline.scan import check_out

    old = uniform_run(tmp_path / "old", 0.01, [3])
    before = (old / store.TOKENS_FILE).read_bytes()
    with pytest.raises(ProbeError, match="holds a run already"):
        check_out(ScanConfig(), old)
    assert (old / store.TOKENS_FILE).read_bytes() == before
    assert check_out(ScanConfig(force=True), old) == old
    assert check_out(ScanConfig(), tmp_path / "empty") == tmp_path / "empty"  # created


def test_compare_out_unwritable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    runs = [str(uniform_run(tmp_path / f"r{i}", 0.01 * (i + 1), [3, 4])) for i in range(2)]
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    code, err = run_main(["compare", *runs, "--out", str(a_file)], monkeypatch, capsys)
    one_error_line(code, err, "is a file, not a directory")
    assert a_file.read_text() == "keep me"
    code, err = run_main(["compare", *runs, "--out", str(a_file / "x")], monkeypatch, capsys)
    one_error_line(code, err, "a parent of the path is a file")
    with read_only(tmp_path / "ro") as ro:
        code, err = run_main(["compare", *runs, "--out", str(ro)], monkeypatch, capsys)
        one_error_line(code, err, f"--out: cannot write to {ro}")
        assert list(ro.iterdir()) == []


def test_report_on_a_read_only_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    run = uniform_run(tmp_path / "run", 0.01, [3, 4])
    files = {p.name: p.read_bytes() for p in run.iterdir()}
    with read_only(run):
        code, err = run_main(["report", str(run)], monkeypatch, capsys)
        one_error_line(code, err, f"run directory: cannot write to {run}")
        assert {p.name: p.read_bytes() for p in run.iterdir()} == files


def test_models_tiny_unwritable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    code, err = run_main(["models", "tiny", str(a_file)], monkeypatch, capsys)
    one_error_line(code, err, "OUT: ")
    code, err = run_main(["models", "tiny", str(a_file / "m")], monkeypatch, capsys)
    one_error_line(code, err, "a parent of the path is a file")
    with read_only(tmp_path / "ro") as ro:
        code, err = run_main(["models", "tiny", str(ro / "m")], monkeypatch, capsys)
        one_error_line(code, err, f"OUT: cannot write to {ro / 'm'}")


def test_models_tiny_prints_only_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    """File-descriptor capture: the tokenizer trainer (Rust) wrote blank lines to fd 1."""
    out = tmp_path / "tiny"
    code, _ = run_main(["models", "tiny", str(out)], monkeypatch, capfd)
    assert code == 0
    assert capfd.readouterr().out == f"{out}\n"  # no blank line before it
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert (out / "model.safetensors").is_file()


def test_cache_unwritable_during_prepare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    a_file = tmp_path / "cache"
    a_file.write_text("x")
    monkeypatch.setenv("MISMATCH_PROBE_CACHE", str(a_file))
    code, err = run_main(["models", "prepare"], monkeypatch, capsys)
    one_error_line(code, err, "set MISMATCH_PROBE_CACHE to a writable directory")
    with read_only(tmp_path / "ro") as ro:
        monkeypatch.setenv("MISMATCH_PROBE_CACHE", str(ro))
        code, err = run_main(["models", "prepare"], monkeypatch, capsys)
        one_error_line(code, err, "the model cache: cannot write to")


def test_a_late_os_error_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """An OSError after every check (a full disk) still ends in one line and exit 2."""
    from mismatch_probe.report import plots

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "ratio_hist.png")

    run = uniform_run(tmp_path / "run", 0.01, [3])
    monkeypatch.setattr(plots, "save", full)
    code, err = run_main(["report", str(run)], monkeypatch, capsys)
    one_error_line(code, err, "No space left on device: ratio_hist.png")


# --- every output through the atomic writer ----------------------------------------------------

WRITERS = {"savefig", "write_text", "write_bytes", "save_pretrained", "to_parquet", "dump"}


def test_every_write_goes_through_a_temporary_name() -> None:
    """Outside ``store/__init__.py`` (the atomic writer itself) every call that writes a file is the
    store's (``store.write_text``) or writes to a temporary path (``tmp``), renamed into place
    only when complete; ``buffer`` is memory (``report.png`` draws a PNG into an ``io.BytesIO``
    and hands its bytes to ``store.write_bytes``)."""
    import ast

    import mismatch_probe

    package = Path(mismatch_probe.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "store" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in WRITERS
            ):
                target = ast.unparse(node.args[0] if node.args else node.func.value)
                receiver = ast.unparse(node.func.value)
                temporary = "tmp" in target or "tmp" in receiver
                if receiver != "store" and not temporary and target != "buffer":
                    offenders.append(f"{path.relative_to(package)}:{node.lineno} {node.func.attr}")
    assert offenders == []


def _renames(tree: Any) -> list[int]:
    """Lines of ``os.replace``/``os.rename`` calls and of ``Path.replace``/``Path.rename``
    (one positional argument: not ``str.replace``, not ``dataclasses.replace``)."""
    import ast

    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        attr, receiver = node.func.attr, ast.unparse(node.func.value)
        by_os = receiver == "os" and attr in ("replace", "rename")
        by_path = (
            attr in ("replace", "rename") and len(node.args) == 1 and receiver != "dataclasses"
        )
        if by_os or by_path:
            lines.append(node.lineno)
    return lines


def test_one_atomic_writer_does_every_rename() -> None:
    """Temporary-name-then-rename is written once, in ``store`` (``atomic``, ``atomic_files``,
    ``atomic_dir``): no other module renames a file into place by hand."""
    import ast

    import mismatch_probe

    package = Path(mismatch_probe.__file__).parent
    offenders = [
        f"{path.relative_to(package)}:{line}"
        for path in sorted(package.rglob("*.py"))
        if path != package / "store" / "__init__.py"
        for line in _renames(ast.parse(path.read_text()))
    ]
    assert offenders == []


def test_an_interrupted_plot_leaves_no_file_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``savefig`` interrupted half-way: the PNG's final name never gets the half-drawn bytes,
    no temporary file is left, and an earlier complete PNG stays as it was."""
    from matplotlib.figure import Figure

    from mismatch_probe.report.plots import write_plots
    from mismatch_probe.rundir import load_run

    run = uniform_run(tmp_path / "run", 0.01, [3, 4])
    plots = run / store.PLOTS_DIR
    plots.mkdir()
    (plots / "probs.png").write_bytes(b"an earlier complete plot")
    calls = []

    def interrupted(self: Any, fname: Any, **kwargs: Any) -> None:
        calls.append(kwargs["metadata"]["Title"])  # report.png draws into memory first
        fname.write(b"\x89PNG half")
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_plots(load_run(run), plots)
    assert calls[1] == "probs.png"  # interrupted while drawing probs.png
    assert sorted(p.name for p in plots.iterdir()) == ["probs.png", "ratio_hist.png"]
    assert (plots / "probs.png").read_bytes() == b"an earlier complete plot"


def test_compare_md_is_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mismatch_probe.gate.compare import load_comparison
    from mismatch_probe.report import compare

    runs = [uniform_run(tmp_path / f"r{i}", 0.01 * (i + 1), [3]) for i in range(2)]
    comparison = load_comparison(runs)
    out = tmp_path / "cmp"
    out.mkdir()
    (out / store.COMPARE_FILE).write_text("an earlier comparison")
    written = []

    def interrupted(self: Path, text: str, **kwargs: Any) -> None:
        written.append(self)
        with self.open("w") as f:
            f.write(text[:10])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compare.write_comparison(comparison, out)
    assert [p.name for p in written] != [store.COMPARE_FILE]  # a temporary name
    assert (out / store.COMPARE_FILE).read_text() == "an earlier comparison"
    assert not [p for p in out.iterdir() if ".partial" in p.name]


# --- corrupt inputs to the reading commands ----------------------------------------------------


def _store_with(tmp_path: Path, **columns: Any) -> Path:
    """A token store whose columns are the default ones, with ``columns`` replaced."""
    data: dict[str, Any] = {
        "seq_id": pa.array([0, 0, 1], pa.int64()),
        "position": pa.array([0, 1, 0], pa.int32()),
        "rollout_logprob": pa.array([-1.0, -2.0, -0.5], pa.float32()),
        "train_logprob": pa.array([-1.1, -2.0, -0.4], pa.float32()),
    }
    data.update(columns)
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table(data), path)
    return path


CORRUPT_STORES = {
    "log-probs as text": (
        {"rollout_logprob": pa.array(["a", "b", "c"])},
        "column rollout_logprob holds string, not numbers",
    ),
    "seq_id of lists": (
        {"seq_id": pa.array([[0], [0], [1]])},
        "column seq_id holds list<",
    ),
    "fractional position": (
        {"position": pa.array([0.0, 1.5, 0.0])},
        "column position holds double, not integers",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPT_STORES))
@pytest.mark.parametrize("command", ["metrics", "report"])
def test_corrupt_store(
    case: str, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    columns, expected = CORRUPT_STORES[case]
    path = _store_with(tmp_path, **columns)
    if command == "report":
        run = tmp_path / "run"
        run.mkdir()
        path = path.rename(run / store.TOKENS_FILE)
        target = run
    else:
        target = path
    code, err = run_main([command, str(target)], monkeypatch, capsys)
    one_error_line(code, err, expected)


def test_a_good_foreign_store_still_reads(tmp_path: Path) -> None:
    """The type checks refuse only what no reader can use: float32/float64 log-probs, any
    integer width for the ids."""
    from mismatch_probe.metrics import compute_metrics

    path = _store_with(
        tmp_path,
        seq_id=pa.array([0, 0, 1], pa.int16()),
        rollout_logprob=pa.array([-1.0, -2.0, -0.5], pa.float64()),
    )
    assert compute_metrics(path).flat()["num_tokens"] == 3


def test_report_on_a_parquet_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    path = _store_with(tmp_path)
    code, err = run_main(["report", str(path)], monkeypatch, capsys)
    line = one_error_line(code, err, "is a file; probe report takes a run directory")
    assert "bad.parquet/" not in line


ROUTING_OK: dict[str, Any] = {
    "rollout=bf16 | train=fp32": {
        "settings": {"none": "rollout=bf16 | train=fp32"},
        "metrics": {
            "moe_layers": [0, 1],
            "layer_disagreement": [0.1, 0.2],
            "layer_jaccard": [0.9, 0.8],
            "tokens": 7,
            "any_layer_differs": 0.25,
            "mean_jaccard": 0.85,
            "agree": {"tokens": 5, "k3_kl": 1e-3, "mean_abs_log_ratio": 0.01},
            "differ": {"tokens": 2, "k3_kl": 2e-3, "mean_abs_log_ratio": 0.02},
            "by_differing_layers": [
                {"tokens": 5, "mean_abs_log_ratio": 0.01},
                {"tokens": 1, "mean_abs_log_ratio": 0.02},
                {"tokens": 1, "mean_abs_log_ratio": None},
            ],
        },
        "replay": {
            "modes": {"none": {"tokens": 7, "k3_kl": 1e-3, "mean_abs_log_ratio": 0.01}},
            "k3_removed": {},
        },
    }
}


def _routing_variant(change: str) -> str:
    data = json.loads(json.dumps(ROUTING_OK))
    metrics = data["rollout=bf16 | train=fp32"]["metrics"]
    if change == "truncated":
        return json.dumps(data)[:100]
    if change == "strings for numbers":
        metrics["layer_disagreement"] = ["a", "b"]
    elif change == "NaN":
        return json.dumps(data).replace("0.25", "NaN")
    elif change == "huge number":
        return json.dumps(data).replace("0.25", "1e999")
    elif change == "a layer missing":
        metrics["layer_jaccard"] = [0.9]
    elif change == "bins not a list":
        metrics["by_differing_layers"] = 3
    elif change == "no token count":
        del metrics["tokens"]
    return json.dumps(data)


@pytest.mark.parametrize(
    "change",
    [
        "none",
        "truncated",
        "strings for numbers",
        "NaN",
        "huge number",
        "a layer missing",
        "bins not a list",
        "no token count",
    ],
)
def test_corrupt_routing_json(
    change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    run = uniform_run(tmp_path / "run", 0.01, [3, 4])
    (run / store.ROUTING_METRICS_FILE).write_text(_routing_variant(change))
    code, err = run_main(["report", str(run)], monkeypatch, capsys)
    if change == "none":  # the fixture itself is good: the others fail for their change
        assert code == 0, err
        assert "## MoE routing" in (run / store.REPORT_FILE).read_text()
        return
    one_error_line(code, err, "is not a routing.json written by probe scan")


# --- control characters ------------------------------------------------------------------------

ESC = "\x1b[31m"


def _escape_run(tmp_path: Path, name: str = "run") -> Path:
    """A run whose worst token, setting and model name hold an ANSI escape."""
    lp = math.log(0.4)
    texts = ["a", f"red{ESC}", "b\u202e", "c"]
    seqs = [Seq(texts, [lp] * 4, [lp, lp - 2.0, lp + 0.1, lp], [False] * 4)]
    return make_run(tmp_path / name, seqs, setting=f"rollout=bf16{ESC} | train=fp32", model=ESC)


@pytest.mark.filterwarnings("error::UserWarning")  # a plot label's control character: no glyph
def test_control_characters_are_escaped_in_every_renderer(tmp_path: Path) -> None:
    from mismatch_probe.gate.compare import load_comparison
    from mismatch_probe.pipeline.publish import publish
    from mismatch_probe.report import render
    from mismatch_probe.report.compare import render_comparison, write_comparison
    from mismatch_probe.rundir import load_report

    run = _escape_run(tmp_path)
    ctx, entries = load_report(run)
    buffer = io.StringIO()
    render(ctx, entries, Console(file=buffer, width=140))  # not a terminal: no styles
    terminal = buffer.getvalue()
    assert "\x1b" not in terminal and "\u202e" not in terminal
    assert "red\\x1b[31m" in terminal

    paths = publish(ctx, entries)
    report = paths["report"].read_text()
    assert "\x1b" not in report and "\\x1b" in report

    other = uniform_run(tmp_path / "other", 0.01, [3])
    comparison = load_comparison([run, other])
    buffer = io.StringIO()
    render_comparison(comparison, Console(file=buffer, width=200))
    assert "\x1b" not in buffer.getvalue() and "\\x1b" in buffer.getvalue()
    compare_md = write_comparison(comparison, tmp_path / "cmp")["report"].read_text()
    assert "\x1b" not in compare_md and "\\x1b" in compare_md


def test_error_lines_escape_control_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    code, err = run_main(["metrics", str(tmp_path / f"no{ESC}such")], monkeypatch, capsys)
    line = one_error_line(code, err, "no\\x1b[31msuch")
    assert "\x1b" not in line


def test_printable() -> None:
    assert printable("plain ünïcode ✓") == "plain ünïcode ✓"
    assert printable("a\x1b[31mb\x07\x9b\u202e") == "a\\x1b[31mb\\x07\\x9b\\u202e"
    assert printable("a\nb", keep="\n") == "a\nb"


# --- non-finite stored numbers -----------------------------------------------------------------


# A non-finite number as Python, JSON or a report would print it (not "dominant", "info").
NON_FINITE = re.compile(r"(?i)(?<![a-z])(nan|-?inf(inity)?)(?![a-z])")


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_metrics_json_is_recomputed(
    bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from mismatch_probe.rundir import load_run

    run = uniform_run(tmp_path / "run", 0.01, [3, 4])
    good = json.loads((run / store.METRICS_FILE).read_text())
    text = (run / store.METRICS_FILE).read_text()
    (run / store.METRICS_FILE).write_text(
        text.replace(f'"k3_kl": {good["k3_kl"]!r}', f'"k3_kl": {bad}')
    )
    assert bad in (run / store.METRICS_FILE).read_text()
    assert load_run(run).metrics["k3_kl"] == pytest.approx(good["k3_kl"])

    other = uniform_run(tmp_path / "other", 0.02, [3, 4])
    out = tmp_path / "cmp"
    code, err = run_main(["compare", str(run), str(other), "--out", str(out)], monkeypatch, capsys)
    assert code == 0, err
    compare_md = (out / store.COMPARE_FILE).read_text()
    assert not NON_FINITE.search(compare_md)

    code, err = run_main(["report", str(run)], monkeypatch, capsys)
    assert code == 0, err
    rewritten = store.read_json(run / store.METRICS_FILE)  # strict: raises on NaN/inf
    assert rewritten["k3_kl"] == pytest.approx(good["k3_kl"])
    assert not NON_FINITE.search((run / store.REPORT_FILE).read_text())


def test_incomplete_metrics_json_is_recomputed(tmp_path: Path) -> None:
    from mismatch_probe.rundir import load_run

    run = uniform_run(tmp_path / "run", 0.01, [3, 4])
    good = json.loads((run / store.METRICS_FILE).read_text())
    broken = {**good, "curves": {"f_tau": []}}
    (run / store.METRICS_FILE).write_text(json.dumps(broken))
    assert load_run(run).curves.keys() == good["curves"].keys()


def test_non_finite_throughput_is_left_out(tmp_path: Path) -> None:
    from mismatch_probe.rundir.data import throughput

    (tmp_path / store.SETTINGS_FILE).write_text(
        '{"settings": {"a": {"rollout_tokens_per_s": NaN}, "b": {"rollout_tokens_per_s": 3.5}}}'
    )
    assert throughput(tmp_path) == {}  # the whole file is refused: never a NaN in a report
    (tmp_path / store.SETTINGS_FILE).write_text(
        '{"settings": {"b": {"rollout_tokens_per_s": 3.5}}}'
    )
    assert throughput(tmp_path) == {"b": 3.5}


# --- the rest of the battery -------------------------------------------------------------------


def test_run_json_stores_resolved_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mismatch_probe.pipeline.config import ScanConfig

    monkeypatch.chdir(tmp_path)
    config = ScanConfig(prompts=Path("p.jsonl"), out=Path("out"), model=Path("m")).to_dict()
    assert config["prompts"] == str(tmp_path / "p.jsonl")
    assert config["out"] == str(tmp_path / "out")
    assert config["model"] == str(tmp_path / "m")


def test_reserved_engine_args_cover_what_probe_sets() -> None:
    """Every engine argument probe sets from its own options is refused in --vllm-arg."""
    from mismatch_probe.engine import rollout
    from mismatch_probe.engine.args import RESERVED
    from mismatch_probe.engine.routing import _ENGINE, NATIVE
    from mismatch_probe.sampling import SamplingSpec
    from mismatch_probe.settings import RolloutSetting

    every_override = RolloutSetting("float16", "fp8", "fp8", True)
    kwargs = rollout.engine_kwargs(Path("m"), every_override, SamplingSpec(), 64, {})
    defaults = {  # platform defaults: a --vllm-arg may replace them
        **rollout.COMMON_ENGINE_DEFAULTS,
        **rollout.CPU_ENGINE_DEFAULTS,
        **rollout.IN_PROCESS_KWARGS,
    }
    assert set(kwargs) - set(defaults) <= set(RESERVED)
    native = _ENGINE[NATIVE][0]
    assert set(native) <= set(RESERVED)


def test_safetensors_check_accepts_a_good_file(tiny_model: Path) -> None:
    from mismatch_probe.models.checkpoint import check_weights

    check_weights(tiny_model)  # no error


def test_safetensors_check_finds_trailing_bytes(tiny_model: Path, tmp_path: Path) -> None:
    from mismatch_probe.models.checkpoint import check_safetensors

    path = tmp_path / "model.safetensors"
    path.write_bytes((tiny_model / "model.safetensors").read_bytes() + b"\0" * 16)
    with pytest.raises(ProbeError, match="where its header describes"):
        check_safetensors(path)
    header = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}'
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(ProbeError, match="inconsistent byte range"):
        check_safetensors(path)


def test_no_nan_reaches_numpy_cast(tmp_path: Path) -> None:
    """A NaN log-prob in a store of the right types is still refused by the metric engine."""
    path = _store_with(tmp_path, rollout_logprob=pa.array([-1.0, np.nan, -0.5], pa.float32()))
    from mismatch_probe.metrics import compute_metrics

    with pytest.raises(ProbeError, match="NaN"):
        compute_metrics(path)
