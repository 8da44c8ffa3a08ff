"""RUN's step store: what ``probe watch`` appends, one training step at a time.

RUN while it is watched, and after (a complete run that ``probe report``, ``probe check`` and
``probe metrics`` read like an ingest's):

* ``tokens/step_<N>.parquet`` and ``sequences/step_<N>.parquet``: the step's token store (the
  ingest's schema and writer, ``writer.RunStoreWriter``, ids following the earlier steps'),
  written in a hidden directory and renamed into place, so a reader sees whole steps only;
* ``steps.jsonl``: one line per step stored, appended once its part is in place: the step's
  metrics (``compute_metrics`` of that part alone, the numbers ``probe ingest`` gives the step)
  and integrity findings (``compute_integrity`` of the part), counts, the off-policy lag, which
  attempt it is; a line cut by a full disk is truncated away;
* ``run.json``: the ingest's metadata plus ``watch`` (steps stored, rewritten, removed while
  watched, unreadable), rewritten after every step;
* at ``finish``: ``steps.json`` (the last line of each step), then the whole run's reports
  (``metrics.json``, ``integrity.json``, ``report.md``, ``report.html``, plots) in one streaming
  pass over the store, as ``probe report`` makes them.

Old steps are never recomputed: a step costs its own write and metrics, and memory holds one step
plus a few integers per step. A step written again (a restarted trainer) replaces its part (with
new ids) and appends another line; the last line counts, and ``run.json`` lists the step under
``rewritten_steps`` (the report says so).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.records import SeqRecord
from mismatch_probe.ingest.writer import RunStoreWriter
from mismatch_probe.metrics.integrity import Finding

STEPS_LOG = "steps.jsonl"
PART = "step_{:09d}.parquet"


@dataclass(frozen=True)
class StoredStep:
    """One step as stored.

    Attributes:
        step: the training step.
        attempt: 1 for its first reading, 2... when the trainer wrote it again.
        metrics: its flat metrics ({} when it has no valid token).
        findings: its integrity findings (errors first).
        sequences: responses stored; tokens: trained tokens stored.
        lag: the off-policy lag of its rollouts (``{"min", "max", "mean"}`` policy versions),
            or None when the logs do not say.
        note: why it has no metrics, when it has none.
        hist: its histogram of log rho (the ``log_ratio_hist`` curve), None without metrics.
    """

    step: int
    attempt: int
    metrics: dict[str, float]
    findings: tuple[Finding, ...]
    sequences: int
    tokens: int
    lag: dict[str, float] | None = None
    note: str = ""
    hist: dict[str, Any] | None = None


@dataclass
class _Totals:
    """Per step: (sequences, tokens, null log-probs, empty sequences) of its last attempt."""

    steps: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    rules: dict[tuple[str, bool, str], list[int]] = field(default_factory=dict)


class StepStore:
    """Appends steps to RUN (see the module docstring); ``out`` exists and is locked."""

    def __init__(self, out: Path, run: dict[str, Any], tokenizer: Any = None) -> None:
        self.out = out
        self.run = run
        self.tokenizer = tokenizer
        self.attempts: dict[int, int] = {}
        self.next_seq = 0
        self.next_prompt = 0
        self.totals = _Totals()
        self.watch: dict[str, list[Any]] = {"removed": [], "unreadable": []}
        for name in (store.TOKENS_DIR, store.SEQUENCES_DIR):
            (out / name).mkdir(exist_ok=True)
        self.write_run()

    # --- one step ------------------------------------------------------------------------------

    def add(self, step: int, records: Iterable[SeqRecord], lag: dict[str, float] | None = None
            ) -> StoredStep:  # fmt: skip
        """Store one step's records (replacing an earlier attempt of it) and measure it.

        Raises:
            OSError: the disk is full (nothing of the step is left in RUN; earlier steps stay).
            ProbeError: a record the store cannot hold (the reader's message).
        """
        attempt = self.attempts.get(step, 0) + 1
        counts, rules = self._write_part(step, records)
        part = self.part(step)
        metrics, findings, note, hist = self._measure(step, part, counts.tokens, rules)
        stored = StoredStep(step, attempt, metrics, findings, counts.sequences, counts.tokens,
                            lag, note, hist)  # fmt: skip
        self._append(stored, counts)
        self.attempts[step] = attempt
        self.totals.steps[step] = (
            counts.sequences, counts.tokens, counts.null_logprobs, counts.empty_sequences
        )  # fmt: skip
        for key, (n, t) in rules.items():
            seen = self.totals.rules.setdefault(key, [0, 0])
            seen[0] += n
            seen[1] += t
        with suppress(OSError):  # a full disk now: run.json is rewritten after the next step
            self.write_run()
        return stored

    def part(self, step: int) -> Path:
        return self.out / store.TOKENS_DIR / PART.format(step)

    def _write_part(self, step: int, records: Iterable[SeqRecord]) -> tuple[Any, dict]:
        """The step's tokens and sequences into place (a rewrite replaces the earlier part)."""
        tmp = self.out / f".step-{step}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            writer = RunStoreWriter(tmp, self.run, self.tokenizer, self.next_seq, self.next_prompt)
            try:
                for record in records:
                    writer.add(record)
            finally:
                counts = writer.close()
            sequences = self.out / store.SEQUENCES_DIR / PART.format(step)
            if counts.tokens:
                store.move_into_place(tmp / store.SEQUENCES_FILE, sequences)
                store.move_into_place(tmp / store.TOKENS_FILE, self.part(step))
            else:  # nothing trained in this attempt: an earlier attempt's part goes too
                self.part(step).unlink(missing_ok=True)
                sequences.unlink(missing_ok=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.next_seq += counts.sequences
        self.next_prompt = writer.next_prompt
        rules = {(m["rule"], m["applied"], m["detail"]): (m["sequences"], m["tokens"])
                 for m in counts.mask_rules()}  # fmt: skip
        return counts, rules

    def _measure(
        self, step: int, part: Path, tokens: int, rules: dict
    ) -> tuple[dict[str, float], tuple[Finding, ...], str, dict[str, Any] | None]:
        """The step's metrics, findings, note and log-rho histogram, from its part alone."""
        from mismatch_probe.metrics import compute_metrics
        from mismatch_probe.metrics.integrity import compute_integrity

        if not tokens:
            return {}, (), "no trained token", None
        masks = [{"rule": r, "applied": a, "detail": d} for (r, a, d) in rules]
        found = compute_integrity(part, {**self.run, "mask_rules": masks})
        findings = found.steps.get(step, found.findings)
        try:
            result = compute_metrics(part)
        except ProbeError:
            return {}, tuple(findings), "no valid token (every log-prob null or non-finite)", None
        return result.flat(), tuple(findings), "", result.curves["log_ratio_hist"]

    def _append(self, stored: StoredStep, counts: Any) -> None:
        line = {
            "step": stored.step,
            "attempt": stored.attempt,
            "time": time.time(),
            "sequences": stored.sequences,
            "tokens": stored.tokens,
            "null_logprobs": counts.null_logprobs,
            "metrics": stored.metrics,
            "findings": [f.to_dict() for f in stored.findings],
            "lag": stored.lag,
            "note": stored.note,
            "log_ratio_hist": stored.hist,
        }
        append_line(self.out / STEPS_LOG, json.dumps(line, allow_nan=False, sort_keys=True))

    # --- what was said while watching --------------------------------------------------------

    def note(self, kind: str, entry: dict[str, Any]) -> None:
        """Record a step ``removed`` while watched or ``unreadable``, in ``run.json``."""
        self.watch[kind].append(entry)
        self.write_run()

    def run_json(self) -> dict[str, Any]:
        """``run.json``: the metadata, the counts so far and what watching met."""
        steps = sorted(s for s, (_, t, _, _) in self.totals.steps.items() if t)
        values = list(self.totals.steps.values())
        run = {**self.run, "watch": {**self.watch, "steps_stored": len(self.totals.steps)}}
        rewritten = [{"step": s, "attempts": n} for s, n in sorted(self.attempts.items()) if n > 1]
        if rewritten:
            run["rewritten_steps"] = rewritten
        run["mask_rules"] = [
            {"rule": r, "applied": a, "detail": d, "sequences": n, "tokens": t}
            for (r, a, d), (n, t) in self.totals.rules.items()
        ]
        if steps:
            run["counts"] = {
                "steps": len(steps),
                "first_step": steps[0],
                "last_step": steps[-1],
                "sequences": sum(v[0] for v in values),
                "tokens": sum(v[1] for v in values),
                "null_logprobs": sum(v[2] for v in values),
                "empty_sequences_skipped": sum(v[3] for v in values),
                "steps_without_trained_tokens": sorted(
                    s for s, (_, t, _, _) in self.totals.steps.items() if not t
                ),
            }
        return run

    def write_run(self) -> None:
        store.write_json(self.out / store.RUN_FILE, self.run_json())

    # --- the end -------------------------------------------------------------------------------

    def finish(self) -> Any:
        """``steps.json``, ``run.json`` and the whole run's reports; returns the report's
        ``RunContext`` (None when no step holds a valid token: no report is written)."""
        from mismatch_probe.metrics import MetricsConfig
        from mismatch_probe.report import write_outputs
        from mismatch_probe.rundir import load_report, write_data
        from mismatch_probe.rundir.trend import Steps, write_steps

        run = self.run_json()
        store.write_json(self.out / store.RUN_FILE, run)
        steps = {s: m for s, m in last_lines(self.out / STEPS_LOG) if m}
        write_steps(self.out, Steps(MetricsConfig().describe(), dict(sorted(steps.items()))))
        if "counts" not in run or not steps:  # no step with a valid token: nothing to report
            return None
        ctx, entries = load_report(self.out)
        write_outputs(ctx, entries, self.out, write_data(ctx, self.out))
        return ctx


def last_lines(path: Path) -> Iterator[tuple[int, dict[str, float]]]:
    """``(step, metrics)`` of the last line of each step in ``steps.jsonl``, steps in the order
    of their last line."""
    last: dict[int, dict[str, float]] = {}
    if path.exists():
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    data = json.loads(line)
                    last.pop(int(data["step"]), None)
                    last[int(data["step"])] = data["metrics"]
    yield from last.items()


def append_line(path: Path, text: str) -> None:
    """Append one line in one write; a write the disk cuts short is truncated back, so the log
    never ends in half a line (the OSError is raised)."""
    data = (text + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):
                raise OSError(28, "No space left on device", str(path))
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
