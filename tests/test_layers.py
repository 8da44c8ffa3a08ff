"""The architecture, checked: import arrows run one way, and presentation lives in ``report/``.

cli -> (pipeline, ingest) -> report -> gate -> rundir -> (engine, training, routing, metrics)
-> store. Every module has a rank;
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
    "cli": 10, "options": 9,  # the thin layer: options declared once
    "cli_help": 9.5,  # the help around the options: command order, --version, examples
    # the two producers of a run directory, side by side: neither imports the other
    "selftest": 8,  # probe selftest: a scan (pipeline) and the ingest path, faults injected
    "pipeline": 7,  # the orchestration: scan stages, records, run.json, sharding, Ray, attribution
    "ingest": 7,  # a framework's logs instead of our rollouts
    "export": 6,  # a run's numbers into trackers (reads the run through rundir/; watch calls it)
    "report": 5,  # the only stage that renders
    "gate": 4.6,  # probe check and the comparison of runs: numbers and verdicts, no rendering
    "rundir": 4.3,  # the one reader of a run directory: the views report and gate are handed
    "engine": 4, "training": 4,  # the two sides of the mismatch: vLLM, transformers
    "routing": 3,  # MoE routes: shapes, replay, their store and metrics
    "metrics": 2,
    "models": 1, "sampling": 1, "settings": 1, "prompts": 1, "progress": 1, "interrupt": 1,
    "hardware": 1, "option_rules": 1,
    "store": 0,  # the contract between stages
    "parallel": -1,  # work on every core, results in a fixed order
    "malloc": -1,  # glibc's malloc set for batch-sized arrays (the CLI calls it at start)
    "errors": -2,
}  # fmt: skip
# The two sides never import each other, nor the other side's library.
SIDES = {
    "engine": ("transformers", "mismatch_probe.training"),
    "training": ("vllm", "mismatch_probe.engine"),
}
# Imports that render: only the reports stage may make them.
RENDERING = ("rich.table", "rich.columns", "matplotlib")
# What reads a run directory, or computes from its store: the reports stage never does; it
# renders the view it is handed (rundir/), a comparison or a gate result (gate/).
READING_IMPORTS = ("pyarrow", "json.load", "mismatch_probe.store.read", "mismatch_probe.store.open")
READERS = (  # store's readers, and the entry points that read a run directory or its store
    "read_json", "open_parquet", "read_run_metadata", "iter_sequence_batches",
    "resolve_tokens_path", "step_ranges", "step_row_groups", "read_routing",
    "load_run", "load_report", "read_data", "read_run", "load_comparison", "load_routing",
    "read_attribution", "read_steps", "steps_of", "run_integrity", "known_causes",
    "sequence_stats", "rerender_example", "compute_metrics", "compute_integrity",
    "compute_attribution", "compute_step_metrics", "load_trend_run",
)  # fmt: skip
# open(), Path.read_text() / read_bytes(), json.load(s)
READING_CALLS = ("open", "read_text", "read_bytes", "load", "loads")


def _unit(path: Path) -> str:
    """``report/plots.py`` -> ``report``; ``scan.py`` -> ``scan``."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _is_module(name: str) -> bool:
    """``mismatch_probe.report.turns`` names a module (or a package) of ours."""
    parts = name.split(".")
    if parts[0] != "mismatch_probe":
        return False
    where = PACKAGE.joinpath(*parts[1:])
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _imports(path: Path) -> list[str]:
    """Every module name ``path`` imports, type-only and function-level imports included.
    ``from mismatch_probe.report import turns`` imports the module ``report.turns``; a name
    that is no module (``from mismatch_probe.report import render``) imports the package's
    ``__init__``."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            full = [f"{base}.{a.name}" for a in node.names]
            names += full if all(_is_module(n) for n in full) else [base, *full]
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


def test_the_engine_and_training_sides_stay_apart() -> None:
    crossings = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in _modules()
        if _unit(path) in SIDES
        for name in _imports(path)
        if name.startswith(SIDES[_unit(path)])
    ]
    assert crossings == []


def _module_name(path: Path) -> str:
    """``report/plots.py`` -> ``mismatch_probe.report.plots``; a package's ``__init__`` -> it."""
    parts = ("mismatch_probe", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _cycles() -> list[str]:
    """Pairs of modules that import each other (function-level imports included); a package's
    ``__init__`` counts like any module: ``from mismatch_probe.report import render`` inside
    ``report/`` imports it."""
    names = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {
        name: {i for i in _imports(path) if i in names and i != name}
        for name, path in names.items()
    }
    pairs = [(a, b) for a in edges for b in edges[a] if a < b and a in edges[b]]
    return sorted(f"{a} <-> {b}" for a, b in pairs)


def test_no_two_modules_import_each_other() -> None:
    """A module and the one it imports are never imported the other way round (e.g. a plot
    module imports the data it draws; the data module never imports its plot)."""
    assert _cycles() == []


def test_the_pipeline_has_no_branch_per_optional_part() -> None:
    """The routing stage's functions are no-ops for a dense model and attribution's steps
    without ``--attribute``: the pipeline's stages call them unconditionally."""
    stages = ("scan.py", "engines.py", "rescoring.py")
    branches = [
        f"{name}:{node.lineno} {ast.unparse(node.test)}"
        for name in stages
        for node in ast.walk(ast.parse((PACKAGE / "pipeline" / name).read_text()))
        if isinstance(node, ast.If | ast.IfExp)
        and any(word in ast.unparse(node.test) for word in ("routing", "attribute"))
    ]
    assert branches == []


def _reads(path: Path) -> list[str]:
    """What in ``path`` reads a file or a run directory: a reading import, a reader named
    (imported or called as ``store.read_json``), ``open()`` / ``.read_text()`` /
    ``json.load(s)``, a parameter named ``run_dir``."""
    tree = ast.parse(path.read_text())
    found = [f"imports {n}" for n in _imports(path) if n.startswith(READING_IMPORTS)]
    found += [
        f"imports {n}" for n in _imports(path) if n.startswith("mismatch_probe.") and
        n.rsplit(".", 1)[-1] in READERS
    ]  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in READERS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            json_call = isinstance(func, ast.Attribute) and ast.unparse(func.value) == "json"
            if name == "open" or name == "read_text" or (json_call and name in READING_CALLS):
                found.append(f"line {node.lineno}: {ast.unparse(func)}()")
        elif isinstance(node, ast.arg) and node.arg in ("run_dir", "run_dirs"):
            found.append(f"line {node.lineno}: parameter {node.arg}")
    return found


def test_the_report_stage_renders_only() -> None:
    """Every renderer takes a view (``rundir.RunContext``, its entries), a comparison or a gate
    result, never a run directory, and no module of ``report/`` reads a file to find out what to
    say: one reader (``rundir/``) builds the view, the pipeline builds it from memory. report/
    writes its outputs (Markdown, HTML, PNG) into the directory it is handed, and embeds the
    PNGs it drew into the HTML from memory (``report.png.kept``), never reading them back."""
    offenders = [
        f"{path.relative_to(PACKAGE)}: {what}"
        for path in _modules()
        if _unit(path) == "report"
        for what in _reads(path)
    ]
    assert offenders == []


def test_the_stage_records_import_no_report() -> None:
    """The records the scan's stages pass on hold the view (``rundir``), not a renderer."""
    names = _imports(PACKAGE / "pipeline" / "records.py")
    assert [n for n in names if n.startswith("mismatch_probe.report")] == []
