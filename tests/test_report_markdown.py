"""report.md, metrics.json and the PNGs of one fixture run, rendered once per module."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from mismatch_probe.metrics import MetricsConfig
from mismatch_probe.metrics.stream import STRUCTURED_KEYS
from mismatch_probe.pipeline.publish import publish
from mismatch_probe.report.markdown import escape
from mismatch_probe.report.plots import PLOTS
from mismatch_probe.rundir import load_report
from tests.test_report_fixtures import make_run, mixed_seqs, uniform_run

# The fixture stores hold no train_entropy: no entropy plot is drawn (plots.NEEDS).
DRAWN = [name for name in PLOTS if name != "entropy"]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    run = make_run(tmp_path_factory.mktemp("report") / "run", mixed_seqs(), metrics=False)
    return run, publish(*load_report(run))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    return width, height


def table_rows(markdown: str, first_cell: str) -> list[list[str]]:
    """Cells of the table rows whose first cell matches ``first_cell`` (a regex)."""
    rows = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells and re.fullmatch(first_cell, cells[0]):
            rows.append(cells)
    return rows


def test_every_file_exists_and_every_plot_is_a_small_png(rendered) -> None:
    run, paths = rendered
    expected = {"metrics", "integrity", "report", "html"} | {f"plot_{name}" for name in DRAWN}
    assert set(paths) == expected
    for name in DRAWN:
        path = paths[f"plot_{name}"]
        assert path == run / "plots" / f"{name}.png"
        assert png_size(path) == (715, 440)
        assert path.stat().st_size < 150_000


def test_markdown_links_point_at_existing_files(rendered) -> None:
    run, paths = rendered
    text = paths["report"].read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(links) == sorted(f"plots/{name}.png" for name in DRAWN)
    for link in links:
        assert (run / link).is_file()


def test_numbers_in_markdown_equal_metrics_json(rendered) -> None:
    _, paths = rendered
    text = paths["report"].read_text()
    stored = json.loads(paths["metrics"].read_text())
    every = table_rows(text.split("<details>")[1], r"`[^`]+`")
    assert len(every) == len([k for k in stored if k not in STRUCTURED_KEYS])
    for key_cell, value in every:
        assert float(value) == pytest.approx(stored[key_cell.strip("`")], rel=1e-5, abs=1e-12)
    key_rows = table_rows(text.split("## Key metrics")[1].split("##")[0], r"`[^`]+`")
    assert [r[0] for r in key_rows][:3] == ["`num_tokens`", "`num_sequences`", "`k3_kl`"]
    for key_cell, value, _ in key_rows:
        assert float(value) == pytest.approx(stored[key_cell.strip("`")], rel=1e-5, abs=1e-12)
    assert key_rows[0][1] == "19"


def test_worst_token_text_is_inert(rendered) -> None:
    _, paths = rendered
    text = paths["report"].read_text()
    worst = table_rows(text.split("## Worst tokens")[1].split("## ")[0], r"\d+")
    assert worst[0][:2] == ["1", "1:4"]
    assert worst[0][2] == (
        "&lt;script&gt;alert(1)&lt;/script&gt; \\[x<b>\\](javascript:</b>alert(2)) ok"
    )
    assert worst[0][3] == "-1.5" and worst[0][-1] == "low-probability tail"  # p_train 0.089
    assert worst[1][:2] == ["2", "2:2"] and worst[1][-1] == "support flip"
    assert "<script>" not in text
    assert not re.search(r"(?<!\\)\]\(javascript:", text)  # every ] before it is escaped
    assert len(worst) == 10  # the fixture has 19 tokens


@pytest.mark.parametrize(
    ("raw", "escaped"),
    [
        ("<script>alert(1)</script>", "&lt;script&gt;alert(1)&lt;/script&gt;"),
        ("[x](javascript:alert(1))", "\\[x\\](javascript:alert(1))"),
        ("![img](http://e/x.png)", "\\!\\[img\\](http:\u200b//e/x.png)"),  # no autolink
        (
            "**bold** _it_ `code` a|b ~s~ $x$",
            "\\*\\*bold\\*\\* \\_it\\_ \\`code\\` a\\|b \\~s\\~ \\$x\\$",
        ),
        ("a & b &amp; c", "a &amp; b &amp;amp; c"),
        ("line\nnext\tcol\r", "line⏎next⇥col"),
        ("@user #12", "@\u200buser \\#\u200b12"),
        ("back\\slash", "back\\\\slash"),
    ],
)
def test_escape(raw: str, escaped: str) -> None:
    assert escape(raw) == escaped


def test_sections_and_collapsible_metrics(rendered) -> None:
    _, paths = rendered
    text = paths["report"].read_text()
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert headings == [
        "# Mismatch report: tiny-llama",
        "## Settings",
        "## Verdicts",
        "## Key metrics",
        "### What each correction preset would do",
        "## Parity block",
        "## Threshold sweep",
        "## Plots",
        "## Worst tokens",
        "## Outliers",
        "## Mismatch by entropy",
    ]
    assert text.splitlines()[2].startswith("✅ Data integrity: clean")  # first (spec section 8)
    assert text.splitlines()[4].startswith("**Recommendation:** ")  # one sentence at the top
    assert "| precisions | rollout=bf16 \\| train=fp32 |" in text
    assert "<details>\n<summary>Every metric (" in text and text.rstrip().endswith("</details>")


def test_report_recomputes_with_other_thresholds(rendered, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", mixed_seqs())
    before = json.loads((run / "metrics.json").read_text())
    cfg = MetricsConfig(rollout_is_threshold="0.9_1.1", presets=("token_is",))
    publish(*load_report(run, cfg))
    after = json.loads((run / "metrics.json").read_text())
    assert after["config"] == cfg.describe()
    assert after["rollout_is_oob_ratio"] > 0 and "rollout_is_oob_ratio" not in before
    assert "`presets/token_is/eff_sample_size`" in (run / "report.md").read_text()


def test_identical_probabilities_and_large_runs_still_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r = 0 everywhere (fp32 vs fp32): no log axis can hold the zeros, every plot is written;
    a run above SCATTER_MAX gets the 2-D density instead of the scatter."""
    from mismatch_probe.rundir import context

    zero = publish(*load_report(uniform_run(tmp_path / "zero", 0.0, [3, 5])))
    monkeypatch.setattr(context, "SCATTER_MAX", 0)
    dense = publish(*load_report(make_run(tmp_path / "dense", mixed_seqs())))
    for paths in (zero, dense):
        for name in DRAWN:
            assert png_size(paths[f"plot_{name}"]) == (715, 440)
