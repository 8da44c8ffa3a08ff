"""``probe watch FORMAT DIR --out RUN``: follow a training run's output while it is written.

The loop: look at DIR (``follow.Follower``), and read each step that is complete and not yet
stored (or whose files changed since: a restarted trainer wrote it again) with the format's own
reader over that one step; store and measure it (``stepstore.StepStore``: metrics and integrity
of that step alone, appended to RUN); raise an alert when a ``--max``/``--min`` bound fails on
the step or an integrity check finds an error (printed; ``--on-alert CMD`` gets it as JSON on
stdin); show it (``report.watch``: a live view in a terminal, one line per step otherwise);
export it (``--export``). Then sleep ``--interval`` and look again.

It stops at ``--until STEP`` (once a step at or past it is stored), at the first alert with
``--exit-on-alert`` (exit 1), or on Ctrl-C / SIGTERM (exit 130 / 143); each way RUN is finished
(``StepStore.finish``: steps.json and the whole run's reports), so ``probe report`` and ``probe
check`` read it like an ingest. Watch holds RUN's writer lock (``store.lock.run_lock``) from
start to end; readers see the last complete step (every file is renamed into place).

What can go wrong while watching, and what is done: a read that races the writer (the step's
files changed during it) is dropped and the step read again; a step that fails to read once
complete is an alert (``unreadable``) and is read again only if its files change; a step's
files removed after it was stored keep their data in RUN (said once; ``run.json``
``watch.removed``); a full disk stops nothing: the step is not stored, watch says so and tries
again at the next look, earlier steps untouched.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mismatch_probe import interrupt, store
from mismatch_probe.errors import ProbeError
from mismatch_probe.gate.bounds import Bound
from mismatch_probe.ingest.alerts import run_on_alert, step_alert
from mismatch_probe.ingest.follow import LAYOUTS, Follower, Seen, Stamp
from mismatch_probe.ingest.formats import get_format
from mismatch_probe.ingest.records import IngestConfig, SeqRecord, StepRange
from mismatch_probe.ingest.run import check_out, run_metadata
from mismatch_probe.ingest.stepstore import StepStore, StoredStep
from mismatch_probe.metrics.integrity import ERROR
from mismatch_probe.report.watch import Display, LiveView, StepRow

FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
RECENT = 60  # steps kept for the live view's trend


@dataclass(frozen=True)
class WatchConfig:
    """One ``probe watch``.

    Args:
        ingest: what a ``probe ingest`` of DIR would take (format, DIR, RUN, ``--model``, ...);
            its ``steps`` bound which steps are read.
        bounds: ``--max`` / ``--min``, checked on every step.
        on_alert: a shell command run with each alert as JSON on its stdin.
        until: stop once a step at or past it is stored.
        exit_on_alert: stop at the first alert, exit 1.
        interval: seconds between two looks at DIR.
        settle: seconds a step file of a marker-less format must stay unchanged to count as
            complete when no later step follows it.
        audit_every: read only every N-th step (``step % N == 0``), keeping a copy of its files
            in ``RUN/rollouts/``.
        exports: the trackers each stored step is written to (``export.ExportSpec``).
    """

    ingest: IngestConfig
    bounds: tuple[Bound, ...] = ()
    on_alert: str | None = None
    until: int | None = None
    exit_on_alert: bool = False
    interval: float = 1.0
    settle: float = 30.0
    audit_every: int | None = None
    exports: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        get_format(self.ingest.format)
        if self.ingest.format not in LAYOUTS:
            raise ProbeError(f"probe watch cannot follow format {self.ingest.format}")
        if not self.interval > 0 or not self.settle >= 0:
            raise ProbeError("--interval must be > 0 seconds and --settle >= 0")
        if self.audit_every is not None and self.audit_every < 1:
            raise ProbeError(f"--audit-every {self.audit_every}: a positive number of steps")
        if self.until is not None and self.until < 0:
            raise ProbeError(f"--until {self.until}: a step number >= 0")

    @property
    def out(self) -> Path:
        return self.ingest.out

    @classmethod
    def from_options(
        cls,
        format_name: str,
        path: Path,
        out: Path,
        max_bound: list[str] | None = None,
        min_bound: list[str] | None = None,
        export: list[str] | None = None,
        export_out: Path | None = None,
        wandb_run: str | None = None,
        project: str = "mismatch-probe",
        model: str | None = None,
        steps: str | None = None,
        trust_pickle: bool = False,
        temperature: float = 1.0,
        batch_tokens: int = 2048,
        **options: Any,
    ) -> WatchConfig:
        """The config of the command line's options (``options``: the fields of the same name:
        ``on_alert``, ``until``, ``exit_on_alert``, ``interval``, ``settle``, ``audit_every``)."""
        from mismatch_probe.export import ExportSpec
        from mismatch_probe.gate.bounds import parse_bounds
        from mismatch_probe.ingest.records import parse_steps

        ingest = IngestConfig(
            format=format_name,
            path=Path(path),
            out=Path(out),
            model=None if model is None else Path(model),
            steps=parse_steps(steps),
            trust_pickle=trust_pickle,
            temperature=temperature,
            batch_tokens=batch_tokens,
        )
        bounds = parse_bounds(max_bound or [], min_bound or []) if max_bound or min_bound else ()
        targets = list(dict.fromkeys(export or []))
        if export_out is not None and len(targets) != 1:
            raise ProbeError("--export-out names one tracker's output: give exactly one --export")
        exports = tuple(ExportSpec.from_options(t, export_out, wandb_run, project) for t in targets)
        return cls(ingest, bounds, exports=exports, **options)


@dataclass
class WatchResult:
    """How the watch ended: RUN, the steps stored, the alerts raised, the exit code (0, or 1
    after an alert with ``--exit-on-alert``) and the report (None without a trained token)."""

    out: Path
    steps: int = 0
    alerts: int = 0
    exit_code: int = 0
    report: Any = None
    stopped: str = ""


def run_watch(cfg: WatchConfig, display: Display) -> WatchResult:
    """Follow DIR into RUN until a stop; see the module docstring."""
    from mismatch_probe.store.lock import run_lock

    ing = cfg.ingest
    fmt = get_format(ing.format)
    check_out(ing.out)
    if fmt.needs_model and ing.model is None:
        raise ProbeError(f"format {ing.format} logs rollout log-probs only: give --model")
    if ing.path.exists() and not ing.path.is_dir():
        raise ProbeError(f"{ing.path} is a file; give the directory the trainer writes to")
    if not ing.path.is_dir() and not ing.path.parent.is_dir():
        raise ProbeError(f"{ing.path}: no such directory, nor its parent")
    ing.out.mkdir(parents=True, exist_ok=True)
    with run_lock(ing.out):
        watcher = Watcher(cfg, display)
        return watcher.run()


class Watcher:
    """The loop of one ``probe watch`` (``run`` until a stop)."""

    def __init__(self, cfg: WatchConfig, display: Display) -> None:
        from mismatch_probe.ingest.rescore_step import Rescorer

        self.cfg = cfg
        self.fmt = get_format(cfg.ingest.format)
        self.display = display
        self.follower = Follower(LAYOUTS[cfg.ingest.format], cfg.ingest.path, cfg.settle)
        self.rescorer = Rescorer(cfg.ingest) if cfg.ingest.model is not None else None
        run = run_metadata(cfg.ingest, self.fmt, _not_read_yet(), self.rescorer_dir())
        run.pop("rewritten_steps", None)  # watch keeps its own (``StepStore``)
        run["kind"] = "ingest"
        run["watch"] = {}
        tokenizer = self.rescorer.tokenizer if self.rescorer is not None else None
        self.store = StepStore(cfg.out, run, tokenizer)
        self.done: dict[int, Stamp] = {}  # step -> stamp of what was stored (or found unreadable)
        self.pending: set[int] = set()  # steps seen, not complete yet
        self.removed: set[int] = set()
        self.result = WatchResult(cfg.out)
        self.recent: deque[StepRow] = deque(maxlen=RECENT)
        self.worst = ""
        self.disk_full = False
        self.off_policy_read = False
        self.exporters: list[Any] = []

    def rescorer_dir(self) -> Path | None:
        return self.rescorer.token_dir if self.rescorer is not None else None

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> WatchResult:
        interrupt.writing_to(self.cfg.out, time.time())
        stopped: BaseException | None = None
        from mismatch_probe.export import open_exporter

        try:
            self.exporters = [open_exporter(spec, self.cfg.out) for spec in self.cfg.exports]
            with interrupt.stage("watching"), self.display:
                waiting = "" if self.cfg.ingest.path.is_dir() else " (it does not exist yet)"
                ing = self.cfg.ingest
                first = (f"watching {ing.format} {ing.path} -> {self.cfg.out}: waiting for the "
                         f"first complete step{waiting}")  # fmt: skip
                self.show(lines=[first])
                while not self.result.stopped:
                    self.look_once()
                    if not self.result.stopped:
                        time.sleep(self.cfg.interval)
        except (interrupt.Interrupted, ProbeError) as exc:  # RUN is finished either way
            stopped = exc
        with interrupt.stage("finishing"):
            for exporter in self.exporters:
                exporter.close()
            self.result.report = self.store.finish()
        if isinstance(stopped, interrupt.Interrupted):
            interrupt.resumable(self.kept)
        if stopped is not None:
            raise stopped
        return self.result

    def kept(self) -> str:
        counts = self.store.run_json().get("counts")
        if not counts:
            return f"no complete step was read; {self.cfg.out} holds no step"
        return (
            f"{self.cfg.out} is a complete run of steps {counts['first_step']}.."
            f"{counts['last_step']} ({counts['steps']} steps): probe report {self.cfg.out}"
        )

    def look_once(self) -> None:
        seen = self.follower.look()
        self.note_removed(seen)
        for step in sorted(seen):
            if self.result.stopped:
                return
            s = seen[step]
            if not self.wanted(step):
                continue
            if not s.complete:
                self.pending.add(step)
                continue
            if self.done.get(step) != s.stamp:
                self.handle(s)
        until = self.cfg.until
        if until is not None and any(s >= until for s in self.done):
            self.result.stopped = f"step {until} reached"

    def wanted(self, step: int) -> bool:
        every = self.cfg.audit_every
        if step not in self.cfg.ingest.steps or (every is not None and step % every):
            return False
        return self.cfg.until is None or step <= self.cfg.until

    def note_removed(self, seen: dict[int, Seen]) -> None:
        """Say once what went away: a stored step's files (its data stays in RUN), a step that
        never completed (it is not read)."""
        lines = []
        for step in sorted((set(self.done) | self.pending) - set(seen) - self.removed):
            self.removed.add(step)
            stored = step in self.done
            self.store.note("removed", {"step": step, "after_reading": stored})
            lines.append(
                f"step {step}'s files were removed after it was read: its data stays in RUN"
                if stored
                else f"step {step} was removed before it was complete: not read"
            )
        for step in set(seen) & self.removed:  # back again: a rewrite will be read
            self.removed.discard(step)
        self.pending &= set(seen)
        if lines:
            self.show(lines=lines)

    # --- one step ------------------------------------------------------------------------------

    def handle(self, seen: Seen) -> None:
        step = seen.step
        try:
            records = self.read(step)
        except ProbeError as exc:
            if self.follower.stamp_now(seen) != seen.stamp:
                return  # the writer was at it: read it again at the next look
            self.unreadable(seen, str(exc))
            return
        except FileNotFoundError:
            return  # removed while read: the next look says so
        if self.follower.stamp_now(seen) != seen.stamp:
            return
        try:
            stored = self.store.add(step, records, self.lag(seen))
        except OSError as exc:
            if not full_disk(exc):
                raise
            if not self.disk_full:
                self.show(lines=[f"disk full writing step {step} into {self.cfg.out} "
                                 f"({store.os_error_reason(exc)}): not stored; trying again at "
                                 "each look, earlier steps kept"])  # fmt: skip
            self.disk_full = True
            return
        if self.disk_full:
            self.disk_full = False
            self.show(lines=[f"space again: step {step} stored"])
        self.done[step] = seen.stamp
        self.pending.discard(step)
        self.after(stored, seen)

    def read(self, step: int) -> list[SeqRecord]:
        """The step's records through the format's own reader (rescored with ``--model``)."""
        if self.cfg.audit_every is not None:
            self.keep_rollouts(step)
        one = replace(self.cfg.ingest, steps=StepRange(step, step))
        if self.rescorer is not None:
            return self.rescorer.records(self.fmt, one, self.follower.root(), step)
        return list(self.fmt.read(one))

    def lag(self, seen: Seen) -> dict[str, float] | None:
        if self.cfg.ingest.format != "probe":
            return None
        from mismatch_probe.ingest.audit import step_lag

        return step_lag(seen.path)

    def keep_rollouts(self, step: int) -> None:
        """``--audit-every``: a copy of the step's files under ``RUN/rollouts/``."""
        import shutil

        root = self.follower.root()
        if root is None:
            return
        target = self.cfg.out / "rollouts"
        target.mkdir(exist_ok=True)
        for entry in root.iterdir():
            match = self.follower.layout.pattern.match(entry.name)
            if match and int(match.group(1)) == step:
                dest = target / entry.name
                if entry.is_dir():
                    shutil.copytree(entry, dest, dirs_exist_ok=True)
                else:
                    shutil.copy2(entry, dest)

    def unreadable(self, seen: Seen, reason: str) -> None:
        self.done[seen.step] = seen.stamp
        self.store.note("unreadable", {"step": seen.step, "reason": reason})
        alert = {"type": "unreadable", "step": seen.step, "message": f"unreadable: {reason}"}
        self.raise_alert(alert, None)

    def after(self, stored: StoredStep, seen: Seen) -> None:
        """Alerts, the view, the exporters; the off-policy bound once the files exist."""
        if not self.off_policy_read:
            self.read_off_policy()
        alert = self.alert_of(stored)
        row = StepRow(
            stored.step, stored.attempt, stored.tokens, stored.metrics,
            alert["message"] if alert else "", worst_of(stored), _lag_max(stored), stored.note,
        )  # fmt: skip
        self.recent.append(row)
        self.result.steps += 1
        if row.worst and (not self.worst or row.worst.startswith(ERROR)):
            self.worst = f"{row.worst} (step {stored.step})"
        for exporter in self.exporters:
            exporter.step(point_of(stored))
        self.show(row=row)
        if alert is not None:
            self.raise_alert(alert, stored)

    def read_off_policy(self) -> None:
        try:
            self.store.run["off_policy"] = self.fmt.off_policy(self.cfg.ingest.path)
            self.off_policy_read = True
        except ProbeError:
            pass  # a config file still being written: read at the next step

    def alert_of(self, stored: StoredStep) -> dict[str, Any] | None:
        return step_alert(stored, self.cfg.bounds)

    def raise_alert(self, alert: dict[str, Any], stored: StoredStep | None) -> None:
        from mismatch_probe.report.watch import alert_line

        alert = {
            "tool": "mismatch_probe",
            "run": str(self.cfg.out),
            "source": str(self.cfg.ingest.path),
            "format": self.cfg.ingest.format,
            **alert,
        }
        self.result.alerts += 1
        lines = [alert_line(alert)]
        if self.cfg.on_alert:
            problem = run_on_alert(self.cfg.on_alert, alert)
            if problem:
                lines.append(problem)
        self.show(lines=lines)
        if self.cfg.exit_on_alert:
            self.result.exit_code = 1
            self.result.stopped = f"alert at step {alert['step']} (--exit-on-alert)"

    # --- the view --------------------------------------------------------------------------

    def status(self, text: str = "") -> str:
        where = f"watching {self.cfg.ingest.format} {self.cfg.ingest.path} -> {self.cfg.out}"
        until = f", until step {self.cfg.until}" if self.cfg.until is not None else ""
        return f"{where}{until}; {self.result.steps} steps stored, {self.result.alerts} alerts" + (
            f"; {text}" if text else ""
        )

    def show(self, row: StepRow | None = None, lines: Iterable[str] = (), status: str = "") -> None:
        view = LiveView(
            title=f"probe watch: {self.cfg.ingest.format}",
            rows=tuple(self.recent),
            k3=tuple(r.metrics["k3_kl"] for r in self.recent if "k3_kl" in r.metrics),
            worst=self.worst,
            status=status or self.status("Ctrl-C stops and finishes the run"),
            alerts=self.result.alerts,
        )
        self.display.show(view, row, list(lines))


def full_disk(exc: OSError) -> bool:
    """A full disk or quota (pyarrow's IO errors carry the reason in words, not an errno)."""
    return exc.errno in FULL_DISK or any(
        text in str(exc) for text in ("No space left", "Disk quota", "File too large")
    )


def point_of(stored: StoredStep) -> Any:
    """A stored step as the exporters take it."""
    from mismatch_probe.export import StepPoint

    return StepPoint(stored.step, stored.metrics, stored.hist, stored.findings, stored.lag)


def worst_of(stored: StoredStep) -> str:
    """``error shifted_by_one`` for the step's first finding (errors first), ``""`` if none."""
    return f"{stored.findings[0].severity} {stored.findings[0].check}" if stored.findings else ""


def _lag_max(stored: StoredStep) -> float | None:
    return None if stored.lag is None else stored.lag["max"]


def _not_read_yet() -> dict[str, Any]:
    return {"max_off_policy_steps": None, "source": "not read yet", "staleness": None}
