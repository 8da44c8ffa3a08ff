"""The attribution views on a hand-made result: exact terminal and Markdown output."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from mismatch_probe.report import attribution
from mismatch_probe.rundir.attribution import order_attribution, read_attribution
from mismatch_probe.rundir.data import read_run

STATS = ("k3", "mean_abs", "p99_abs", "max_abs", "bitwise_identical_fraction", "share")


def link(*values: float) -> dict[str, float]:
    return dict(zip(STATS, values, strict=True))


DATA = {
    "rollout=bf16 | train=bf16": {
        "links": {
            "decode_vs_prefill": link(1e-6, 3e-4, 8e-3, 8e-3, 0.86, 0.02),
            "batch": link(0.0, 0.0, 0.0, 0.0, 1.0, 0.0),
            "kernels": link(3.6e-5, 6.6e-3, 3.1e-2, 3.1e-2, 0.0, 0.98),
            "precision": link(0.0, 0.0, 0.0, 0.0, 1.0, 0.0),
        },
        "dominant": "kernels",
    }
}


def test_dominant_source_in_words() -> None:
    ((setting, result),) = DATA.items()
    assert attribution.dominant_line(setting, result) == (
        "dominant source: engine vs transformers kernels at bf16, 98% of the squared log-ratio"
    )
    precision = {"links": {"precision": link(1, 1, 1, 1, 0, 0.544)}, "dominant": "precision"}
    assert attribution.dominant_line("rollout=fp16 | train=fp32", precision) == (
        "dominant source: rollout vs training dtype (fp16 vs fp32), 54% of the squared log-ratio"
    )
    zero = {"links": {"batch": link(0, 0, 0, 0, 1, 0)}, "dominant": None}
    assert attribution.dominant_line("x", zero) == (
        "dominant source: none (every link is exactly zero)"
    )


def test_terminal_table_exact_output() -> None:
    console = Console(file=io.StringIO(), width=100, force_terminal=True, color_system=None)
    console.print(attribution.terminal_table({"bf16": DATA["rollout=bf16 | train=bf16"]}))
    assert console.file.getvalue().splitlines() == [  # type: ignore[attr-defined]
        "Attribution (links along the spec's path)" + " " * 40,
        "setting  link                    k3  mean |r|  p99 |r|  max |r|  bitwise =  share",
        "bf16     decode_vs_prefill    1e-06    0.0003    0.008    0.008      86.0%   2.0%",
        "         batch                    0         0        0        0     100.0%   0.0%",
        "         kernels            3.6e-05    0.0066    0.031    0.031       0.0%  98.0%",
        "         precision                0         0        0        0     100.0%   0.0%",
    ]


def test_markdown_section_exact_output(tmp_path: Path) -> None:
    plot = tmp_path / "plots" / "attribution.png"
    text = attribution.markdown_section(DATA, plot, tmp_path)
    assert text.splitlines()[:2] == ["## Attribution", ""]
    assert "another order of rungs would split the total differently" in text
    assert "cross terms are left out" in text
    assert text.splitlines()[4:] == [
        "### rollout=bf16 \\| train=bf16",
        "",
        "dominant source: engine vs transformers kernels at bf16, 98% of the squared log-ratio",
        "",
        "| link | what it isolates | k3 | mean \\|r\\| | p99 \\|r\\| | max \\|r\\| | bitwise = "
        "| share |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| `decode_vs_prefill` | engine decode vs prefill | 1e-06 | 0.0003 | 0.008 | 0.008 "
        "| 86.0% | 2.0% |",
        "| `batch` | batch composition in the engine | 0 | 0 | 0 | 0 | 100.0% | 0.0% |",
        "| `kernels` | engine vs transformers kernels | 3.6e-05 | 0.0066 | 0.031 | 0.031 "
        "| 0.0% | 98.0% |",
        "| `precision` | rollout vs training dtype | 0 | 0 | 0 | 0 | 100.0% | 0.0% |",
        "",
        "![attribution](plots/attribution.png)",
    ]
    assert attribution.markdown_section({}, None, tmp_path) == ""


def test_load_restores_path_and_scan_order(tmp_path: Path) -> None:
    """attribution.json's keys are sorted; views show links in path order, settings as run.json."""
    (tmp_path / "run.json").write_text(json.dumps({"settings": ["b", "a"]}))
    result = DATA["rollout=bf16 | train=bf16"]
    (tmp_path / "attribution.json").write_text(
        json.dumps({"a": result, "b": result}, sort_keys=True)
    )
    found = read_attribution(tmp_path)
    assert found is not None
    loaded = order_attribution(found, read_run(tmp_path)["settings"])
    assert list(loaded) == ["b", "a"]
    assert list(loaded["a"]["links"]) == ["decode_vs_prefill", "batch", "kernels", "precision"]
    rows = attribution.compare_rows([loaded, loaded])
    assert rows[0] == ["decode_vs_prefill", "2.0% (k3 1e-06)", "2.0% (k3 1e-06)"]
    assert rows[-1] == ["dominant", "kernels", "kernels"]
