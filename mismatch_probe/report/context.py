"""A run directory, loaded once for every report: metadata, metrics, curves, worst tokens.

``load_run`` reads ``run.json`` and ``metrics.json`` and goes back to the Parquet files only for
what the stored metrics do not hold: the worst tokens' text in context, and the raw token
probabilities of a small run for the scatter plot. The metrics are recomputed from
``tokens.parquet`` (``compute_metrics``) when ``metrics.json`` is missing, unreadable, or was
computed with another ``MetricsConfig`` than the one asked for. No model or tokenizer is needed:
the scan stored each token's text.

Sign convention: ``r = train_logprob - rollout_logprob``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics import MetricsConfig, compute_metrics

CONTEXT_BEFORE = 6  # tokens of context shown before a worst token
CONTEXT_AFTER = 4  # ... and after it
CAUSES = {True: "support flip", False: "numeric drift", None: "unknown"}
# What a stored metrics.json must hold to be reused (else the metrics are recomputed).
CURVES = ("f_tau", "log_ratio_hist", "position_bins", "prob_hist2d", "rollout_prob_bins",
          "seq_log_ratio_vs_length", "worst_tokens")  # fmt: skip
NOT_FLAT = ("config", "curves", "per_turn")  # metrics.json keys that are not flat metrics


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

    @property
    def cause(self) -> str:
        """``support flip`` (the top-k/top-p boundary moved) or ``numeric drift``."""
        return CAUSES[self.support_flip]


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
    """

    run_dir: Path
    run: dict[str, Any]
    metrics: dict[str, float]
    config: dict[str, Any]
    curves: dict[str, Any]
    worst: tuple[WorstToken, ...]
    setting: str | None = None
    per_turn: tuple[dict[str, Any], ...] = ()  # metrics.json ``per_turn`` (metrics.turns)

    @property
    def tokens_path(self) -> Path:
        return store.resolve_tokens_path(self.run_dir)

    @property
    def label(self) -> str:
        """The setting (``rollout=bf16 | train=fp32``), else the directory name."""
        setting = self.setting or self.run.get("setting")
        return setting if isinstance(setting, str) and setting else self.run_dir.name

    def json_dict(self) -> dict[str, Any]:
        """What ``metrics.json`` holds: flat metrics + ``config`` + ``curves`` (+ ``per_turn``)."""
        data = {**self.metrics, "config": self.config, "curves": self.curves}
        return {**data, "per_turn": list(self.per_turn)} if self.per_turn else data


def load_run(
    run_dir: Path,
    metrics_config: MetricsConfig | None = None,
    setting: str | None = None,
    data: dict[str, Any] | None = None,
) -> RunContext:
    """Load a run directory written by ``probe scan``.

    Args:
        run_dir: directory holding ``tokens.parquet`` (and usually ``run.json``,
            ``sequences.parquet``, ``metrics.json``).
        metrics_config: recompute with this config unless ``metrics.json`` was computed with it;
            None reuses ``metrics.json`` (default config when it is missing).
        setting: only the rows of this setting, metrics always recomputed (``metrics.json``
            covers one setting of a store that holds several).
        data: the metrics (``MetricsResult.to_json_dict()``) when the caller has computed them
            already with ``metrics_config`` (default config when None): nothing is recomputed.

    Raises:
        ProbeError: not a run directory, or an unreadable token store.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ProbeError(f"{run_dir} is not a run directory")
    tokens = store.resolve_tokens_path(run_dir)
    store.open_parquet(tokens)
    if data is None or (metrics_config is not None and data["config"] != metrics_config.describe()):
        data = _metrics_data(run_dir, metrics_config, setting)
    flat = {k: float(v) for k, v in data.items() if k not in NOT_FLAT}
    curves = data["curves"]
    return RunContext(
        run_dir=run_dir,
        run=_run_metadata(run_dir),
        metrics=flat,
        config=data["config"],
        curves=curves,
        worst=tuple(worst_tokens(tokens, curves.get("worst_tokens", []))),
        setting=setting,
        per_turn=tuple(data.get("per_turn") or ()),
    )


def _run_metadata(run_dir: Path) -> dict[str, Any]:
    path = run_dir / store.RUN_FILE
    if path.exists():
        try:
            return dict(store.read_json(path))
        except (OSError, TypeError, ValueError):
            raise ProbeError(f"{path} is not valid JSON of finite numbers") from None
    return store.read_run_metadata(store.resolve_tokens_path(run_dir))


def _stored_metrics(run_dir: Path) -> dict[str, Any] | None:
    """``metrics.json`` if it exists, has the expected shape and holds only finite numbers,
    else None (the metrics are then recomputed from the store: a NaN written by hand or by a
    foreign tool never reaches a report)."""
    path = run_dir / store.METRICS_FILE
    try:
        data = store.read_json(path)
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("curves"), dict) and "config" in data
    ok = ok and all(name in data["curves"] for name in CURVES) and "k3_kl" in data
    flat = [v for k, v in data.items() if k not in NOT_FLAT] if ok else []
    ok = ok and isinstance(data.get("per_turn", []), list)
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat)
    return data if ok and numbers else None


def _metrics_data(
    run_dir: Path, config: MetricsConfig | None, setting: str | None
) -> dict[str, Any]:
    stored = _stored_metrics(run_dir) if setting is None else None
    if stored is not None and (config is None or stored["config"] == config.describe()):
        return stored
    return compute_metrics(store.resolve_tokens_path(run_dir), config, setting).to_json_dict()


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


class TokenProbs(NamedTuple):
    """``[N]`` arrays of one run's valid tokens: probabilities and support-flip flags."""

    rollout: np.ndarray
    train: np.ndarray
    flip: np.ndarray


def read_token_probs(path: Path, setting: str | None = None) -> TokenProbs:
    """Every token's rollout and training probability (for the scatter plot of small runs),
    only those of ``setting`` when one is given."""
    names = store.open_parquet(path, required=()).schema_arrow.names
    has_flip = "support_flip" in names
    cols = ["rollout_logprob", "train_logprob"] + (["support_flip"] if has_flip else [])
    where = [("setting", "=", setting)] if setting is not None else None
    table = pq.read_table(path, columns=cols, filters=where).drop_null()
    rollout = np.exp(table.column("rollout_logprob").to_numpy().astype(np.float64))
    train = np.exp(table.column("train_logprob").to_numpy().astype(np.float64))
    flip = (
        table.column("support_flip").to_numpy(zero_copy_only=False).astype(bool)
        if has_flip
        else np.zeros(len(rollout), dtype=bool)
    )
    return TokenProbs(rollout, train, flip)
