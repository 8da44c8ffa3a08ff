"""Several runs (or the settings of precision-matrix runs) loaded side by side, and what differs.

``load_comparison`` loads every run (its stored metrics and its data-integrity findings); when a
run holds several settings they are paired by name across the runs (``SettingPair``), the
settings only some runs hold listed as ``unpaired``. ``run_differences`` says what differs
between runs (``IDENTITY``: model, prompts, sampling, hardware), which the reports print as a
warning: such runs measure different things; the baseline gate refuses them
(``baseline.COMPARABLE``). ``with_intervals`` adds the noise of each change against the first
run (the bootstrap over responses of ``probe check --baseline``), which the PR comment judges
changes by. The tables and plots of a comparison are ``report.compare``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.rundir.context import Entry, RunContext, load_run

CHANGE_LEVEL = 0.95  # confidence level of the interval of a change against the first run
Intervals = dict[tuple[int, str], tuple[float, float]]  # (run index, metric) -> interval
# What must match for runs to measure the same thing: (what, path in run.json).
IDENTITY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("model", "name")),
    ("model config", ("model", "config_sha256")),
    ("prompts", ("prompts", "sha256")),  # the token ids of the prompts, as encoded
    ("prompts file", ("prompts", "path")),
    ("prompt count", ("prompts", "count")),
    ("chat template", ("prompts", "chat")),
    ("samples per prompt", ("config", "samples_per_prompt")),
    ("temperature", ("sampling", "temperature")),
    ("top_p", ("sampling", "top_p")),
    ("top_k", ("sampling", "top_k")),
    ("max tokens", ("sampling", "max_tokens")),
    ("seed", ("sampling", "seed")),
    ("log-probs mode", ("sampling", "logprobs_mode")),
    # GPU names, or the CPU's kernel flags (vLLM's CPU kernels differ on AVX2, AVX-512, AMX)
    ("hardware", ("hardware", "compute")),
)


def _lookup(run: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        run = run.get(part, {}) if isinstance(run, dict) else {}
    return None if run == {} else run


def _short(value: Any, width: int = 24) -> str:
    """A long value (a hash, a deep path) cut to its last ``width`` characters."""
    text = str(value)
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def run_differences(labels: list[str], runs: list[dict[str, Any]]) -> list[str]:
    """One line per ``IDENTITY`` field whose value is not the same in every run."""
    lines = []
    for what, path in IDENTITY:
        values = [_lookup(run, path) for run in runs]
        if len({repr(v) for v in values}) > 1:
            pairs = zip(labels, values, strict=True)
            each = "; ".join(f"{label}: {_short(value)}" for label, value in pairs)
            lines.append(f"{what} differs ({each})")
    return lines


def unique_labels(runs: list[RunContext]) -> list[str]:
    """Settings when they tell the runs apart, else directory names, else numbers."""
    for labels in ([r.label for r in runs], [r.run_dir.name for r in runs]):
        if len(set(labels)) == len(labels):
            return labels
    return [f"run {i}: {r.run_dir.name}" for i, r in enumerate(runs, 1)]


@dataclass(frozen=True)
class SettingPair:
    """One setting across the runs compared (``setting`` None: runs of one setting each).

    ``runs[i]`` is run i's context restricted to the setting; ``entries[i]`` its entry,
    labelled with the run's label (the setting is the pair's title)."""

    setting: str | None
    runs: tuple[RunContext, ...]
    entries: tuple[Entry, ...]
    intervals: Intervals = field(default_factory=dict)  # with_intervals

    @property
    def title(self) -> str:
        return f"setting {self.setting}" if self.setting is not None else ""


@dataclass(frozen=True)
class Comparison:
    """Loaded runs, their entries and what differs between them.

    ``runs`` / ``entries``: the first pair's (the only pair when no run holds several settings);
    ``pairs``: every setting the runs share, in the first run's order; ``unpaired``: each
    setting only some runs hold, with the labels of those runs; ``head_only``: those of them
    the last run (HEAD) holds, with its metrics, so that every setting of HEAD is judged."""

    runs: tuple[RunContext, ...]
    entries: tuple[Entry, ...]
    warnings: tuple[str, ...]
    pairs: tuple[SettingPair, ...] = ()
    unpaired: tuple[tuple[str, tuple[str, ...]], ...] = ()
    head_only: tuple[tuple[str, dict[str, float]], ...] = ()  # HEAD's unpaired: (setting, metrics)
    intervals: Intervals = field(default_factory=dict)  # of ``runs`` (no pair), with_intervals

    @property
    def all_pairs(self) -> tuple[SettingPair, ...]:
        return self.pairs or (SettingPair(None, self.runs, self.entries, self.intervals),)

    def unpaired_lines(self) -> list[str]:
        """``rollout=fp16 | train=fp32: only in a`` for each setting not every run holds."""
        return [f"{s}: only in {', '.join(labels)}" for s, labels in self.unpaired]


def default_out_dir() -> Path:
    """``reports/compare-<timestamp>/``, next to the scans' default directories."""
    return Path("reports") / f"compare-{datetime.now():%Y%m%d-%H%M%S}"


def load_comparison(
    run_dirs: list[Path], settings: tuple[str, ...] = (), intervals: bool = False
) -> Comparison:
    """Load every run (its stored metrics); at least two are needed. When a run holds several
    settings (or ``settings`` are asked for), settings are paired by name across the runs: one
    ``SettingPair`` per setting every run holds, the others listed as ``unpaired``. With
    ``intervals``, each change against the first run gets its noise (``with_intervals``).

    Raises:
        ProbeError: fewer than two runs, a ``--setting`` no run holds, no setting in common.
    """
    from mismatch_probe.rundir.context import setting_names

    if len(run_dirs) < 2:
        raise ProbeError("compare needs at least two run directories")
    names = [setting_names(Path(d)) if Path(d).is_dir() else [] for d in run_dirs]
    if not settings and all(len(n) < 2 for n in names):
        runs = [_with_integrity(load_run(d)) for d in run_dirs]
        labels = unique_labels(runs)
        entries = tuple(
            Entry(lab, r.metrics, r.curves) for lab, r in zip(labels, runs, strict=True)
        )
        warnings = tuple(run_differences(labels, [r.run for r in runs]))
        comparison = Comparison(tuple(runs), entries, warnings)
    else:
        comparison = _load_pairs([Path(d) for d in run_dirs], names, settings)
    return with_intervals(comparison) if intervals else comparison


def with_intervals(comparison: Comparison, level: float = CHANGE_LEVEL) -> Comparison:
    """``comparison`` with the bootstrap interval of each change against the first run, per
    pair (``change_intervals``)."""
    if not comparison.pairs:
        return replace(comparison, intervals=change_intervals(comparison.runs, level))
    pairs = tuple(replace(p, intervals=change_intervals(p.runs, level)) for p in comparison.pairs)
    return replace(comparison, pairs=pairs)


def change_intervals(runs: Sequence[RunContext], level: float = CHANGE_LEVEL) -> Intervals:
    """``(run index, metric) -> interval of run's value - the first run's`` for the metrics the
    bootstrap covers (``bootstrap.TERMS``) and runs with enough responses: the same paired
    resampling as ``probe check --baseline``."""
    from mismatch_probe.gate import bootstrap

    stats = [bootstrap.sequence_stats(r.run_dir, r.setting) for r in runs]
    out = {}
    for i in range(1, len(stats)):
        pair = [stats[0], stats[i]]
        for key in bootstrap.TERMS:
            if all(s.usable(key) for s in pair):
                base, head = bootstrap.replicates(pair, key)
                out[(i, key)] = bootstrap.interval(head - base, level)
    return out


def _load_pairs(
    run_dirs: list[Path], names: list[list[str]], wanted: tuple[str, ...]
) -> Comparison:
    """Settings paired by name (see ``load_comparison``); runs labelled by directory."""
    from mismatch_probe.rundir.context import match_settings
    from mismatch_probe.rundir.data import read_run

    order = list(dict.fromkeys(s for n in names for s in n))
    wanted = match_settings(wanted, order)  # kv=fp8: the one setting with that part
    missing = [w for w in wanted if w not in order]
    if missing:
        raise ProbeError(f"--setting {missing[0]!r}: none of the runs holds it")
    order = [s for s in order if s in wanted] if wanted else order
    labels = _dir_labels(run_dirs)
    metas = [read_run(d) for d in run_dirs]
    pairs, unpaired = [], []
    for setting in order:
        holders = [i for i, n in enumerate(names) if setting in n]
        if len(holders) < len(run_dirs):
            unpaired.append((setting, tuple(labels[i] for i in holders)))
            continue
        runs = tuple(load_run(d, setting=setting) for d in run_dirs)
        entries = tuple(
            Entry(lab, r.metrics, r.curves) for lab, r in zip(labels, runs, strict=True)
        )
        pairs.append(SettingPair(setting, runs, entries))
    if not pairs:
        held = "; ".join(
            f"{lab}: {', '.join(n) or 'none'}" for lab, n in zip(labels, names, strict=True)
        )
        raise ProbeError(f"the runs share no setting ({held})")
    warnings = tuple(run_differences(labels, metas))
    first = tuple(_with_integrity(r) for r in pairs[0].runs)  # whole runs: one pass each
    head = len(run_dirs) - 1
    head_only = tuple(
        (setting, load_run(run_dirs[head], setting=setting).metrics)
        for setting, holders in unpaired
        if labels[head] in holders
    )
    return Comparison(first, pairs[0].entries, warnings, tuple(pairs), tuple(unpaired), head_only)


def _with_integrity(run: RunContext) -> RunContext:
    """The run with its data-integrity findings, recomputed from its store."""
    from mismatch_probe.rundir.integrity import run_integrity

    return replace(run, integrity=run_integrity(run.run_dir, run.run))


def _dir_labels(run_dirs: list[Path]) -> list[str]:
    labels = [d.name for d in run_dirs]
    if len(set(labels)) == len(labels):
        return labels
    return [f"run {i}: {d.name}" for i, d in enumerate(run_dirs, 1)]
