"""The architecture, checked: import arrows run one way, and presentation lives in ``report/``.

cli -> scan -> (rollout, rescore, routing, metrics, report) -> store. Every module has a rank;
a module imports only modules of a lower rank (or of its own package). Type-only imports count:
a cycle for the type checker is still a cycle for the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mismatch_probe

PACKAGE = Path(mismatch_probe.__file__).parent

# Rank of each top-level module or package of mismatch_probe, top of the pipeline first.
RANKS = {
    "cli": 10, "options": 8,  # the thin layer: options declared once
    "sharding": 9,  # a scan split into shards (in this process or as Ray tasks)
    "scan": 7, "ingest": 7,  # the pipelines: our rollouts, or a framework's logs
    "runinfo": 6, "attribution": 6, "raycluster": 6,  # run.json, --attribute rungs, Ray tasks
    "records": 5, "config": 5,  # the records passed between stages, the scan's config
    "report": 4, "tables": 4,  # stages: report renders, tables shapes the store's rows
    "routing": 3,
    "rollout": 2, "rescore": 2, "metrics": 2, "engine_args": 2, "batch_invariant": 2,
    "sampling": 1, "settings": 1, "prompts": 1, "models": 1, "tiny": 1, "progress": 1,
    "devices": 1, "engine_process": 1, "interrupt": 1,  # device maps; an engine's process
    "checkpoint": 0,
    "store": 0,  # the contract between stages
    "dataset": -1,  # a sharded store's parts
    "errors": -2,
}  # fmt: skip
# Imports that render: only the reports stage may make them.
RENDERING = ("rich.table", "rich.columns", "matplotlib")


def _unit(path: Path) -> str:
    """``report/plots.py`` -> ``report``; ``scan.py`` -> ``scan``."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imports(path: Path) -> list[str]:
    """Every module name ``path`` imports, type-only and function-level imports included."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def _modules() -> list[Path]:
    return sorted(
        p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE
    )


def test_every_module_has_a_rank() -> None:
    assert {_unit(p) for p in _modules()} <= set(RANKS)


def test_imports_point_down() -> None:
    upward = []
    for path in _modules():
        unit = _unit(path)
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "mismatch_probe" or len(parts) < 2 or parts[1] == unit:
                continue
            target = parts[1]
            if target in RANKS and RANKS[target] >= RANKS[unit]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert upward == []


def test_only_the_report_stage_renders() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in _modules()
        if _unit(path) != "report"
        for name in _imports(path)
        if name.startswith(RENDERING)
    ]
    assert offenders == []


def test_the_package_holds_no_test_oracle_or_benchmark() -> None:
    names = {p.stem for p in PACKAGE.rglob("*.py")}
    assert not names & {"reference", "reference_diag", "naive_torch"}
    assert not (PACKAGE / "bench").exists()
