"""The sharded token store: one table as a hive-partitioned directory of Parquet parts.

A sharded scan (``probe scan --shards N``) writes each table as a directory instead of one file::

    tokens/shard=0/part-0.parquet      tokens/shard=0/_SUCCESS
    tokens/shard=1/part-0.parquet      tokens/shard=1/_SUCCESS
    sequences/shard=0/part-0.parquet   sequences/shard=0/_SUCCESS   ...

Each part is written under a hidden temporary name and renamed when complete
(``store.write_table``), and a shard's ``_SUCCESS`` marker (JSON: the shard's prompts and row
counts) is written once all of the shard's parts are in place, the tokens marker last. A shard
directory without its marker is unfinished: readers refuse the directory (``part_files``), and
``--resume`` redoes the shard.
Names starting with ``.`` or ``_`` are skipped by every Parquet dataset reader (pyarrow, Spark,
DuckDB), so temporary parts and markers never look like data.

Readers take a file or such a directory alike: ``part_files`` lists the parts in shard order.
This module knows only file names; ``store`` reads and writes the tables and the markers
(``store.mark_done``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError

MARKER = "_SUCCESS"
PART = "part-0.parquet"
_SHARD_DIR = re.compile(r"^shard=(\d+)$")


def shard_dir(table_dir: Path, shard: int) -> Path:
    """``<table_dir>/shard=<shard>``."""
    return table_dir / f"shard={shard}"


def part_path(table_dir: Path, shard: int) -> Path:
    """The Parquet part of ``shard`` in ``table_dir`` (parent directories created)."""
    folder = shard_dir(table_dir, shard)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / PART


def shards(table_dir: Path) -> dict[int, Path]:
    """``shard number -> shard directory`` of every ``shard=K`` directory, in shard order."""
    if not table_dir.is_dir():
        return {}
    found = {}
    for child in table_dir.iterdir():
        match = _SHARD_DIR.match(child.name)
        if match and child.is_dir():
            found[int(match.group(1))] = child
    return dict(sorted(found.items()))


def done_shards(table_dir: Path) -> dict[int, dict[str, Any]]:
    """``shard number -> marker contents`` of the finished shards of ``table_dir``."""
    done = {}
    for k, folder in shards(table_dir).items():
        marker = folder / MARKER
        if marker.is_file():
            try:
                done[k] = json.loads(marker.read_text(encoding="utf-8"))
            except ValueError:
                continue  # an unreadable marker: the shard is redone
    return done


def part_files(path: Path) -> list[Path]:
    """The Parquet files of a table: ``[path]`` for a file; for a directory, its parts.

    A directory of ``shard=K`` folders gives each finished shard's parts, shards in numeric
    order; any other directory gives its visible ``*.parquet`` files, by name, recursively.

    Raises:
        ProbeError: no such path, no part, or an unfinished shard (no ``_SUCCESS`` marker).
    """
    if not path.exists():
        raise ProbeError(f"no such file: {path}")
    if not path.is_dir():
        return [path]
    sharded = shards(path)
    if sharded:
        unfinished = [k for k, folder in sharded.items() if not (folder / MARKER).is_file()]
        if unfinished:
            listed = ", ".join(map(str, unfinished))
            raise ProbeError(
                f"{path}: shard(s) {listed} unfinished (no {MARKER}); "
                "finish them with probe scan --resume"
            )
        files = [f for folder in sharded.values() for f in _visible_parquet(folder)]
    else:
        files = _visible_parquet(path)
    if not files:
        raise ProbeError(f"{path}: no Parquet part in this directory")
    return files


def _visible_parquet(folder: Path) -> list[Path]:
    """``*.parquet`` under ``folder``, skipping names (and folders) that start with . or _."""
    return sorted(
        p
        for p in folder.rglob("*.parquet")
        if not any(part.startswith((".", "_")) for part in p.relative_to(folder).parts)
    )
