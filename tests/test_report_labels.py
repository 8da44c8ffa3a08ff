"""Labels that say what ran: the weights' source (GGUF dequantized), no absolute path of the
user's machine in report.md / report.html / the PR comment, ``chat template`` as yes/no, presets
in one order in every renderer."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from mismatch_probe import models, store
from mismatch_probe.metrics.presets import PRESETS
from mismatch_probe.pipeline.publish import publish
from mismatch_probe.report import render
from mismatch_probe.report.comment import run_comment
from mismatch_probe.report.sections import settings_rows
from mismatch_probe.rundir import load_report
from mismatch_probe.rundir.context import load_run
from tests.test_report_fixtures import make_run, mixed_seqs

HOME = "/home/alice/private-project"


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "GGUF Q4_1 dequantized to float32"),
        ("llama-3-8b.Q4_K_M.gguf", "GGUF Q4_K_M dequantized to float32"),
        ("model-f16.gguf", "GGUF F16 dequantized to float32"),
        ("model.gguf", "GGUF dequantized to float32"),  # no type in the name: none claimed
    ],
)
def test_gguf_source(name: str, source: str) -> None:
    assert models.gguf_source(name) == source


def test_model_source_of_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MISMATCH_PROBE_CACHE", str(tmp_path / "cache"))
    default = models.default_model_dir()
    assert models.model_source(default) == "GGUF Q4_1 dequantized to float32"
    converted = tmp_path / "cache" / "models" / "tiny.Q8_0-0123456789ab"
    assert models.model_source(converted) == "GGUF Q8_0 dequantized to float32"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert models.model_source(plain) == "checkpoint (bfloat16)"
    (plain / "config.json").write_text(json.dumps({"dtype": "float16"}))  # newer transformers
    assert models.model_source(plain) == "checkpoint (float16)"
    (plain / models.SOURCE_FILE).write_text(json.dumps({"source": "GGUF Q5_0 dequantized"}))
    assert models.model_source(plain) == "GGUF Q5_0 dequantized"


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose run.json holds absolute paths of the user's machine and a GGUF source."""
    run = make_run(
        tmp_path_factory.mktemp("labels") / "run", mixed_seqs(), prompts=f"{HOME}/p.jsonl"
    )
    meta = json.loads((run / store.RUN_FILE).read_text())
    meta["model"].update(path=f"{HOME}/models/SmolLM2", source="GGUF Q4_1 dequantized to float32")
    meta["prompts"]["chat"] = True
    store.write_json(run / store.RUN_FILE, meta)
    return run


def test_settings_rows_say_what_ran(labelled: Path) -> None:
    ctx = load_run(labelled)
    rows = dict(settings_rows(ctx.run, ctx.label, ctx.metrics))
    assert rows["model"] == "tiny-llama (GGUF Q4_1 dequantized to float32)"
    assert rows["prompts"] == "2 from p.jsonl"
    assert rows["chat template"] == "yes"


def test_no_absolute_path_in_report_html_or_comment(labelled: Path) -> None:
    paths = publish(*load_report(labelled))
    ctx, _ = load_report(labelled)
    comment = run_comment(ctx)
    for text in (paths["report"].read_text(), paths["html"].read_text(), comment):
        assert HOME not in text and str(labelled.parent) not in text
    md = paths["report"].read_text()
    assert "| model | tiny-llama (GGUF Q4\\_1 dequantized to float32) |" in md
    assert "| prompts | 2 from p.jsonl |" in md and "| chat template | yes |" in md
    assert "weights: GGUF Q4\\_1 dequantized to float32" in comment


def test_presets_in_one_order_everywhere(labelled: Path) -> None:
    """metrics.json stores its keys sorted; every renderer still lists presets in PRESETS order."""
    publish(*load_report(labelled))
    stored = json.loads((labelled / store.METRICS_FILE).read_text())["config"]["presets"]
    assert list(stored) == sorted(stored)  # the stored order is alphabetical ...
    md = (labelled / store.REPORT_FILE).read_text()
    section = md.split("What each correction preset")[1].split("\n## ")[0]
    in_md = re.findall(r"^\| `(\w+)` \| ", section, re.M)
    console = Console(file=io.StringIO(), width=200)
    render(*load_report(labelled), console)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    table = out.split("Presets: what each correction would do")[1]
    in_terminal = [n for n in re.findall(r"│ (\w+)\s+│", table) if n in PRESETS]
    assert in_md == in_terminal == [n for n in PRESETS if n in stored]  # ... the reports' is not
