"""What ``probe watch`` sees of a training output directory: its steps, and which are complete.

One ``Layout`` per format (``LAYOUTS``, keyed like ``formats.FORMATS``), from the same source
files the readers were checked against:

* directory layouts, complete by the format's own marker: prime-rl's ``step_<N>/STABLE``
  (touched once every rank flushed the step, removed when a rank writes to it again), and the
  probe hook's per-rank manifests (``hook.manifest_name``; complete when every rank of its
  ``world_size`` has one);
* file layouts, one file per step written in place with no marker (NeMo-RL's
  ``train_data_step<N>.jsonl``, slime's ``<id>.pt``, Miles' ``rollout_<id>.parquet``, verl-dp,
  SkyRL): a file is complete once a later step's file exists and it has not changed since the
  previous look, or once it has not changed for ``settle`` seconds (the run's last step).

``Follower.look()`` lists the directory once (a stat per step) and returns each step's ``Seen``:
its ``stamp`` changes whenever the step's files change (a rewrite, a marker removed), and
``complete`` says whether it may be read. Reading a step is the format's own reader over that
one step (``formats.FORMATS[name].read`` with ``--steps N``): nothing here parses a file.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe.ingest import miles, nemo_rl, prime_rl, skyrl, slime, verl_dp
from mismatch_probe.ingest.hook import MANIFEST_GLOB

Stamp = tuple[Any, ...]
CACHE_AFTER_NS = 2_000_000_000  # file times tick in jiffies: trust a directory older than this


@dataclass(frozen=True)
class Seen:
    """One step of the directory as last looked at."""

    step: int
    path: Path
    stamp: Stamp
    complete: bool


@dataclass(frozen=True)
class Layout:
    """Where a format's steps are and how to tell a complete one.

    Attributes:
        pattern: a step's directory or file name (group 1: the step number).
        subdir: the folder under DIR that holds them when it exists (else DIR itself).
        marker: directory layouts: ``step dir -> stamp of its markers`` when complete, None
            when not; None for file layouts (complete when settled, see the module docstring).
    """

    pattern: re.Pattern[str]
    subdir: str | None
    marker: Callable[[Path], Stamp | None] | None = None


def _stat(path: Path) -> Stamp | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def stable_marker(directory: Path) -> Stamp | None:
    """prime-rl: the ``STABLE`` marker's stat, None while it is missing."""
    return _stat(directory / prime_rl.STABLE)


def manifest_marker(directory: Path) -> Stamp | None:
    """The probe hook: every rank's manifest (their stats), None until all are there."""
    found = sorted(directory.glob(MANIFEST_GLOB))
    if not found:
        return None
    try:
        world = int(json.loads(found[0].read_text(encoding="utf-8")).get("world_size", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # replaced while being read: look again
    names = {f"_rank_{r}.manifest.json" for r in range(world)}
    if not names <= {p.name for p in found}:
        return None
    return tuple((p.name, _stat(p)) for p in found)


_PRIME_DIR = re.compile(r"step_(\d+)$")
LAYOUTS: dict[str, Layout] = {
    "prime-rl": Layout(_PRIME_DIR, "token_exports", stable_marker),
    "probe": Layout(_PRIME_DIR, None, manifest_marker),
    "nemo-rl": Layout(nemo_rl._STEP_FILE, None),
    "slime": Layout(slime._DUMP_FILE, "train_data"),
    "miles-parquet": Layout(miles._FILE, "dashboard_columns"),
    "verl-dp": Layout(verl_dp._DUMP_FILE, None),
    "skyrl": Layout(skyrl._DUMP_FILE, "dumped_data"),
}


class Follower:
    """Looks at a training output directory again and again (see the module docstring).

    Args:
        layout: the format's ``Layout``.
        path: the directory given to ``probe watch`` (it may not exist yet).
        settle: seconds a file layout's step must stay unchanged to count as complete when no
            later step follows it.
    """

    def __init__(self, layout: Layout, path: Path, settle: float) -> None:
        self.layout = layout
        self.path = path
        self.settle = settle
        self.first_seen: dict[int, tuple[Stamp, float]] = {}  # step -> (stamp, since when)
        self.marked: dict[int, Seen] = {}  # directory layouts: the last look, by dir mtime

    def root(self) -> Path | None:
        """Where the steps are: ``path/subdir`` when it exists, else ``path`` (None: no
        directory yet)."""
        if self.layout.subdir and (self.path / self.layout.subdir).is_dir():
            return self.path / self.layout.subdir
        return self.path if self.path.is_dir() else None

    def look(self, now: float | None = None) -> dict[int, Seen]:
        """Every step there now (two names of one step: the first by name; the reader says
        so when it reads it)."""
        now = time.monotonic() if now is None else now
        root = self.root()
        if root is None:
            return {}
        found: dict[int, Path] = {}
        try:
            entries = sorted(root.iterdir())
        except OSError:
            return {}
        for entry in entries:
            match = self.layout.pattern.match(entry.name)
            if match:
                found.setdefault(int(match.group(1)), entry)
        last = max(found, default=None)
        seen = {}
        for step, entry in found.items():
            stamp = _stat(entry)
            if stamp is None:
                continue  # removed between the listing and now
            seen[step] = self._seen(step, entry, stamp, step != last, now)
        self.first_seen = {s: v for s, v in self.first_seen.items() if s in seen}
        self.marked = {s: v for s, v in self.marked.items() if s in seen}
        return seen

    def _seen(self, step: int, entry: Path, stamp: Stamp, later: bool, now: float) -> Seen:
        if self.layout.marker is not None:
            # a marker comes or goes by a file created, removed or renamed in the step's
            # directory, which changes its mtime: a directory unchanged for longer than the
            # clock's granularity (``CACHE_AFTER_NS``) is not read again
            known = self.marked.get(step)
            if known is not None and known.stamp[0] == stamp[1]:
                return known
            marks = self.layout.marker(entry)
            seen = Seen(step, entry, (stamp[1], marks), marks is not None)
            if time.time_ns() - stamp[1] > CACHE_AFTER_NS:
                self.marked[step] = seen
            return seen
        previous = self.first_seen.get(step)
        if previous is None or previous[0] != stamp:
            self.first_seen[step] = (stamp, now)
            return Seen(step, entry, stamp, False)  # new or changed: look once more first
        settled = now - previous[1] >= self.settle
        return Seen(step, entry, stamp, later or settled)

    def stamp_now(self, step: Seen) -> Stamp | None:
        """``step``'s stamp as it is now (None: gone), to tell a read that raced a writer."""
        stamp = _stat(step.path)
        if stamp is None:
            return None
        if self.layout.marker is not None:
            return (stamp[1], self.layout.marker(step.path))
        return stamp
