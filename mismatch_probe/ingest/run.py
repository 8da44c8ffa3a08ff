"""``probe ingest``: a framework's logs -> a run directory laid out like a scan's.

Everything is written into a hidden sibling directory of ``--out`` and renamed to ``--out``
only when complete, so a failure at any point (bad input found at step 900, an interrupt)
leaves nothing in ``--out``; ``--out`` must not exist or be empty, so nothing there is lost.
An error names ``--out``, never the hidden directory; an interrupt names the stage it hit
(``interrupt.stage``: reading, model loading, rescoring, metrics, reports, writing).

The run: ``tokens.parquet`` (with ``step``), ``sequences.parquet``, ``run.json`` (source,
format version, what was and was not available, the off-policy bound, the format-specific mask
rules applied or not: ``mask_rules``, see ``writer.Counts.mask_rules``), ``metrics.json`` (all
steps together), ``steps.json`` (metrics per step), ``report.md`` and ``plots/`` with the trend
section. ``probe metrics/report/compare/check`` read it like a scan.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe import interrupt, store
from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.batches import SeqBatch, from_records
from mismatch_probe.ingest.formats import Format, get_format
from mismatch_probe.ingest.records import IngestConfig
from mismatch_probe.ingest.writer import Counts, RunStoreWriter
from mismatch_probe.store.lock import LOCK_FILE, run_lock

if TYPE_CHECKING:
    from mismatch_probe.metrics.steps import Written

VERL_LOG = "verl-log"  # verl's file logger: a trend run (``verl_log``), not a token format


@dataclass(frozen=True)
class IngestResult:
    out: Path
    run: dict[str, Any]
    metrics: dict[str, float]
    steps: dict[int, dict[str, float]]
    report: Any  # report.RunContext
    # seconds of each stage: "store" (read the logs and write the store, the metric pass and
    # the integrity checks running beside it on the row groups written), "metrics" (the
    # pass's rest once the store is closed), "reports"
    timings: dict[str, float] = field(default_factory=dict)


def check_out(out: Path) -> None:
    """``--out`` does not exist or is empty (a writer's lock file aside)."""
    if out.exists() and (not out.is_dir() or any(p.name != LOCK_FILE for p in out.iterdir())):
        raise ProbeError(f"--out {out} exists and is not an empty directory; choose a new one")


@contextmanager
def writing(out: Path) -> Iterator[None]:
    """Be the one writer of ``--out`` for the block (``store.lock.run_lock``: a second ingest
    or scan into it is refused at once), ``check_out`` again under the lock (another writer may
    have finished there since the first check), and leave no ``--out`` this call created when
    the block fails."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    ok = False
    try:
        with run_lock(out):
            check_out(out)
            yield
            ok = True
    finally:
        if created and not ok:
            with suppress(OSError):
                (out / LOCK_FILE).unlink()
                out.rmdir()


def run_ingest(cfg: IngestConfig) -> IngestResult:
    """Read, measure and report; see the module docstring."""
    if cfg.format == VERL_LOG:
        return _ingest_verl_log(cfg)
    fmt = get_format(cfg.format)
    check_out(cfg.out)
    if fmt.needs_model and cfg.model is None:
        raise ProbeError(
            f"format {cfg.format} logs rollout log-probs only: give --model to rescore"
        )
    if not cfg.path.exists():
        raise ProbeError(f"{cfg.path}: no such file or directory")
    # A hidden directory beside --out, renamed to it when complete (an empty --out, checked
    # above and again under the writer's lock, is replaced): an interrupted ingest leaves no
    # run that looks complete, and a second writer into --out is refused.
    with (
        writing(cfg.out),
        store.atomic_dir(cfg.out, complete=_never, replace=True) as tmp,
        _named_as(tmp, cfg.out),
    ):
        run, metrics, steps, ctx, timings = _ingest_into(tmp, cfg, fmt)
        check_out(cfg.out)  # the second check, right before the swap
    return IngestResult(cfg.out, run, metrics, steps, replace(ctx, run_dir=cfg.out), timings)


def _ingest_verl_log(cfg: IngestConfig) -> IngestResult:
    """verl's file-logger JSONL as a trend run (``verl_log``), published like any ingest."""
    from mismatch_probe.ingest.verl_log import ingest_verl_log
    from mismatch_probe.rundir.trend_run import load_trend_run

    check_out(cfg.out)
    if cfg.model is not None:
        raise ProbeError("verl-log holds logged metrics, no tokens: --model has nothing to rescore")
    with (
        writing(cfg.out),
        store.atomic_dir(cfg.out, complete=_never, replace=True) as tmp,
        _named_as(tmp, cfg.out),
    ):
        run, steps = ingest_verl_log(cfg.path, tmp, cfg.steps)
        check_out(cfg.out)  # the second check, right before the swap
    view = load_trend_run(cfg.out)
    return IngestResult(cfg.out, run, {}, steps, view)


def _never(path: Path) -> bool:
    """No directory already at ``--out`` counts as this ingest's result."""
    return False


@contextmanager
def _named_as(tmp: Path, out: Path) -> Iterator[None]:
    """Errors name ``--out``, not the hidden directory that is removed when they pass."""
    try:
        yield
    except ProbeError as exc:
        raise ProbeError(str(exc).replace(str(tmp), str(out))) from None
    except OSError as exc:
        for name in ("filename", "filename2"):
            if getattr(exc, name, None) is not None:
                setattr(exc, name, str(getattr(exc, name)).replace(str(tmp), str(out)))
        raise


def _ingest_into(
    tmp: Path, cfg: IngestConfig, fmt: Format
) -> tuple[dict[str, Any], dict[str, float], dict[int, dict[str, float]], Any, dict[str, float]]:
    from mismatch_probe.metrics.attribution import compute_attribution
    from mismatch_probe.report import write_outputs
    from mismatch_probe.rundir import RunData, build_report, write_data
    from mismatch_probe.rundir.trend import Steps

    clock = [time.perf_counter()]
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        clock.append(time.perf_counter())
        timings[name] = clock[-1] - clock[-2]

    with interrupt.stage("reading"):
        off_policy = fmt.off_policy(cfg.path)  # also checks the path's layout before any work
    model_dir, tokenizer, batches = _sources(cfg, fmt)
    run = run_metadata(cfg, fmt, off_policy, model_dir)
    tokens = tmp / store.TOKENS_FILE
    measuring = _Measuring(tokens, run)
    writer = RunStoreWriter(tmp, run, tokenizer, on_table=measuring.put)
    try:
        with interrupt.stage("rescoring" if fmt.needs_model else "reading"):
            try:
                measuring.start(writer.token_schema)
                for batch in batches:
                    writer.add_batch(batch)
            finally:
                counts = writer.close()
        if counts.tokens == 0:
            raise ProbeError(f"{cfg.path}: no trained token in the chosen steps")
        run["counts"] = _counts(counts)
        # before the tables end: the integrity checks read the run's mask rules after them
        run["mask_rules"] = counts.mask_rules()
        store.write_json(tmp / store.RUN_FILE, run)
        lap("store")
        with interrupt.stage("metrics"):
            metrics, steps, integrity = measuring.finish()
            found = compute_attribution(tokens)  # {}: a framework's logs hold no rung
    finally:
        measuring.abort()  # a no-op once finished
    lap("metrics")
    with interrupt.stage("reports"):  # the view from memory; metrics.json written once
        per_step = Steps(metrics.config.describe(), steps)
        data = RunData(
            run,
            metrics={None: metrics.to_json_dict()},
            attribution=found,
            steps=per_step,
            integrity=integrity,
        )
        ctx, entries = build_report(tmp, data)
        write_outputs(ctx, entries, tmp, write_data(ctx, tmp))
    lap("reports")
    return run, metrics.flat(), steps, ctx, timings


def measure(
    tokens: Path, run: dict[str, Any], written: Written | None = None
) -> tuple[Any, dict[int, Any], Any]:
    """The run's metrics, each step's and the integrity findings, in one pass over the store:
    the metric engine reads each batch once (``metrics.steps.compute_by_step``, on every
    core) and hands it to the integrity checks, which run beside it in a thread of their own
    (``metrics.integrity.compute_integrity`` on those batches). With ``written``, the batches
    are the writer's tables as it writes them (``_Measuring``), not read back, and the pass
    runs on one core."""
    from mismatch_probe.metrics.integrity import compute_integrity
    from mismatch_probe.metrics.steps import compute_by_step

    batches: queue.Queue[Any] = queue.Queue(maxsize=4)
    found: dict[str, Any] = {}
    names = None if written is None else written.schema.names

    def check() -> None:
        try:
            found["integrity"] = compute_integrity(tokens, run, iter(batches.get, None), names)
        except BaseException as exc:  # re-raised by the caller, after the pass
            found["error"] = exc
            while batches.get() is not None:  # keep the metric pass from blocking
                pass

    thread = threading.Thread(target=check, name="ingest-integrity", daemon=True)
    thread.start()
    try:
        # As written, the pass runs in one thread beside the readers, which keep every core
        # busy: its own workers would add hand-offs, not cores (the same numbers either way).
        workers = None if written is None else 1
        metrics, steps = compute_by_step(tokens, None, workers, batches.put, written)
    finally:
        batches.put(None)
        thread.join()
    if "error" in found:
        raise found["error"]
    return metrics, steps, found["integrity"]


class _Aborted(Exception):
    """The writer failed or was interrupted: the pass over its tables stops."""


_END, _ABORT = object(), object()


class _Measuring:
    """``measure`` in a thread of its own, fed the token store's row groups as the writer
    writes them (``RunStoreWriter.on_table``): the metric pass and the integrity checks run
    while the logs are read and the store written, and no row group is read back. At most
    ``DEPTH`` tables wait for the pass (memory: the writer's row group, those waiting and the
    pass's own, whatever the number of steps). ``finish`` ends the tables once the store is
    closed and gives the pass's result; ``abort`` stops the pass at its next table (the writer
    failed or was interrupted). An error of the metric pass reaches the writer at its next
    row group (``put``), so a failed pass stops the reading; one of the integrity checks, at
    ``finish``."""

    DEPTH = 4

    def __init__(self, tokens: Path, run: dict[str, Any]) -> None:
        self.tokens, self.run = tokens, run
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=self.DEPTH)
        self.out: dict[str, Any] = {}
        self.ended = False  # the pass took _END or _ABORT: nothing more will be put
        self.aborted = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, schema: Any) -> None:
        from mismatch_probe.metrics.steps import Written

        written = Written(schema, self._tables())
        self.thread = threading.Thread(
            target=self._run, args=(written,), name="ingest-metrics", daemon=True
        )
        self.thread.start()

    def put(self, table: Any) -> None:
        if "error" in self.out:
            raise self.out["error"]
        self.queue.put(table)

    def finish(self) -> tuple[Any, dict[int, Any], Any]:
        self._stop(_END)
        if "error" in self.out:
            raise self.out["error"]
        return self.out["result"]  # type: ignore[no-any-return]

    def abort(self) -> None:
        """Stop the pass without computing the tables still waiting (a no-op once finished)."""
        self.aborted.set()
        with suppress(queue.Empty):
            while True:
                self.queue.get_nowait()
        self._stop(_ABORT)

    def _stop(self, sentinel: object) -> None:
        if self.thread is None or not self.thread.is_alive():
            return
        self.queue.put(sentinel)
        self.thread.join()

    def _tables(self) -> Iterator[Any]:
        while (item := self.queue.get()) is not _END:
            if item is _ABORT or self.aborted.is_set():
                self.ended = item is _ABORT
                raise _Aborted
            yield item
        self.ended = True

    def _run(self, written: Written) -> None:
        try:
            self.out["result"] = measure(self.tokens, self.run, written)
        except BaseException as exc:  # re-raised in the writer's thread
            self.out["error"] = exc
            while not self.ended:  # the writer's puts must not block
                item = self.queue.get()
                self.ended = item is _END or item is _ABORT


def _sources(cfg: IngestConfig, fmt: Format) -> tuple[Path | None, Any, Iterator[SeqBatch]]:
    """The model directory and tokenizer (with ``--model``) and the responses in batches,
    rescored when the format has no training side."""
    if cfg.model is None:
        return None, None, fmt.read_batches(cfg)
    from mismatch_probe import models
    from mismatch_probe.ingest.rescoring import rescored
    from mismatch_probe.sampling import SamplingSpec
    from mismatch_probe.training import rescore

    with interrupt.stage("model_loading"):
        model_dir = models.resolve_model(cfg.model)
        tokenizer = _tokenizer(model_dir)
        model = rescore.load_model(model_dir, cfg.train_dtype) if fmt.needs_model else None
    if model is not None:
        spec = SamplingSpec(temperature=cfg.temperature)
        records = rescored(fmt.read(cfg), model, spec, cfg.train_dtype, cfg.batch_tokens)
        return model_dir, tokenizer, from_records(records)
    return model_dir, tokenizer, fmt.read_batches(cfg)


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:300]
        raise ProbeError(
            f"transformers could not load a tokenizer from {model_dir}: {reason}"
        ) from None


def run_metadata(
    cfg: IngestConfig, fmt: Format, off_policy: dict[str, Any], model_dir: Path | None
) -> dict[str, Any]:
    """``run.json`` of an ingested run (``counts`` added once the store is written)."""
    from mismatch_probe.hardware import library_versions

    train = fmt.train_field or f"rescored with --model ({cfg.train_dtype}, T={cfg.temperature:g})"
    run: dict[str, Any] = {
        "tool": "mismatch_probe",
        "schema_version": store.SCHEMA_VERSION,
        "kind": "ingest",
        "setting": f"{cfg.format}: {fmt.rollout_field} vs {fmt.train_field or 'rescoring'}",
        "source": {
            "format": cfg.format,
            "format_version": fmt.version,
            "path": str(cfg.path.resolve()),
            "checked_against": fmt.checked,
            "steps": {"first": cfg.steps.first, "last": cfg.steps.last},
        },
        "available": {
            "rollout_logprobs": fmt.rollout_field,
            "train_logprobs": train,
            "token_text": model_dir is not None,
            "prompt_text": False,
            "support_flip": False,
            "sampling_parameters": False,
            "train_entropy": False,  # logs hold log-probs, not the logits an entropy needs
        },
        "off_policy": off_policy,
        "versions": library_versions(),
    }
    rewritten = fmt.rewrites(cfg.path, cfg.steps) if cfg.path.is_dir() else []
    if rewritten:  # a restarted writer: the later attempt of each step replaced the earlier
        run["rewritten_steps"] = rewritten
    if model_dir is not None:
        from mismatch_probe import models

        run["model"] = {
            "path": str(model_dir.resolve()),
            "name": model_dir.name,
            "config_sha256": models.config_hash(model_dir),
        }
    return run


def _counts(c: Counts) -> dict[str, Any]:
    return {
        "steps": len(c.steps),
        "first_step": c.steps[0],
        "last_step": c.steps[-1],
        "sequences": c.sequences,
        "tokens": c.tokens,
        "null_logprobs": c.null_logprobs,
        "empty_sequences_skipped": c.empty_sequences,
        "steps_without_trained_tokens": c.steps_without_tokens,
    }
