"""The view of one run (one setting) every report is handed, and how it is built.

``RunContext`` is everything a report shows of a run: metadata, metrics, curves, worst tokens
and outliers in context, the data-integrity findings, the MoE routing and attribution numbers,
an ingested run's trend. ``build_run`` makes it from the run's data files as its producer holds
them (``data.RunData``: the scan's finishing step, an ingest) or as ``data.read_data`` reads them
back (``load_run``), and goes to the Parquet files only for what the data files do not hold: the
worst tokens' text in context, their causes, the raw token probabilities of a small run for the
scatter plot, a multi-turn run's re-render example. The metrics are recomputed from
``tokens.parquet`` (``compute_metrics``) when neither the producer nor ``metrics.json`` has them
for the ``MetricsConfig`` asked for (a missing, unreadable or foreign ``metrics.json`` included).
No model or tokenizer is needed: the scan stored each token's text.

Sign convention: ``r = train_logprob - rollout_logprob``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics import MetricsConfig, compute_metrics
from mismatch_probe.metrics.integrity import Integrity
from mismatch_probe.metrics.stream import STRUCTURED_KEYS, flat_part
from mismatch_probe.rundir.attribution import order_attribution
from mismatch_probe.rundir.data import RunData, read_data
from mismatch_probe.rundir.trend import Steps, Trend

CONTEXT_BEFORE = 6  # tokens of context shown before a worst token
CONTEXT_AFTER = 4  # ... and after it
CAUSES = {True: "support flip", False: "numeric drift", None: "unknown"}
# What a stored metrics.json must hold to be reused (else the metrics are recomputed).
CURVES = ("f_tau", "log_ratio_hist", "position_bins", "prob_hist2d", "rollout_prob_bins",
          "seq_log_ratio_vs_length", "worst_tokens", "seq_weight_hist", "entropy")  # fmt: skip
TABLES = ("threshold_sweep", "outliers")  # ... and these lists of records (spec section 7)
SCATTER_MAX = 20_000  # a run of at most this many tokens gets each token's probabilities


@dataclass(frozen=True)
class WorstToken:
    """One of the tokens of largest ``|r|``, with its neighbours' text."""

    seq_id: int
    position: int
    text: str
    before: str
    after: str
    log_ratio: float
    rollout_logprob: float
    train_logprob: float
    support_flip: bool | None
    known: tuple[str, ...] = ()  # routing / attribution causes found (``causes.known_causes``)

    @property
    def cause(self) -> str:
        """Every cause the run shows for this token (``causes.describe``), ``—`` if none."""
        from mismatch_probe.rundir.causes import describe

        return describe(self.support_flip, self.rollout_logprob, self.train_logprob, self.known)


@dataclass(frozen=True)
class OutlierToken:
    """An outlier sequence (an ``outliers`` record) with its worst token's text in context."""

    record: dict[str, Any]
    text: str
    before: str
    after: str


class TokenProbs(NamedTuple):
    """``[N]`` arrays of one run's valid tokens: probabilities and support-flip flags."""

    rollout: np.ndarray
    train: np.ndarray
    flip: np.ndarray


@dataclass(frozen=True)
class Entry:
    """One column of a comparison: a run, or one setting of a run."""

    label: str
    metrics: dict[str, float]
    curves: dict[str, Any]
    tables: dict[str, Any] = field(default_factory=dict)  # decision_tables


@dataclass(frozen=True)
class RunContext:
    """Everything a report shows about one run (one setting).

    Attributes:
        run_dir: the run directory.
        run: ``run.json`` (or the metadata stored in ``tokens.parquet``; ``{}`` if none).
        metrics: flat ``{name: value}`` (spec names, see ``mismatch_probe.metrics``).
        config: the ``MetricsConfig.describe()`` the metrics were computed with.
        curves: histograms, bins and worst-token records (``metrics.curves``).
        worst: the worst tokens, largest ``|r|`` first, with their text.
        setting: the ``setting`` the metrics cover when one was chosen (a store may hold
            several); None for the whole store.
        integrity: the data-integrity findings of the whole run (``load_report`` computes
            them; None when not loaded).
        tables: what spec section 7 stores beside the flat metrics: ``threshold_sweep``,
            ``outliers`` (each with its re-scan ``command``) and ``recommendation``.
        outliers: the outlier records with their worst token in context.
        per_turn: ``metrics.json``'s ``per_turn`` rows (``metrics.turns``).
        settings: every setting the store holds, in the scan's order (the first is the one
            ``metrics.json`` holds); () for a store without a ``setting`` column.
        probs: every token's probabilities, for a run of at most ``SCATTER_MAX`` tokens.
        drift_example: a multi-turn run's first re-render difference ("" if none).
        routing: ``routing.json`` ({} for a dense model's run).
        attribution: setting -> links (``--attribute``; {} without).
        trend: an ingested run's key metrics against training step (None without steps).
        steps: the per-step metrics the trend was made from (``steps.json``).
        layers: ``layers.json`` (``--layers``; {} without).
    """

    run_dir: Path
    run: dict[str, Any]
    metrics: dict[str, float]
    config: dict[str, Any]
    curves: dict[str, Any]
    worst: tuple[WorstToken, ...]
    setting: str | None = None
    integrity: Integrity | None = None
    tables: dict[str, Any] = field(default_factory=dict)
    outliers: tuple[OutlierToken, ...] = ()
    per_turn: tuple[dict[str, Any], ...] = ()
    settings: tuple[str, ...] = ()
    probs: TokenProbs | None = None
    drift_example: str = ""
    routing: dict[str, Any] = field(default_factory=dict)
    attribution: dict[str, Any] = field(default_factory=dict)
    trend: Trend | None = None
    steps: Steps | None = None
    layers: dict[str, Any] = field(default_factory=dict)

    @property
    def skipped(self) -> tuple[tuple[str, str], ...]:
        """The settings the run asked for that did not run, each with why (``run.json``: a
        rollout setting the backend refused skips every setting it is part of)."""
        why = {
            str(r.get("setting")): str(r["skipped"])
            for r in self.run.get("rollouts") or ()
            if isinstance(r, dict) and r.get("skipped")
        }
        if not why:
            return ()
        asked = self.run.get("settings")
        names = [str(s) for s in asked] if isinstance(asked, list) and asked else list(why)
        return tuple(
            (name, why[name.split(" | ")[0]]) for name in names if name.split(" | ")[0] in why
        )

    @property
    def label(self) -> str:
        """The setting (``rollout=bf16 | train=fp32``), else the directory name."""
        setting = self.setting or self.run.get("setting")
        return setting if isinstance(setting, str) and setting else self.run_dir.name

    def json_dict(self) -> dict[str, Any]:
        """What ``metrics.json`` holds: flat metrics + ``config`` + ``curves`` + ``tables``
        (+ ``per_turn``, + ``first_divergent_layer`` with ``--layers``)."""
        data = {**self.metrics, "config": self.config, "curves": self.curves, **self.tables}
        data = {**data, "per_turn": list(self.per_turn)} if self.per_turn else data
        curve = self.layer_curve()
        return {**data, "first_divergent_layer": curve["first_divergent_layer"]} if curve else data

    def layer_curve(self) -> dict[str, Any] | None:
        """This setting's ``layers.json`` curve (None without ``--layers``)."""
        setting = self.setting or self.run.get("setting")
        found = self.layers.get("settings", {}).get(setting)
        return found if isinstance(found, dict) else None


def load_run(
    run_dir: Path, metrics_config: MetricsConfig | None = None, setting: str | None = None
) -> RunContext:
    """Read one setting of a run directory written by ``probe scan`` or ``probe ingest``: its
    data files (``data.read_data``), then ``build_run``.

    Args:
        run_dir: directory holding ``tokens.parquet`` (and usually ``run.json``,
            ``sequences.parquet``, ``metrics.json``).
        metrics_config: recompute with this config unless ``metrics.json`` was computed with it;
            None reuses ``metrics.json`` (default config when it is missing).
        setting: only the rows of this setting, metrics always recomputed (``metrics.json``
            covers one setting of a store that holds several).

    Raises:
        ProbeError: not a run directory, or an unreadable token store or run metadata.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ProbeError(f"{run_dir} is not a run directory")
    return build_run(run_dir, read_data(run_dir, report=False), metrics_config, setting)


def build_run(
    run_dir: Path,
    data: RunData,
    metrics_config: MetricsConfig | None = None,
    setting: str | None = None,
    integrity_errors: Sequence[str] = (),
    names: Sequence[str] | None = None,
) -> RunContext:
    """The view of one setting of ``run_dir`` from its data files ``data`` (see the module
    docstring for what is read from the store).

    Args:
        data: what the producer holds in memory, or what ``read_data`` read back.
        metrics_config: the metrics' config; ``data.metrics`` computed with another one (or a
            ``metrics.json`` that was) are computed again. None: whatever they were computed with.
        setting: only the rows of this setting (None: the whole store).
        integrity_errors: names of the integrity checks that found an error (the
            recommendation then says to investigate first).
        names: the settings of the store (``setting_names``) when the caller has them.

    Raises:
        ProbeError: not a run directory, or an unreadable token store.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ProbeError(f"{run_dir} is not a run directory")
    tokens = store.resolve_tokens_path(run_dir)
    store.open_parquet(tokens)
    names = setting_names(run_dir, data.order) if names is None else list(names)
    metrics = _metrics_of(run_dir, data, metrics_config, setting, names)
    flat, curves, run = flat_part(metrics), metrics["curves"], data.run
    tables = decision_tables(run, metrics, integrity_errors)
    found = data.attribution if data.attribution is not None else _attribution(tokens)
    return RunContext(
        run_dir=run_dir,
        run=run,
        metrics=flat,
        config=metrics["config"],
        curves=curves,
        worst=_with_causes(run_dir, setting, worst_tokens(tokens, curves.get("worst_tokens", []))),
        setting=setting,
        tables=tables,
        outliers=tuple(outlier_tokens(tokens, tables["outliers"])),
        per_turn=tuple(metrics.get("per_turn") or ()),
        settings=tuple(names),
        probs=read_token_probs(tokens, setting) if _small(flat) else None,
        drift_example=_rerender_example(tokens, setting, flat),
        routing=data.routing,
        attribution=order_attribution(found, _recorded_settings(run)),
        layers=data.layers,
    )


def _metrics_of(
    run_dir: Path,
    data: RunData,
    config: MetricsConfig | None,
    setting: str | None,
    names: Sequence[str],
) -> dict[str, Any]:
    """The producer's metrics of ``setting`` when computed with ``config`` (None: the whole
    store, which for a store of one setting are that setting's), else ``metrics.json``'s or
    computed (``_metrics_data``)."""
    given = data.metrics.get(setting)
    if given is None and setting is None and len(names) == 1:
        given = data.metrics.get(names[0])
    if given is None or (config is not None and given["config"] != config.describe()):
        return _metrics_data(run_dir, config, setting)
    return given


def _attribution(tokens: Path) -> dict[str, Any]:
    """Attribution computed from the store ({} without rung columns): a run whose
    ``attribution.json`` is missing or corrupt."""
    from mismatch_probe.metrics.attribution import compute_attribution

    return compute_attribution(tokens)


def _rerender_example(tokens: Path, setting: str | None, flat: dict[str, float]) -> str:
    """A multi-turn run's first re-render difference ("" for a run without the drift)."""
    if "rerender_trajectory_fraction" not in flat:
        return ""
    from mismatch_probe.metrics.turns import rerender_example

    return rerender_example(tokens, setting) or ""


def _small(flat: dict[str, float]) -> bool:
    """A run small enough for every token's probability in a scatter plot."""
    return flat.get("num_tokens", 0) <= SCATTER_MAX


def _recorded_settings(run: dict[str, Any]) -> list[str]:
    names = run.get("settings")
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _with_causes(
    run_dir: Path, setting: str | None, worst: list[WorstToken]
) -> tuple[WorstToken, ...]:
    """The worst tokens with the routing and attribution causes the run records for them."""
    import dataclasses

    from mismatch_probe.rundir.causes import known_causes

    found = known_causes(run_dir, setting, [(t.seq_id, t.position) for t in worst])
    return tuple(
        dataclasses.replace(t, known=tuple(found.get((t.seq_id, t.position), []))) for t in worst
    )


def decision_tables(
    run: dict[str, Any], data: dict[str, Any], integrity_errors: Sequence[str] = ()
) -> dict[str, Any]:
    """``threshold_sweep``, ``outliers`` (with their re-scan ``command``) and the
    ``recommendation`` of one setting's metrics (``MetricsResult.to_json_dict()``)."""
    from mismatch_probe.metrics.recommend import recommend
    from mismatch_probe.rundir.rescan import rescan_command

    sweep = data.get("threshold_sweep", [])
    outliers = [{**o, "command": rescan_command(run, o)} for o in data.get("outliers", [])]
    found = recommend(flat_part(data), data["config"], sweep, integrity_errors)
    return {"threshold_sweep": sweep, "outliers": outliers, "recommendation": found.to_dict()}


def _stored_metrics(run_dir: Path) -> dict[str, Any] | None:
    """``metrics.json`` if it exists, has the expected shape and holds only finite numbers,
    else None (the metrics are then recomputed from the store: a NaN written by hand or by a
    foreign tool never reaches a report). ``_metrics_data`` reuses it only when its ``store``
    tie (row count and each part's fingerprint) matches the store as it is now."""
    path = run_dir / store.METRICS_FILE
    try:
        data = store.read_json(path)
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("curves"), dict) and "config" in data
    ok = ok and all(name in data["curves"] for name in CURVES) and "k3_kl" in data
    ok = ok and all(isinstance(data.get(name), list) for name in TABLES)
    flat = [v for k, v in data.items() if k not in STRUCTURED_KEYS] if ok else []
    ok = ok and isinstance(data.get("per_turn", []), list)
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat)
    return data if ok and numbers else None


def _metrics_data(
    run_dir: Path, config: MetricsConfig | None, setting: str | None
) -> dict[str, Any]:
    from mismatch_probe.store.fingerprint import STORE_KEY, same_store

    tokens = store.resolve_tokens_path(run_dir)
    stored = _stored_metrics(run_dir) if setting is None else None
    fits = stored is not None and (config is None or stored["config"] == config.describe())
    if stored is not None and fits and same_store(stored.get(STORE_KEY), tokens):
        return stored  # computed with this config from this very store
    return compute_metrics(tokens, config, setting).to_json_dict()


def _token_texts(path: Path, seq_ids: list[int]) -> dict[int, tuple[np.ndarray, list[str]]]:
    """``seq_id -> (positions, texts)`` sorted by position, for the given sequences only."""
    names = store.open_parquet(path, required=()).schema_arrow.names
    if not seq_ids or "token_text" not in names:
        return {}
    table = pq.read_table(
        path, columns=["seq_id", "position", "token_text"], filters=[("seq_id", "in", seq_ids)]
    )
    seq = table.column("seq_id").to_numpy()
    pos = table.column("position").to_numpy()
    text = table.column("token_text").to_pylist()
    out = {}
    for sid in seq_ids:
        rows = np.flatnonzero(seq == sid)
        rows = rows[np.argsort(pos[rows], kind="stable")]
        out[sid] = (pos[rows], [text[i] or "" for i in rows])
    return out


def outlier_tokens(path: Path, records: list[dict[str, Any]]) -> list[OutlierToken]:
    """Each outlier record with the text around its worst token (empty without token text)."""
    texts = _token_texts(path, sorted({int(r["seq_id"]) for r in records}))
    out = []
    for rec in records:
        positions, words = texts.get(int(rec["seq_id"]), (np.zeros(0, int), []))
        hit = np.flatnonzero(positions == rec["worst_position"])
        i = int(hit[0]) if len(hit) else -1
        if i < 0:
            out.append(OutlierToken(rec, "", "", ""))
            continue
        before = "".join(words[max(i - CONTEXT_BEFORE, 0) : i])
        out.append(
            OutlierToken(rec, words[i], before, "".join(words[i + 1 : i + 1 + CONTEXT_AFTER]))
        )
    return out


def worst_tokens(path: Path, records: list[dict[str, Any]]) -> list[WorstToken]:
    """The ``worst_tokens`` records of the curves, each with its text and its neighbours'."""
    texts = _token_texts(path, sorted({int(r["seq_id"]) for r in records}))
    out = []
    for rec in records:
        positions, words = texts.get(int(rec["seq_id"]), (np.zeros(0, int), []))
        hit = np.flatnonzero(positions == rec["position"])
        i = int(hit[0]) if len(hit) else -1
        out.append(
            WorstToken(
                seq_id=int(rec["seq_id"]),
                position=int(rec["position"]),
                text=words[i] if i >= 0 else f"<id {rec.get('token_id')}>",
                before="".join(words[max(i - CONTEXT_BEFORE, 0) : i]) if i >= 0 else "",
                after="".join(words[i + 1 : i + 1 + CONTEXT_AFTER]) if i >= 0 else "",
                log_ratio=float(rec["log_ratio"]),
                rollout_logprob=float(rec["rollout_logprob"]),
                train_logprob=float(rec["train_logprob"]),
                support_flip=rec.get("support_flip"),
            )
        )
    return out


def read_token_probs(path: Path, setting: str | None = None) -> TokenProbs:
    """Every token's rollout and training probability (for the scatter plot of small runs),
    only those of ``setting`` when one is given."""
    names = store.open_parquet(path, required=()).schema_arrow.names
    has_flip = "support_flip" in names
    cols = ["rollout_logprob", "train_logprob"] + (["support_flip"] if has_flip else [])
    where = [("setting", "=", setting)] if setting is not None else None
    table = pq.read_table(path, columns=cols, filters=where).drop_null()
    # exp(min(lp, 0)): a (noisy or bogus) positive log-prob is drawn at 1, never above
    rollout = np.exp(np.minimum(table.column("rollout_logprob").to_numpy().astype(np.float64), 0))
    train = np.exp(np.minimum(table.column("train_logprob").to_numpy().astype(np.float64), 0))
    flip = (
        table.column("support_flip").to_numpy(zero_copy_only=False).astype(bool)
        if has_flip
        else np.zeros(len(rollout), dtype=bool)
    )
    return TokenProbs(rollout, train, flip)


def _parts(text: str) -> set[str]:
    """``rollout=bf16,kv=fp8 | train=fp32`` -> ``{"rollout=bf16", "kv=fp8", "train=fp32"}``."""
    return {p.strip() for half in text.split("|") for p in half.split(",") if p.strip()}


def match_settings(wanted: Sequence[str], names: Sequence[str]) -> tuple[str, ...]:
    """Each ``--setting`` value as the setting it names: a setting's name, or some of its parts
    (``kv=fp8``, ``rollout=bf16``) that only one setting of ``names`` has; a value that names
    none is returned as given (the caller says what the run holds).

    Raises:
        ProbeError: parts that several settings have (they are named).
    """
    out = []
    for value in wanted:
        parts = _parts(value)
        found = [n for n in names if parts <= _parts(n)] if value not in names and parts else []
        if len(found) > 1:
            raise ProbeError(
                f"--setting {value!r} names {len(found)} settings ({'; '.join(found)}): "
                "give more of its parts or the whole name"
            )
        out.append(found[0] if found else value)
    return tuple(out)


def setting_names(run_dir: Path, order: list[str] | None = None) -> list[str]:
    """The settings in the token store, in the scan's order (first = the reference): ``order``
    when the caller knows it (a scan finishing), else ``run.json``'s, else sorted."""
    tokens = store.resolve_tokens_path(run_dir)
    if "setting" not in store.open_parquet(tokens).schema_arrow.names:
        return []
    present = pq.read_table(tokens, columns=["setting"]).column("setting").unique().to_pylist()
    if len(present) < 2:
        return present
    # The store's own run metadata first: written with its rows, never an earlier run's (a scan
    # writes run.json after its reports).
    recorded = store.read_run_metadata(tokens).get("settings")
    order = order or recorded or _recorded_order(run_dir) or sorted(present)
    return [s for s in order if s in present] + [s for s in present if s not in order]


def _recorded_order(run_dir: Path) -> list[str]:
    """``run.json``'s settings ([] when missing or unreadable: it only orders the settings)."""
    try:
        data = store.read_json(run_dir / store.RUN_FILE)
    except (OSError, ValueError):
        return []
    order = data.get("settings") if isinstance(data, dict) else None
    return [str(s) for s in order] if isinstance(order, list) else []
