"""Bootstrap confidence intervals over sequences for the token-mean metrics of ``TERMS``
(``k3_kl``, ``chi2_token``, ``kl``, ``log_ratio_abs_mean``, ``token_mult_prob_error``,
``f_tau_1.1``, ``f_tau_2``).

Both are ratio estimators over the valid tokens of the batch, ``value = sum_i a_i / sum_i n_i +
offset``, where ``a_i`` is sequence i's sum of a per-token term (``TERMS``) and ``n_i`` its valid
token count (spec: ``k3_kl = mmean(exp(r) - r - 1)``, ``chi2_token = mmean(exp(clampB(r))^2) -
1``). Tokens of one response are not independent, so the resampling unit is the sequence: a
replicate draws ``S`` of the ``S`` valid sequences with replacement (multinomial counts ``w``) and
computes ``w·a / w·n + offset``. ``RESAMPLES`` replicates from a fixed ``SEED``: the same runs
always give the same interval. The interval at level ``q`` is the percentile interval
``[quantile((1-q)/2), quantile((1+q)/2)]``.

Two runs whose valid sequences have the same ``seq_id`` set (same prompts, same samples per
prompt) are resampled *paired* (the same draw of sequences in both), so that a statistic of both
runs, such as ``head - 1.5 * base``, keeps the correlation of a prompt's two responses; other
runs are resampled independently. A run with fewer than ``MIN_SEQUENCES`` valid sequences, or a
term that overflowed, gets no interval.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from mismatch_probe import store
from mismatch_probe.metrics.batch import EPS, batch_from_table, clamp_b, k3_terms, seg_sum
from mismatch_probe.metrics.diagnostics import ratio_spread

MIN_SEQUENCES = 20
RESAMPLES = 2000
SEED = 0
_CHUNK_CELLS = 1 << 22  # resample-by-sequence matrix entries held at once (32 MiB of int64)


def _rho2(r: np.ndarray) -> np.ndarray:
    return np.exp(clamp_b(r)) ** 2


def _outside(tau: float) -> Callable[[np.ndarray], np.ndarray]:
    """1.0 where ``max(rho, 1/rho) > tau`` (the ``f_tau_<tau>`` indicator), else 0.0."""
    return lambda r: (ratio_spread(r) > tau).astype(np.float64)


# metric -> (per-token term of r = train - rollout, offset added to the token mean): every
# metric here is ``mmean(term) + offset`` (metrics spec sections 3, 4 and 6).
TERMS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], float]] = {
    "k3_kl": (k3_terms, 0.0),
    "chi2_token": (_rho2, -1.0),
    "kl": (np.negative, 0.0),  # mmean(rollout_lp - train_lp)
    "log_ratio_abs_mean": (np.abs, 0.0),
    "token_mult_prob_error": (lambda r: np.exp(clamp_b(np.abs(r))), 0.0),
    "f_tau_1.1": (_outside(1.1), 0.0),
    "f_tau_2": (_outside(2.0), 0.0),
}


@dataclass(frozen=True)
class SeqStats:
    """Per-sequence sums of one run (one setting), valid sequences only, by ``seq_id``.

    Attributes:
        seq_id: ``[S]`` int64, ascending.
        n: ``[S]`` float64 valid tokens of each sequence (all > 0).
        sums: metric -> ``[S]`` float64 sum of the metric's per-token term (may hold ``inf``
            where ``exp(r)`` overflowed).
    """

    seq_id: np.ndarray
    n: np.ndarray
    sums: dict[str, np.ndarray]

    @property
    def num_sequences(self) -> int:
        return len(self.seq_id)

    def value(self, metric: str) -> float:
        """The metric on all sequences (what the metric engine reports)."""
        return float(self.sums[metric].sum() / (self.n.sum() + EPS) + TERMS[metric][1])

    def usable(self, metric: str) -> bool:
        """Enough sequences, and every sum finite."""
        ok = self.num_sequences >= MIN_SEQUENCES
        return ok and bool(np.isfinite(self.sums[metric]).all())


def sequence_stats(run_dir: Path, setting: str | None = None) -> SeqStats:
    """Read a run's token store once: per-sequence sums of every ``TERMS`` metric, only the
    rows of ``setting`` when given."""
    path = store.resolve_tokens_path(Path(run_dir))
    has_setting = "setting" in store.open_parquet(path).schema_arrow.names
    columns = [*store.METRIC_COLUMNS, *(["setting"] if has_setting else [])]
    ids, counts, sums = [], [], {m: [] for m in TERMS}  # type: ignore[var-annotated]
    for table in store.iter_sequence_batches(path, columns):
        if setting is not None and has_setting:
            table = table.filter(pc.equal(table.column("setting"), setting))
        if not table.num_rows:
            continue
        b = batch_from_table(table)
        keep = b.n > 0
        ids.append(b.seq_id[keep])
        counts.append(b.n[keep])
        with np.errstate(over="ignore"):
            for metric, (term, _) in TERMS.items():
                sums[metric].append(seg_sum(b, term(b.r))[keep])
    order = np.argsort(np.concatenate(ids or [np.zeros(0, np.int64)]), kind="stable")

    def joined(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts or [np.zeros(0)])[order]

    seq_id = joined(ids).astype(np.int64)
    return SeqStats(seq_id, joined(counts), {m: joined(v) for m, v in sums.items()})


def _weights(rng: np.random.Generator, s: int, resamples: int) -> Iterator[np.ndarray]:
    """``[c, s]`` multinomial counts (each row sums to ``s``), ``resamples`` rows in all."""
    chunk = max(1, _CHUNK_CELLS // max(s, 1))
    uniform = np.full(s, 1.0 / s)
    done = 0
    while done < resamples:
        c = min(chunk, resamples - done)
        yield rng.multinomial(s, uniform, size=c).astype(np.float64)
        done += c


def paired(runs: Sequence[SeqStats]) -> bool:
    """True when every run has the same valid ``seq_id`` set (resampled with one draw)."""
    first = runs[0].seq_id
    return all(np.array_equal(r.seq_id, first) for r in runs[1:])


def replicates(
    runs: Sequence[SeqStats], metric: str, resamples: int = RESAMPLES, seed: int = SEED
) -> list[np.ndarray]:
    """``[resamples]`` bootstrap replicates of ``metric`` for each run: one shared draw of
    sequences when the runs are ``paired``, independent draws (from one seed) otherwise."""
    offset = TERMS[metric][1]
    out: list[list[np.ndarray]] = [[] for _ in runs]
    if paired(runs):
        for w in _weights(np.random.default_rng(seed), runs[0].num_sequences, resamples):
            for i, run in enumerate(runs):
                out[i].append(w @ run.sums[metric] / (w @ run.n + EPS) + offset)
    else:
        rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(len(runs))]
        for i, (run, rng) in enumerate(zip(runs, rngs, strict=True)):
            for w in _weights(rng, run.num_sequences, resamples):
                out[i].append(w @ run.sums[metric] / (w @ run.n + EPS) + offset)
    return [np.concatenate(parts) for parts in out]


def interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    """The percentile interval of ``samples`` at confidence ``level`` (e.g. 0.95)."""
    lo, hi = np.quantile(samples, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)
