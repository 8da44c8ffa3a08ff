"""``probe selftest``: one real scan, then every fault of ``faults.FAULTS`` injected into a copy
of its tokens and passed through the path that would see it in real use; each row holds when
its detector saw it (the clean control: when nothing was seen and ``probe check`` passes).

The scan: the embedded model (or ``model``), ``SCAN_PROMPTS`` prompts x ``SCAN_SAMPLES``
samples of at most ``SCAN_TOKENS`` tokens, float32 on both sides at T = 1 (its mismatch is
rounding alone, so a fault is the only thing to find). The rescored rows score the scan's own
tokens again with the training model (float32, the prompts re-encoded from the stored prompt
text, checked against the scan's training side first). Every faulty copy is a run directory
of its own under ``work``: a token store with ``run.json`` and ``metrics.json``, read by the
same code as any run (``rundir.run_integrity``, ``gate.baseline.gate``).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.selftest.faults import FAULTS, Fault, Tokens

SCAN_PROMPTS, SCAN_SAMPLES, SCAN_TOKENS = 8, 2, 32
K3_BOUND = 1e-2  # the k3 bound of the "check" rows (the CI page's example bound)
REFIT_PROMPTS, REFIT_TOKENS = 2, 8  # the refit row: a short run
RESCORINGS = {  # the training side's other settings, same tokens
    "T=1": SamplingSpec(),
    "T=0.7": SamplingSpec(temperature=0.7),
    "T=1.3": SamplingSpec(temperature=1.3),
    "top_p=0.9": SamplingSpec(top_p=0.9),
}
REBUILT_TOLERANCE = 1e-3  # the re-encoded prompts rescored at T = 1 must give the scan's train


@dataclass(frozen=True)
class Row:
    """One row of the output: the fault, what was seen, whether the row holds."""

    fault: Fault
    seen: str
    held: bool


@dataclass(frozen=True)
class SelftestResult:
    rows: tuple[Row, ...]
    model: str
    tokens: int  # valid tokens of the clean scan

    @property
    def passed(self) -> bool:
        return all(r.held for r in self.rows)


@contextmanager
def work_dir(out: Path | None) -> Iterator[Path]:
    """``out`` (created; it must not exist or be empty), or a temporary directory removed
    afterwards."""
    if out is None:
        with tempfile.TemporaryDirectory(prefix="probe-selftest-") as tmp:
            yield Path(tmp)
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ProbeError(f"--out {out}: exists and is not an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    yield out


def run_selftest(model: Path | None, work: Path, console: Any,
                 faults: tuple[Fault, ...] = FAULTS) -> SelftestResult:  # fmt: skip
    """The scan, then each row of ``faults``; ``work``: an empty directory for the runs."""
    from mismatch_probe.pipeline.config import ScanConfig
    from mismatch_probe.pipeline.scan import run_scan

    cfg = ScanConfig(
        model=model,
        num_prompts=SCAN_PROMPTS,
        samples_per_prompt=SCAN_SAMPLES,
        sampling=SamplingSpec(max_tokens=SCAN_TOKENS),
        rollout_dtypes=("float32",),
        train_dtypes=("float32",),
        out=work / "scan",
    )
    scan = run_scan(cfg, console)
    table = _one_setting(pq.read_table(store.resolve_tokens_path(scan.out_dir)))
    clean = _tokens(table, _rescorings(scan.out_dir, scan.run, table))
    rows = tuple(_row(f, clean, table, scan.run, work) for f in faults)
    name = str(scan.run.get("model", {}).get("name", "model"))
    return SelftestResult(rows, name, int(clean.valid.sum()))


def _one_setting(table: pa.Table) -> pa.Table:
    first = table.column("setting")[0].as_py()
    rows = table.filter(pc.equal(table.column("setting"), first))
    return rows.sort_by([("seq_id", "ascending"), ("position", "ascending")])


def _tokens(table: pa.Table, rescored: dict[str, np.ndarray]) -> Tokens:
    train, rollout = (table.column(c) for c in ("train_logprob", "rollout_logprob"))
    valid = ~(pc.is_null(train).to_numpy(zero_copy_only=False)
              | pc.is_null(rollout).to_numpy(zero_copy_only=False))  # fmt: skip
    as32 = [pc.fill_null(c, 0.0).to_numpy().astype(np.float32) for c in (train, rollout)]
    seq = table.column("seq_id").to_numpy()
    return Tokens(seq, as32[0], as32[1], valid, rescored)


def _rescorings(out: Path, run: dict[str, Any], table: pa.Table) -> dict[str, np.ndarray]:
    """The training side's log-probs of the scan's tokens under each of ``RESCORINGS``."""
    from transformers import AutoTokenizer

    from mismatch_probe.training.rescore import ScoreRequest, load_model, rescore

    model_dir = Path(run["model"]["path"])
    seqs = pq.read_table(out / store.SEQUENCES_FILE, columns=["seq_id", "prompt_text"])
    prompts = dict(
        zip(*(seqs.column(c).to_pylist() for c in ("seq_id", "prompt_text")), strict=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = table.column("token_id").to_numpy()
    seq = table.column("seq_id").to_numpy()
    order = list(dict.fromkeys(seq.tolist()))
    requests = [
        ScoreRequest(
            tokenizer(prompts[s], add_special_tokens=False).input_ids, ids[seq == s].tolist()
        )
        for s in order
    ]
    training = load_model(model_dir, "float32")
    out_scores = {
        key: np.concatenate([s.logprobs for s in rescore(training, requests, spec, 0.0)])
        for key, spec in RESCORINGS.items()
    }
    train = pc.fill_null(table.column("train_logprob"), 0.0).to_numpy()
    gap = float(np.max(np.abs(out_scores["T=1"] - train))) if len(train) else 0.0
    if gap > REBUILT_TOLERANCE:
        raise ProbeError(
            f"selftest: the re-encoded prompts do not give the scan's scores (gap {gap:.3g})"
        )
    return out_scores


def _with_sides(table: pa.Table, t: Tokens, setting: str | None = None) -> pa.Table:
    """``table`` with the two sides of ``t`` (its rows taken out dropped: the store has no
    nulls) and, when given, another ``setting`` name."""
    for name, values in (("train_logprob", t.train), ("rollout_logprob", t.rollout)):
        table = table.set_column(table.column_names.index(name), name, pa.array(values))
    if setting is not None:
        column = pa.array([setting] * table.num_rows, pa.string())
        table = table.set_column(table.column_names.index("setting"), "setting", column)
    return table.filter(pa.array(t.valid))


def _write_run(path: Path, table: pa.Table, run: dict[str, Any]) -> Path:
    """A run directory of ``table``: the token store, ``run.json`` and ``metrics.json`` (of the
    first setting of ``run["settings"]`` when there are several)."""
    from mismatch_probe.metrics import compute_metrics

    path.mkdir(parents=True)
    store.write_table(path / store.TOKENS_FILE, table, store.token_schema(table.column_names), run)
    store.write_json(path / store.RUN_FILE, run)
    first = (run.get("settings") or [None])[0]
    store.write_json(path / store.METRICS_FILE, compute_metrics(path, setting=first).to_json_dict())
    return path


def _ingested(path: Path, table: pa.Table, t: Tokens) -> Path:
    """``t`` written as a framework log (``probe``'s own hook format) and ingested."""
    from mismatch_probe.ingest.hook import ProbeWriter
    from mismatch_probe.ingest.records import IngestConfig
    from mismatch_probe.ingest.run import run_ingest

    starts = t.starts()
    width = int(np.diff(starts).max())
    shape = (len(starts) - 1, width)
    ids, mask = np.zeros(shape, np.int64), np.zeros(shape, np.float32)
    train, rollout = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    token_ids = table.column("token_id").to_numpy()
    for i, (a, b) in enumerate(pairwise(starts)):
        n = b - a
        ids[i, :n], mask[i, :n] = token_ids[a:b], t.valid[a:b]
        train[i, :n], rollout[i, :n] = t.train[a:b], t.rollout[a:b]
    writer = ProbeWriter(path / "log")
    writer.write_step(1, ids, mask, rollout, train, complete=True)
    return run_ingest(IngestConfig("probe", path / "log", path / "run")).out


def _found(run_dir: Path) -> dict[str, str]:
    """``{check: "check (severity)"}`` of the run's integrity findings, with the direction of
    a temperature gap."""
    from mismatch_probe.rundir.integrity import run_integrity

    out = {}
    for f in run_integrity(run_dir).findings:
        text = f"{f.check} ({f.severity})"
        for word in ("sharper", "flatter"):
            if f"the rollout side is {word}" in f.message:
                text += f": the rollout side {word}"
        out[f.check] = text
    return out


def _gate(run_dir: Path, exact: bool = False) -> Any:
    from mismatch_probe.gate.baseline import gate
    from mismatch_probe.gate.config import CheckConfig

    bounds = [] if exact else [f"k3_kl={K3_BOUND:g}"]
    return gate(CheckConfig.from_options(run_dir, maxima=bounds, exact=exact))


def _row(fault: Fault, clean: Tokens, table: pa.Table, run: dict[str, Any], work: Path) -> Row:
    """Inject ``fault`` into a copy of ``clean``, pass it down its path, judge the row."""
    from mismatch_probe.metrics.integrity import CHECKS

    if fault.requires and fault.requires not in CHECKS:
        return Row(fault, f"not built: this probe has no {fault.requires} check", False)
    where = work / _slug(fault.name)
    faulty = fault.inject(clean)
    if fault.path == "ingest":
        found = _found(_ingested(where, table, faulty))
        return Row(fault, _listed(found), fault.expect in found)
    if fault.path == "exact":
        return _exact_row(fault, clean, faulty, table, run, where)
    if fault.path == "matrix":
        return _matrix_row(fault, clean, faulty, table, run, where)
    if fault.path == "refit":
        return _refit_row(fault, Path(run["model"]["path"]), Path(run["prompts"]["path"]), where)
    run_dir = _write_run(where, _with_sides(table, faulty), run)
    found = _found(run_dir)
    if fault.expect == "none":
        result = _gate(run_dir)
        seen = _listed(found) + ("; probe check passes" if result.passed else "; probe check fails")
        return Row(fault, seen, not found and result.passed)
    if fault.expect == "check":
        result = _gate(run_dir)
        failing = [m for s in result.settings for m in s.failing]
        value = json.loads((run_dir / store.METRICS_FILE).read_text())["k3_kl"]
        over = ">" if failing else "<="
        code = int(not result.passed)
        seen = f"probe check: k3_kl = {value:.3g} {over} {K3_BOUND:g}, exit {code}"
        return Row(fault, seen, "k3_kl" in failing and not result.passed)
    return Row(fault, _listed(found), fault.expect in found)


def _exact_row(fault: Fault, clean: Tokens, faulty: Tokens, table: pa.Table,
               run: dict[str, Any], where: Path) -> Row:  # fmt: skip
    """``--exact`` passes the store made bitwise equal and fails its faulty copy."""
    equal = clean.with_sides(rollout=clean.train.copy())
    before = _gate(_write_run(where / "equal", _with_sides(table, equal), run), exact=True)
    after = _gate(_write_run(where / "faulty", _with_sides(table, faulty), run), exact=True)
    p = after.parity[0]
    first = f", the first at seq_id {p.first['seq_id']}" if p.first else ""
    seen = (f"equal store: exit {int(not before.passed)}; rounded: exit {int(not after.passed)}, "
            f"{p.mismatch_count:,} of {p.token_count:,} tokens differ{first}")  # fmt: skip
    return Row(fault, seen, before.passed and not after.passed)


def _matrix_row(fault: Fault, clean: Tokens, faulty: Tokens, table: pa.Table,
               run: dict[str, Any], where: Path) -> Row:  # fmt: skip
    """A two-setting store (the clean one first) gated by the k3 bound: only the faulty setting
    may fail, and by name."""
    good = str(table.column("setting")[0].as_py())
    bad = f"{good} (faulty copy)"
    offset = int(pc.max(table.column("seq_id")).as_py()) + 1
    second = _with_sides(table, faulty, bad)
    second = second.set_column(second.column_names.index("seq_id"), "seq_id",
                               pc.add(second.column("seq_id"), offset))  # fmt: skip
    first = _with_sides(table, clean)
    both = pa.concat_tables([first, second.cast(first.schema)])
    run_dir = _write_run(where, both, {**run, "setting": good, "settings": [good, bad]})
    result = _gate(run_dir)
    failing = [str(s.setting) for s in result.settings if not s.passed]
    seen = f"probe check: exit {int(not result.passed)}, failing: {', '.join(failing) or 'none'}"
    return Row(fault, seen, failing == [bad])


def _refit_row(fault: Fault, model: Path, prompts: Path, where: Path) -> Row:
    """``probe refit`` from the model to itself on the scan's prompts, one tensor of the pushed
    copy perturbed: the audit must name that tensor as mismatched and ``probe check`` fail on
    it (the weight audit needs no cached prefix; the links are not this row's)."""
    from mismatch_probe.pipeline.refit import RefitConfig, perturbed_refit_caught

    cfg = RefitConfig(model, model, where, prompts=prompts, num_prompts=REFIT_PROMPTS,
                      max_tokens=REFIT_TOKENS,
                      vllm_args={"kv_cache_memory_bytes": 128 << 20})  # fmt: skip
    caught, name = perturbed_refit_caught(cfg)
    seen = f"refit audit: {name or 'no tensor'} {'named as mismatched' if caught else 'missed'}"
    return Row(fault, seen, caught)


def _listed(found: dict[str, str]) -> str:
    return "; ".join(found.values()) or "no finding"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
