"""Run the benchmarks: ``python -m tests.bench [name ...]`` (all of ``BENCHES`` by default)."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from contextlib import suppress
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

OUT_DIR = Path("reports/bench")


def _rescoring() -> dict[str, Any]:
    from tests.bench.rescoring import bench_rescoring

    return bench_rescoring()


def _rescoring_lengths() -> dict[str, Any]:
    from tests.bench.lengths import bench_lengths

    return bench_lengths()


def _scan() -> dict[str, Any]:
    from tests.bench.scan import bench_scan

    return bench_scan()


def _lifecycle() -> dict[str, Any]:
    from tests.bench.lifecycle import bench_lifecycle

    return bench_lifecycle()


def _metrics() -> dict[str, Any]:
    from tests.bench.metrics import bench_metrics

    return bench_metrics()


def _ingest() -> dict[str, Any]:
    from tests.bench.ingest import bench_ingest

    return bench_ingest()


def _attribution() -> dict[str, Any]:
    from tests.bench.attribution import bench_attribution

    return bench_attribution()


def _layers() -> dict[str, Any]:
    from tests.bench.layers import bench_layers

    return bench_layers()


def _sharded_scan() -> dict[str, Any]:
    from tests.bench.sharded_scan import bench_sharded_scan

    return bench_sharded_scan()


def _multiturn() -> dict[str, Any]:
    from tests.bench.multiturn import bench_multiturn

    return bench_multiturn()


def _watch() -> dict[str, Any]:
    from tests.bench.watch import bench_watch

    return bench_watch()


def _sharded_metrics() -> dict[str, Any]:
    from tests.bench.sharded_metrics import bench_sharded_metrics

    return bench_sharded_metrics()


def _ingest_duckdb() -> dict[str, Any]:
    from tests.bench.duckdb_compare import bench_ingest_duckdb

    return bench_ingest_duckdb()


def _ingest_nemo_duckdb() -> dict[str, Any]:
    from tests.bench.duckdb_compare import bench_ingest_nemo_duckdb

    return bench_ingest_nemo_duckdb()


def _metrics_duckdb() -> dict[str, Any]:
    from tests.bench.duckdb_compare import bench_metrics_duckdb

    return bench_metrics_duckdb()


def _parquet_floats() -> dict[str, Any]:
    from tests.bench.encoding import bench_parquet_floats

    return bench_parquet_floats()


# The CPU features that decide the speed of bf16 generation and rescoring.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _machine() -> dict[str, Any]:
    """The CPU (model name, core count, matrix-unit flags) and Python of this run."""
    info = {}
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    return {
        "processor": info.get("model name") or platform.processor(),
        "cores": os.cpu_count(),
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
        "python": platform.python_version(),
    }


def _refit() -> dict[str, Any]:
    from tests.bench.refit import bench_refit

    return bench_refit()


BENCHES: dict[str, Callable[[], dict[str, Any]]] = {
    "rescoring": _rescoring,
    "rescoring_lengths": _rescoring_lengths,
    "scan": _scan,
    "metrics": _metrics,
    "ingest": _ingest,
    "ingest_duckdb": _ingest_duckdb,
    "ingest_nemo_duckdb": _ingest_nemo_duckdb,
    "metrics_duckdb": _metrics_duckdb,
    "parquet_floats": _parquet_floats,
    "attribution": _attribution,
    "sharded_scan": _sharded_scan,
    "sharded_metrics": _sharded_metrics,
    "multiturn": _multiturn,
    "lifecycle": _lifecycle,
    "watch": _watch,
    "refit": _refit,
    "layers": _layers,
}


def _flatten(prefix: str, value: Any) -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flatten(f"{prefix}{k}.", v)]
    text = f"{value:,.3f}" if isinstance(value, float) else str(value)
    return [(prefix.rstrip("."), text)]


def main(names: list[str]) -> None:
    console = Console()
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name in names or list(BENCHES):
        console.print(f"[bold]bench {name}[/] ...")
        result = {
            "bench": name,
            "date": datetime.now().isoformat(timespec="seconds"),
            "machine": _machine(),
            "results": BENCHES[name](),
        }
        path = OUT_DIR / f"{name}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        table = Table(title=f"{name} -> {path}")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for key, text in _flatten("", result["results"]):
            table.add_row(key, text)
        console.print(table)


if __name__ == "__main__":
    main(sys.argv[1:])
